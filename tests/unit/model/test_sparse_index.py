"""The DSA indexer's selection as indices: the same keys as the dense rule it replaced (rank every
visible key, stable sort, keep the first topk), whatever the chunking, for packed rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncrl.model.sparse_index import causal_key_ranges, select_topk, selection_mask


def _dense_rule(q_BHTd, w_BTH, keys_BSd, visible_BTS, topk) -> torch.Tensor:
    """The dense [B, T, S] form: score every key, hide the invisible ones, stable sort, keep topk."""
    d = q_BHTd.shape[-1]
    scores_BHTS = F.relu(q_BHTd @ keys_BSd.transpose(-1, -2).unsqueeze(1)) * d**-0.5
    index_BTS = torch.einsum("bth,bhts->bts", w_BTH, scores_BHTS).masked_fill(~visible_BTS, float("-inf"))
    order_BTS = index_BTS.sort(dim=-1, descending=True, stable=True).indices
    keep_BTS = torch.zeros_like(visible_BTS).scatter_(-1, order_BTS[..., :topk], True)
    return keep_BTS & visible_BTS


def _inputs(B: int, H: int, T: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, d, generator=gen)
    keys = torch.randn(B, T, d, generator=gen)
    keys[:, ::4] = 0.0  # every fourth key scores exactly 0 for every query: ties at the k-th place
    w = torch.randn(B, T, H, generator=gen)
    return q, w, keys


@pytest.mark.parametrize("topk", [1, 5, 16, 60, 100])
def test_selection_equals_the_dense_stable_sort_rule(topk):
    B, H, T, d = 2, 3, 60, 8
    q, w, keys = _inputs(B, H, T, d, seed=topk)
    positions = torch.stack([torch.arange(T), torch.cat([torch.arange(n) for n in (7, 30, 23)])])
    first, last = causal_key_ranges(positions)
    keys_pos = torch.arange(T)
    visible = (keys_pos >= first[..., None]) & (keys_pos <= last[..., None])
    want = _dense_rule(q, w, keys, visible, topk)
    for budget in (None, 1, 5 * H * T):
        idx = select_topk(q, w, keys, first, last, topk, max_score_elements=budget)
        assert idx.shape == (B, T, min(topk, T)) and idx.dtype == torch.int32
        assert torch.equal(selection_mask(idx, T), want)
        valid = idx >= 0
        assert torch.equal(valid.sum(-1), want.sum(-1))
        assert bool((valid[..., :-1] >= valid[..., 1:]).all())  # -1 places come last
        held = torch.where(valid, idx, T)
        assert bool((held[..., :-1] < held[..., 1:]).logical_or(~valid[..., 1:]).all())  # ascending


def test_causal_key_ranges_follow_packed_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 5, 6]])  # restarts at 3 and jumps at 5: three sequences
    first, last = causal_key_ranges(positions)
    assert first.tolist() == [[0, 0, 0, 3, 3, 5, 5]] and last.tolist() == [[0, 1, 2, 3, 4, 5, 6]]

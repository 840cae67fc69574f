"""The DSA lightning indexer's top-k selection as a pure function, shared by the trainer's
attention backend and the engine's paged one (asyncrl.model.dsa builds the inputs).

Shape legend: B batch, H index heads, T queries, S keys, d index head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["IndexQuery", "select_topk"]


class IndexQuery(NamedTuple):
    """What a DSA layer hands its attention backend. On a "shared" layer q/w/k are None and the
    backend reuses the selection it made for `source_layer`."""

    q_BHTd: torch.Tensor | None  # [B, H, T, d] index queries of the new tokens (RoPE applied)
    w_BTH: torch.Tensor | None  # [B, T, H] per-head weights (1/sqrt(H) applied)
    k_BTd: torch.Tensor | None  # [B, T, d] index keys of the new tokens (what a KV cache keeps)
    topk: int
    source_layer: int


@torch.no_grad()
def select_topk(
    q_BHTd: torch.Tensor, w_BTH: torch.Tensor, keys_BSd: torch.Tensor, visible_BTS: torch.Tensor, topk: int
) -> torch.Tensor:
    """Bool [B, T, S]: each query's top-`topk` visible keys by sum_h w_h relu(q_h . k) / sqrt(d)."""
    d = q_BHTd.shape[-1]
    scores_BHTS = F.relu(q_BHTd.float() @ keys_BSd.float().transpose(-1, -2).unsqueeze(1)) * d**-0.5
    index_BTS = torch.einsum("bth,bhts->bts", w_BTH.float(), scores_BHTS)
    index_BTS = index_BTS.masked_fill(~visible_BTS, float("-inf"))
    # A stable sort, not topk: keys whose scores tie (relu makes exact zeros common) are taken in
    # position order, so the trainer (whole row) and the engine (cached context) pick the same keys.
    order_BTS = index_BTS.sort(dim=-1, descending=True, stable=True).indices
    keep_BTS = torch.zeros_like(visible_BTS)
    keep_BTS.scatter_(-1, order_BTS[..., : min(topk, index_BTS.shape[-1])], True)
    return keep_BTS & visible_BTS

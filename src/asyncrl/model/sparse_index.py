"""The DSA lightning indexer's top-k selection as a pure function, shared by the trainer's
attention backend, context parallel and the engine's paged one (asyncrl.model.dsa builds the inputs).

A selection is an index tensor, never a mask: `idx_BTK` holds for each query the positions of its
K = min(topk, S) chosen keys in ascending order, then -1 in the places left over when the query
sees fewer than K keys.
Its memory is linear in T for a fixed top-k. Which keys a query may see is a contiguous range
[first, last] of key positions (causal, within its packed sequence), so nothing of size [T, S]
is needed to describe visibility either.

Shape legend: B batch, H index heads, T queries, S keys, W keys scored in one chunk, d index head
dim, K selected keys per query.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "CPU_SCORE_ELEMENTS",
    "MAX_SCORE_ELEMENTS",
    "IndexQuery",
    "causal_key_ranges",
    "select_topk",
    "selection_mask",
]


# Elements of the fp32 [B, H, queries, W] score block scored at once (512 MiB). At long context
# the whole block does not fit (GLM-5, 131k tokens: 32 heads x 131k x 131k x 4 bytes = 2.2 TB), so
# select_topk ranks the queries in chunks of this size; the result does not depend on it. On a CPU
# the chunks are smaller (4 MiB): each pass over a fresh buffer of hundreds of MiB page-faults
# (the allocator maps and unmaps blocks that large), so big chunks run several times slower there.
MAX_SCORE_ELEMENTS = 2**27
CPU_SCORE_ELEMENTS = 2**20


class IndexQuery(NamedTuple):
    """What a DSA layer hands its attention backend. On a "shared" layer q/w/k are None and the
    backend reuses the selection it made for `source_layer`; `reused` tells a "full" layer's
    backend that a later "shared" layer will ask for its selection (otherwise it is not kept)."""

    q_BHTd: torch.Tensor | None  # [B, H, T, d] index queries of the new tokens (RoPE applied)
    w_BTH: torch.Tensor | None  # [B, T, H] per-head weights (1/sqrt(H) applied)
    k_BTd: torch.Tensor | None  # [B, T, d] index keys of the new tokens (what a KV cache keeps)
    topk: int
    source_layer: int
    reused: bool = False


def causal_key_ranges(position_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first_BT, last_BT): the keys token t of a packed row sees are first[t] .. last[t] = t, from
    the start of its sequence (where positions stop counting up by one) to itself."""
    B, T = position_ids_BT.shape
    arange_T = torch.arange(T, device=position_ids_BT.device)
    starts_BT = torch.ones_like(position_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    first_BT = torch.where(starts_BT, arange_T, 0).cummax(dim=1).values
    return first_BT, arange_T.expand(B, T)


def _chunks(B: int, T: int, per_query: int, budget: int) -> list[tuple[slice, slice]]:
    """(rows, queries) blocks of at most `budget // per_query` queries (at least one)."""
    n = max(1, budget // per_query)
    if n >= T:
        rows = max(1, n // T)
        return [(slice(b, b + rows), slice(0, T)) for b in range(0, B, rows)]
    return [(slice(b, b + 1), slice(t, t + n)) for b in range(B) for t in range(0, T, n)]


@torch.no_grad()
def select_topk(
    q_BHTd: torch.Tensor,
    w_BTH: torch.Tensor,
    keys_BSd: torch.Tensor,
    first_BT: torch.Tensor,
    last_BT: torch.Tensor,
    topk: int,
    *,
    max_score_elements: int | None = None,
) -> torch.Tensor:
    """int32 [B, T, K], K = min(topk, S): each query's top-`topk` keys among positions
    first[t] .. last[t] by sum_h w_h relu(q_h . k) / sqrt(d), ascending; -1 fills the last places
    of a query that sees fewer than K keys.

    Queries are scored a chunk at a time against only the keys their ranges reach (at least K),
    at most `max_score_elements` (default MAX_SCORE_ELEMENTS, CPU_SCORE_ELEMENTS on a CPU) fp32
    scores per chunk, so the transient memory stays bounded however long the context is.
    """
    B, H, T, _ = q_BHTd.shape
    S = keys_BSd.shape[1]
    K = min(topk, S)
    out_BTK = torch.empty(B, T, K, dtype=torch.int32, device=q_BHTd.device)
    budget = max_score_elements or (CPU_SCORE_ELEMENTS if q_BHTd.device.type == "cpu" else MAX_SCORE_ELEMENTS)
    for rows, queries in _chunks(B, T, H * S, budget):
        first, last = first_BT[rows, queries], last_BT[rows, queries]
        hi = int(last.max()) + 1
        lo = max(0, min(int(first.min()), hi - K))
        hi = max(hi, lo + K)
        pos_W = torch.arange(lo, hi, device=q_BHTd.device)
        visible_btW = (pos_W >= first[..., None]) & (pos_W <= last[..., None])
        if hi - lo == K:  # the window holds K keys: all of them are kept, no need to rank
            cols_btK = pos_W.expand(*visible_btW.shape[:2], K) - lo
        else:
            index_btW = _index_scores(q_BHTd[rows, :, queries], w_BTH[rows, queries], keys_BSd[rows, lo:hi])
            cols_btK = _top_positions(index_btW.masked_fill_(~visible_btW, float("-inf")), K)
        out_BTK[rows, queries] = _fill_last(cols_btK + lo, visible_btW.gather(-1, cols_btK), S)
    return out_BTK


def _index_scores(q_bHtd: torch.Tensor, w_btH: torch.Tensor, keys_bWd: torch.Tensor) -> torch.Tensor:
    """fp32 [b, t, W]: sum_h w_h relu(q_h . k) / sqrt(d), accumulated one head at a time (fewer
    passes over the block than scoring every head first)."""
    H, d = q_bHtd.shape[1], q_bHtd.shape[-1]
    keys_bdW = keys_bWd.float().transpose(1, 2)
    w_btH = w_btH.float() * d**-0.5
    index_btW = None
    for h in range(H):
        head_btW = torch.bmm(q_bHtd[:, h].float(), keys_bdW).relu_()
        if index_btW is None:
            index_btW = head_btW.mul_(w_btH[..., h, None])
        else:
            index_btW.addcmul_(head_btW, w_btH[..., h, None])
    return index_btW


def _fill_last(pos_btK: torch.Tensor, valid_btK: torch.Tensor, S: int) -> torch.Tensor:
    """int32 positions with the places of invisible keys set to -1 and moved to the end."""
    if bool(valid_btK.all()):
        return pos_btK.int()
    pos_btK = torch.where(valid_btK, pos_btK, S).sort(dim=-1).values
    return pos_btK.masked_fill_(pos_btK == S, -1).int()


def _top_positions(index_btW: torch.Tensor, K: int) -> torch.Tensor:
    """Column positions [b, t, K] of each row's K largest scores, ascending. Ties at the K-th
    score go to the earliest positions (relu makes exact zeros common), so the trainer (whole row),
    context parallel (gathered keys) and the engine (cached context) pick the same keys."""
    kth_bt1 = index_btW.topk(K, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above_btW = index_btW > kth_bt1
    tied_btW = index_btW == kth_bt1
    room_bt1 = K - above_btW.sum(-1, keepdim=True)
    if bool((tied_btW.sum(-1, keepdim=True) == room_bt1).all()):  # no tie straddles the K-th place
        keep_btW = above_btW.logical_or_(tied_btW)
    else:
        keep_btW = above_btW.logical_or_(tied_btW.logical_and_(tied_btW.cumsum(-1) <= room_bt1))
    b, t = keep_btW.shape[:2]
    return keep_btW.nonzero()[:, -1].view(b, t, K)


def selection_mask(idx_BTK: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool [B, T, S] with the selected keys set: the dense form of a selection, for the masked
    reference path only (the sparse path never builds it)."""
    B, T, _ = idx_BTK.shape
    mask_BTS = torch.zeros(B, T, num_keys + 1, dtype=torch.bool, device=idx_BTK.device)
    cols = torch.where(idx_BTK >= 0, idx_BTK.long(), num_keys)  # -1 goes to a spare last column
    return mask_BTS.scatter_(-1, cols, True)[..., :num_keys]

"""The DSA lightning indexer's top-k selection as a pure function, shared by the trainer's
attention backend and the engine's paged one (asyncrl.model.dsa builds the inputs).

Shape legend: B batch, H index heads, T queries, S keys, d index head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["IndexQuery", "select_topk"]


# Elements of the fp32 [B, H, queries, S] score block scored at once (512 MiB). At long context
# the whole block does not fit (GLM-5, 131k tokens: 32 heads x 131k x 131k x 4 bytes = 2.2 TB), so
# select_topk ranks the queries in chunks of this size; the result does not depend on it.
MAX_SCORE_ELEMENTS = 2**27


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


@torch.no_grad()
def select_topk(
    q_BHTd: torch.Tensor,
    w_BTH: torch.Tensor,
    keys_BSd: torch.Tensor,
    visible_BTS: torch.Tensor,
    topk: int,
    *,
    max_score_elements: int = MAX_SCORE_ELEMENTS,
) -> torch.Tensor:
    """Bool [B, T, S]: each query's top-`topk` visible keys by sum_h w_h relu(q_h . k) / sqrt(d).

    Queries are ranked `max_score_elements // (B * H * S)` at a time (at least one), so the
    transient fp32 scores stay bounded however long the context is.
    """
    B, H, T, d = q_BHTd.shape
    S = keys_BSd.shape[1]
    keys_B1dS = keys_BSd.float().transpose(-1, -2).unsqueeze(1)
    keep_BTS = torch.zeros_like(visible_BTS)
    step = max(1, max_score_elements // (B * H * S))
    for t0 in range(0, T, step):
        rows = slice(t0, t0 + step)
        scores_BHtS = F.relu(q_BHTd[:, :, rows].float() @ keys_B1dS) * d**-0.5
        index_BtS = torch.einsum("bth,bhts->bts", w_BTH[:, rows].float(), scores_BHtS)
        index_BtS = index_BtS.masked_fill(~visible_BTS[:, rows], float("-inf"))
        # A stable sort, not topk: keys whose scores tie (relu makes exact zeros common) are taken
        # in position order, so the trainer (whole row) and the engine (cached context) pick the
        # same keys.
        order_BtS = index_BtS.sort(dim=-1, descending=True, stable=True).indices
        keep_BTS[:, rows].scatter_(-1, order_BtS[..., : min(topk, S)], True)
    return keep_BTS & visible_BTS

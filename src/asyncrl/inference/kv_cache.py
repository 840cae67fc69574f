"""The paged KV cache as plain buffers, and the attention backend that reads and writes it.

All tokens scheduled in one engine step are flattened into a single row [1, N]. Each layer's
attention sees the new tokens' q/k/v (after q/k-norm and RoPE), writes k/v into their slots, and
attends each sequence's new queries over that sequence's cached plus new keys. Decode-only
sequences (one new token) are batched into one padded SDPA call; prefill chunks run one call each.

The routing pool sits next to the KV pool, slot for slot, so a cached block keeps the expert
ids its tokens were routed to, and a prefix-cache hit still returns routing.

Shape legend: N scheduled tokens, S sequences, C context (keys) per sequence, H query heads,
G kv heads, Dh head dim, L layers, K top_k, P = num_blocks * block_size slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from asyncrl.inference.request import Request

__all__ = ["KVCache", "PagedAttention", "SeqSlice"]


class KVCache:
    """Per-layer key/value buffers [P, G, Dh] and the routed-expert buffer [P, L, K] (int16)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        routing_top_k: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        P = num_blocks * block_size
        self.k_LPGd = torch.zeros(num_layers, P, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_LPGd = torch.zeros_like(self.k_LPGd)
        self.routing_PLK = torch.zeros(P, num_layers, routing_top_k, dtype=torch.int16, device=device)

    def slots(self, req: Request, end: int) -> torch.Tensor:
        """Flat slot index of token positions [0, end) of `req`, from its (incrementally kept) slot table."""
        bs = self.block_size
        have = 0 if req.slot_table is None else req.slot_table.numel() // bs
        if have < len(req.block_ids):
            blocks = torch.tensor(req.block_ids[have:], dtype=torch.long, device=self.k_LPGd.device)
            new = (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).flatten()
            req.slot_table = new if req.slot_table is None else torch.cat([req.slot_table, new])
        return req.slot_table[:end]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_LPGd, self.v_LPGd, self.routing_PLK))


@dataclass(frozen=True, kw_only=True)
class SeqSlice:
    """One sequence's share of a step: new tokens [q_start, q_start + q_len) of the flattened row,
    attending over `key_slots` (its C = num_computed + q_len context slots, in position order)."""

    q_start: int
    q_len: int
    key_slots: torch.Tensor  # long [C]


class PagedAttention:
    """`AttentionBackend` over a KVCache for one engine step (built once per step, used by every layer)."""

    def __init__(self, cache: KVCache, seqs: list[SeqSlice], slots_N: torch.Tensor) -> None:
        self.cache, self.slots_N = cache, slots_N
        self.prefills = [s for s in seqs if s.q_len > 1]
        decodes = [s for s in seqs if s.q_len == 1]
        self.decode_rows_S: torch.Tensor | None = None
        if decodes:
            device = slots_N.device
            self.decode_rows_S = torch.tensor([s.q_start for s in decodes], device=device)
            lengths = [len(s.key_slots) for s in decodes]
            self.decode_slots_SC = pad_sequence([s.key_slots for s in decodes], batch_first=True)
            self.decode_mask_S11C = None
            if min(lengths) != max(lengths):
                lengths_S = torch.tensor(lengths, device=device)
                mask_SC = torch.arange(max(lengths), device=device)[None, :] < lengths_S[:, None]
                self.decode_mask_S11C = mask_SC[:, None, None, :]

    def __call__(
        self, q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor, layer_idx: int
    ) -> torch.Tensor:
        # Flat [P, G * Dh] views: index_select / index_copy_ on rows are far faster than fancy indexing.
        G, Dh = k_BGTd.shape[1], k_BGTd.shape[3]
        k_PF = self.cache.k_LPGd[layer_idx].view(-1, G * Dh)
        v_PF = self.cache.v_LPGd[layer_idx].view(-1, G * Dh)
        k_PF.index_copy_(0, self.slots_N, k_BGTd[0].transpose(0, 1).reshape(-1, G * Dh))
        v_PF.index_copy_(0, self.slots_N, v_BGTd[0].transpose(0, 1).reshape(-1, G * Dh))
        o_BHTd = torch.empty_like(q_BHTd)
        gqa = q_BHTd.shape[1] != G
        if self.decode_rows_S is not None:
            S, C = self.decode_slots_SC.shape
            flat = self.decode_slots_SC.flatten()
            q_SH1d = q_BHTd[0][:, self.decode_rows_S].transpose(0, 1).unsqueeze(2)
            k_SGCd = k_PF.index_select(0, flat).view(S, C, G, Dh).transpose(1, 2)
            v_SGCd = v_PF.index_select(0, flat).view(S, C, G, Dh).transpose(1, 2)
            o_SH1d = F.scaled_dot_product_attention(
                q_SH1d, k_SGCd, v_SGCd, attn_mask=self.decode_mask_S11C, enable_gqa=gqa
            )
            o_BHTd[0][:, self.decode_rows_S] = o_SH1d.squeeze(2).transpose(0, 1)
        for s in self.prefills:
            C = len(s.key_slots)
            q_1HTd = q_BHTd[:, :, s.q_start : s.q_start + s.q_len]
            k_1GCd = k_PF.index_select(0, s.key_slots).view(1, C, G, Dh).transpose(1, 2)
            v_1GCd = v_PF.index_select(0, s.key_slots).view(1, C, G, Dh).transpose(1, 2)
            o_BHTd[:, :, s.q_start : s.q_start + s.q_len] = _causal_sdpa(q_1HTd, k_1GCd, v_1GCd, gqa)
        return o_BHTd

    def write_routing(self, routed_N_LK: torch.Tensor) -> None:
        self.cache.routing_PLK.index_copy_(0, self.slots_N, routed_N_LK.to(torch.int16))


def _causal_sdpa(q_1HTd: torch.Tensor, k_1GCd: torch.Tensor, v_1GCd: torch.Tensor, gqa: bool) -> torch.Tensor:
    """Queries are the last T of C positions: query i sees keys 0 .. C - T + i."""
    T, C = q_1HTd.shape[2], k_1GCd.shape[2]
    if T == C:
        return F.scaled_dot_product_attention(q_1HTd, k_1GCd, v_1GCd, is_causal=True, enable_gqa=gqa)
    mask_TC = torch.ones(T, C, dtype=torch.bool, device=q_1HTd.device).tril(diagonal=C - T)
    return F.scaled_dot_product_attention(q_1HTd, k_1GCd, v_1GCd, attn_mask=mask_TC, enable_gqa=gqa)

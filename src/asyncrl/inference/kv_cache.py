"""The paged KV cache as plain buffers, and the attention backend that reads and writes it.

All tokens scheduled in one engine step are flattened into a single row [1, N]. Each layer's
attention sees the new tokens' q/k/v (after q/k-norm and RoPE), writes k/v into their slots, and
attends each sequence's new queries over that sequence's cached plus new keys. Decode-only
sequences (one new token) are batched into one padded SDPA call; prefill chunks run one call each.

MLA models (DeepSeek-V3, Kimi-K2, GLM-5) cache each token's latent state instead of per-head K/V:
the normed compressed KV plus the shared rotary key (kv_lora_rank + qk_rope_head_dim values per
token and layer), and for GLM-5 the lightning indexer's key next to it. Attention gathers a
sequence's cached latents and expands them to K/V with the layer's own projection
(`attend_latent`), one sequence at a time; the weight-absorbed decode kernel is not done here.

The routing pool sits next to the KV pool, slot for slot, so a cached block keeps the expert
ids its tokens were routed to, and a prefix-cache hit still returns routing.

Shape legend: N scheduled tokens, S sequences, C context (keys) per sequence, H query heads,
G kv heads, Dh head dim, L layers, K top_k, P = num_blocks * block_size slots, c latent width,
d indexer key width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from asyncrl.inference.request import Request
from asyncrl.model.sparse_index import IndexQuery, select_topk

__all__ = ["KVCache", "PagedAttention", "SeqSlice"]


class KVCache:
    """Per-layer key/value buffers [P, G, Dh] (or, with latent_dim > 0, latent buffers [P, c] and
    indexer-key buffers [P, d]) and the routed-expert buffer [P, L, K] (int16)."""

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
        latent_dim: int = 0,
        index_dim: int = 0,
    ) -> None:
        self.block_size = block_size
        P = num_blocks * block_size
        kv_slots = 0 if latent_dim else P  # MLA keeps no per-head K/V
        self.k_LPGd = torch.zeros(num_layers, kv_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_LPGd = torch.zeros_like(self.k_LPGd)
        self.latent_LPc = torch.zeros(
            num_layers, P if latent_dim else 0, latent_dim, dtype=dtype, device=device
        )
        self.index_k_LPd = torch.zeros(
            num_layers, P if index_dim else 0, index_dim, dtype=dtype, device=device
        )
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

    def block_table(self, req: Request) -> torch.Tensor:
        """`req.block_ids` as a device tensor, rebuilt only when the sequence gained blocks."""
        if req.block_table is None or req.block_table.numel() != len(req.block_ids):
            req.block_table = torch.tensor(req.block_ids, dtype=torch.long, device=self.k_LPGd.device)
        return req.block_table

    def nbytes(self) -> int:
        held = (self.k_LPGd, self.v_LPGd, self.latent_LPc, self.index_k_LPd, self.routing_PLK)
        return sum(t.numel() * t.element_size() for t in held)


@dataclass(frozen=True, kw_only=True)
class SeqSlice:
    """One sequence's share of a step: new tokens [q_start, q_start + q_len) of the flattened row,
    attending over its first `num_ctx` = num_computed + q_len positions, held in `block_ids`."""

    q_start: int
    q_len: int
    num_ctx: int
    block_ids: torch.Tensor  # long [>= ceil(num_ctx / block_size)]


class PagedAttention:
    """`AttentionBackend` over a KVCache for one engine step (built once per step, used by every layer)."""

    def __init__(self, cache: KVCache, seqs: list[SeqSlice], slots_N: torch.Tensor) -> None:
        self.cache, self.slots_N = cache, slots_N
        self.seqs = seqs
        self.dsa_selection: dict[tuple[int, int], torch.Tensor] = {}  # (layer, seq) -> keep [1, T, C]
        self.prefills = [s for s in seqs if s.q_len > 1]
        decodes = [s for s in seqs if s.q_len == 1]
        self.decode_rows_S: torch.Tensor | None = None
        if decodes:
            device = slots_N.device
            self.decode_rows_S = torch.tensor([s.q_start for s in decodes], device=device)
            bs = cache.block_size
            lengths = [s.num_ctx for s in decodes]
            num_blocks = -(-max(lengths) // bs)
            self.decode_blocks_SB = pad_sequence(
                [s.block_ids[:num_blocks] for s in decodes], batch_first=True
            )
            lengths_S = torch.tensor(lengths, device=device)
            mask_SC = torch.arange(num_blocks * bs, device=device)[None, :] < lengths_S[:, None]
            self.decode_mask_S11C = None if bool(mask_SC.all()) else mask_SC[:, None, None, :]

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
        # Gathers read whole blocks (rows of block_size * G * Dh); padding positions are masked out.
        k_NbF = k_PF.view(-1, self.cache.block_size * G * Dh)
        v_NbF = v_PF.view(-1, self.cache.block_size * G * Dh)
        if self.decode_rows_S is not None:
            # One query per sequence: fold each kv group's query heads into the query axis
            # ([S, G, H/G, Dh]), which avoids expanding k/v to H heads.
            S, H = len(self.decode_rows_S), q_BHTd.shape[1]
            flat = self.decode_blocks_SB.flatten()
            q_SGrd = q_BHTd[0][:, self.decode_rows_S].transpose(0, 1).reshape(S, G, H // G, Dh)
            k_SGCd = k_NbF.index_select(0, flat).view(S, -1, G, Dh).transpose(1, 2)
            v_SGCd = v_NbF.index_select(0, flat).view(S, -1, G, Dh).transpose(1, 2)
            o_SGrd = F.scaled_dot_product_attention(q_SGrd, k_SGCd, v_SGCd, attn_mask=self.decode_mask_S11C)
            o_BHTd[0][:, self.decode_rows_S] = o_SGrd.reshape(S, H, Dh).transpose(0, 1)
        for s in self.prefills:
            C = s.num_ctx
            blocks = s.block_ids[: -(-C // self.cache.block_size)]
            q_1HTd = q_BHTd[:, :, s.q_start : s.q_start + s.q_len]
            k_1GCd = k_NbF.index_select(0, blocks).view(1, -1, G, Dh)[:, :C].transpose(1, 2)
            v_1GCd = v_NbF.index_select(0, blocks).view(1, -1, G, Dh)[:, :C].transpose(1, 2)
            o_BHTd[:, :, s.q_start : s.q_start + s.q_len] = _causal_sdpa(q_1HTd, k_1GCd, v_1GCd, gqa)
        return o_BHTd

    def attend_latent(
        self,
        q_BHTd: torch.Tensor,
        state_BTc: torch.Tensor,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        layer_idx: int,
        *,
        index: IndexQuery | None = None,
    ) -> torch.Tensor:
        """MLA over cached latents: write the new tokens' state (and indexer keys), then per
        sequence gather its context's latents, expand them to K/V and attend (sparsely for DSA)."""
        latent_Pc = self.cache.latent_LPc[layer_idx]
        latent_Pc.index_copy_(0, self.slots_N, state_BTc[0])
        index_k_Pd = self.cache.index_k_LPd[layer_idx]
        if index is not None and index.k_BTd is not None:
            index_k_Pd.index_copy_(0, self.slots_N, index.k_BTd[0])
        out = []
        for i, s in enumerate(self.seqs):
            ctx_C = self._context_slots(s)
            k_1HCd, v_1HCv = expand(latent_Pc[ctx_C].unsqueeze(0))
            rows = slice(s.q_start, s.q_start + s.q_len)
            T, C = s.q_len, s.num_ctx
            mask_1TC = torch.ones(1, T, C, dtype=torch.bool, device=q_BHTd.device).tril(diagonal=C - T)
            if index is not None:
                if index.q_BHTd is None:
                    mask_1TC = self.dsa_selection[(index.source_layer, i)]
                else:
                    q, w = index.q_BHTd[:, :, rows], index.w_BTH[:, rows]
                    mask_1TC = select_topk(q, w, index_k_Pd[ctx_C].unsqueeze(0), mask_1TC, index.topk)
                    self.dsa_selection[(layer_idx, i)] = mask_1TC
            q_1HTd = q_BHTd[:, :, rows]
            out.append(
                F.scaled_dot_product_attention(q_1HTd, k_1HCd, v_1HCv, attn_mask=mask_1TC.unsqueeze(1))
            )
        return torch.cat(out, dim=2)

    def _context_slots(self, s: SeqSlice) -> torch.Tensor:
        bs = self.cache.block_size
        blocks = s.block_ids[: -(-s.num_ctx // bs)]
        return (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).flatten()[: s.num_ctx]

    def write_routing(self, routed_N_LK: torch.Tensor) -> None:
        self.cache.routing_PLK.index_copy_(0, self.slots_N, routed_N_LK.to(torch.int16))


def _causal_sdpa(q_1HTd: torch.Tensor, k_1GCd: torch.Tensor, v_1GCd: torch.Tensor, gqa: bool) -> torch.Tensor:
    """Queries are the last T of C positions: query i sees keys 0 .. C - T + i."""
    T, C = q_1HTd.shape[2], k_1GCd.shape[2]
    if T == C:
        return F.scaled_dot_product_attention(q_1HTd, k_1GCd, v_1GCd, is_causal=True, enable_gqa=gqa)
    mask_TC = torch.ones(T, C, dtype=torch.bool, device=q_1HTd.device).tril(diagonal=C - T)
    return F.scaled_dot_product_attention(q_1HTd, k_1GCd, v_1GCd, attn_mask=mask_TC, enable_gqa=gqa)

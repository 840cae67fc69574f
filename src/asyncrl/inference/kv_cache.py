"""The paged KV cache as plain buffers, and the attention backend that reads and writes it.

All tokens scheduled in one engine step are flattened into a single row [1, N]. Each layer's
attention sees the new tokens' q/k/v (after q/k-norm and RoPE), writes k/v into their slots, and
attends each sequence's new queries over that sequence's cached plus new keys. Decode-only
sequences (one new token) are batched into one SDPA call; prefill chunks run one call each.

MLA models (DeepSeek-V3, Kimi-K2, GLM-5) cache each token's latent state instead of per-head K/V:
the normed compressed KV plus the shared rotary key (kv_lora_rank + qk_rope_head_dim values per
token and layer), and for GLM-5 the lightning indexer's key next to it. Decode attends over the
cached latent rows directly, with the layer's key and value up-projections absorbed into the
query and the output (asyncrl.model.latent_attention): one shared head of width R + r, as MQA,
so no per-head K/V is built for the context. Prefill expands a sequence's context to per-head K/V
and runs causal SDPA. DSA layers rank the context's cached index keys and attend over each
query's selected rows only, in decode and prefill alike. `AttentionPaths` switches to the
expanded decode and the dense masked DSA attention (the oracles of the tests, the baselines of
benchmarks/bench_long_context.py).

Per-head K/V decode reads, when the engine hands over a `DecodePlan`, the dense rows of
`asyncrl.inference.decode_kv` (each decode sequence's context kept contiguous across steps, new
tokens written in place) instead of gathering every sequence's blocks in every layer; without a
plan (over its memory budget, or `AttentionPaths(decode_buffer=False)`) it gathers. On a CPU either
goes through `asyncrl.inference.cpu_decode`'s kernel when the engine has one (each sequence read to
its own length), else through SDPA (every sequence to the step's longest, masked).

The routing pool sits next to the KV pool, slot for slot, so a cached block keeps the expert
ids its tokens were routed to, and a prefix-cache hit still returns routing.

Shape legend: N scheduled tokens, S sequences, C context (keys) per sequence, J keys a decode
query attends over (C, or K selected), H query heads, G kv heads, Dh head dim, L layers, K top_k
(routing) or selected keys (DSA), P = num_blocks * block_size slots, c latent width, d indexer
key width, v value head dim, r = H / G query heads per kv head, R dense decode rows, W positions a
decode step reads of each row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from asyncrl.inference.cpu_decode import DecodeKernel
from asyncrl.inference.decode_kv import DecodePlan
from asyncrl.inference.request import Request
from asyncrl.model.compute import sdpa
from asyncrl.model.latent_attention import LatentProjections, attend_masked, attend_selected, latent_attention
from asyncrl.model.sparse_index import IndexQuery, select_topk, selection_mask

__all__ = ["AttentionPaths", "KVCache", "PagedAttention", "SeqSlice"]


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

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool (num_blocks * block_size)."""
        return self.routing_PLK.shape[0]

    def bytes_per_token(self) -> dict[str, int]:
        """Bytes one cached token takes over all layers, by buffer: {"kv" (per-head K and V) or
        "latent" (MLA), "index_keys" (DSA), "routing"}; only the buffers this model has."""
        held = {
            "kv": (self.k_LPGd, self.v_LPGd),
            "latent": (self.latent_LPc,),
            "index_keys": (self.index_k_LPd,),
            "routing": (self.routing_PLK,),
        }
        per_token = {
            name: sum(t.numel() * t.element_size() for t in ts) // self.num_tokens
            for name, ts in held.items()
        }
        return {name: n for name, n in per_token.items() if n}

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


@dataclass(frozen=True, kw_only=True)
class AttentionPaths:
    """How the engine runs attention. The defaults are the fast paths; the others compute the same
    attention the way it was first written, as oracles and baselines."""

    decode_buffer: bool = True  # per-head K/V decode over dense rows (decode_kv); False: gather each step
    decode_kernel: bool = True  # on a CPU, per-head K/V decode through the C kernel (cpu_decode); False: SDPA
    latent_decode: bool = True  # decode in the latent space (absorbed); False: expand the keys to K/V
    sparse: bool = True  # DSA over each query's selected keys only; False: all keys, a [T, C] mask


class PagedAttention:
    """`AttentionBackend` over a KVCache for one engine step (built once per step, used by every layer)."""

    def __init__(
        self,
        cache: KVCache,
        seqs: list[SeqSlice],
        slots_N: torch.Tensor,
        paths: AttentionPaths | None = None,
        decode_plan: DecodePlan | None = None,
        decode_kernel: DecodeKernel | None = None,
    ) -> None:
        self.cache, self.slots_N, self.decode_plan = cache, slots_N, decode_plan
        self.decode_kernel = decode_kernel
        self.paths = paths or AttentionPaths()
        self.seqs = seqs
        # (layer, seq index or "decode") -> idx [1, T, K] / [S, 1, K], kept for "shared" layers
        self.dsa_selection: dict[tuple[int, int | str], torch.Tensor] = {}
        self.prefills = [(i, s) for i, s in enumerate(seqs) if s.q_len > 1]
        decodes = [s for s in seqs if s.q_len == 1]
        # The decode queries' positions in the step's row, in the order decode attention takes them
        # (the dense rows' order with a plan, the step's without).
        self.decode_rows_S: torch.Tensor | None = None
        if decodes and decode_plan is not None:
            q_start_S = torch.tensor([s.q_start for s in decodes], device=slots_N.device)
            self.decode_rows_S = q_start_S[decode_plan.order_R]
        elif decodes:
            device = slots_N.device
            self.decode_rows_S = torch.tensor([s.q_start for s in decodes], device=device)
            bs = cache.block_size
            lengths = [s.num_ctx for s in decodes]
            num_blocks = -(-max(lengths) // bs)
            self.decode_blocks_SB = pad_sequence(
                [s.block_ids[:num_blocks] for s in decodes], batch_first=True
            )
            self.decode_length_S = torch.tensor(lengths, device=device)
            self.decode_last_S1 = self.decode_length_S[:, None] - 1
            mask_SC = torch.arange(num_blocks * bs, device=device)[None, :] <= self.decode_last_S1
            self.decode_mask_S11C = None if bool(mask_SC.all()) else mask_SC[:, None, None, :]

    def __call__(
        self, q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor, layer_idx: int
    ) -> torch.Tensor:
        # Flat [P, G * Dh] views: index_select / index_copy_ on rows are far faster than fancy indexing.
        G, Dh = k_BGTd.shape[1], k_BGTd.shape[3]
        k_PF = self.cache.k_LPGd[layer_idx].view(-1, G * Dh)
        v_PF = self.cache.v_LPGd[layer_idx].view(-1, G * Dh)
        k_NF = k_BGTd[0].transpose(0, 1).reshape(-1, G * Dh)
        v_NF = v_BGTd[0].transpose(0, 1).reshape(-1, G * Dh)
        k_PF.index_copy_(0, self.slots_N, k_NF)
        v_PF.index_copy_(0, self.slots_N, v_NF)
        o_BHTd = torch.empty_like(q_BHTd)
        gqa = q_BHTd.shape[1] != G
        # Gathers read whole blocks (rows of block_size * G * Dh); padding positions are masked out.
        k_NbF = k_PF.view(-1, self.cache.block_size * G * Dh)
        v_NbF = v_PF.view(-1, self.cache.block_size * G * Dh)
        if self.decode_rows_S is not None:
            # One query per sequence: fold each kv group's query heads into the query axis
            # ([S, G, H/G, Dh]), which avoids expanding k/v to H heads.
            S, H = len(self.decode_rows_S), q_BHTd.shape[1]
            q_SGrd = q_BHTd[0][:, self.decode_rows_S].transpose(0, 1).reshape(S, G, H // G, Dh)
            if self.decode_plan is not None:
                new_kv = (k_NF.index_select(0, self.decode_rows_S), v_NF.index_select(0, self.decode_rows_S))
                o_SGrd = self._decode_dense(q_SGrd, new_kv, (k_NbF, v_NbF), layer_idx)
            else:
                flat = self.decode_blocks_SB.flatten()
                k_SGCd = k_NbF.index_select(0, flat).view(S, -1, G, Dh).transpose(1, 2)
                v_SGCd = v_NbF.index_select(0, flat).view(S, -1, G, Dh).transpose(1, 2)
                if self.decode_kernel is not None and self.decode_kernel.supports(k_SGCd):
                    o_SGrd = self.decode_kernel(q_SGrd, k_SGCd, v_SGCd, self.decode_length_S)
                else:
                    o_SGrd = sdpa(q_SGrd, k_SGCd, v_SGCd, attn_mask=self.decode_mask_S11C)
            o_BHTd[0][:, self.decode_rows_S] = o_SGrd.reshape(S, H, Dh).transpose(0, 1)
        for _, s in self.prefills:
            C = s.num_ctx
            blocks = s.block_ids[: -(-C // self.cache.block_size)]
            q_1HTd = q_BHTd[:, :, s.q_start : s.q_start + s.q_len]
            k_1GCd = k_NbF.index_select(0, blocks).view(1, -1, G, Dh)[:, :C].transpose(1, 2)
            v_1GCd = v_NbF.index_select(0, blocks).view(1, -1, G, Dh)[:, :C].transpose(1, 2)
            o_BHTd[:, :, s.q_start : s.q_start + s.q_len] = _causal_sdpa(q_1HTd, k_1GCd, v_1GCd, gqa)
        return o_BHTd

    def _decode_dense(
        self,
        q_RGrd: torch.Tensor,
        new_kv: tuple[torch.Tensor, torch.Tensor],
        paged_kv: tuple[torch.Tensor, torch.Tensor],
        layer_idx: int,
    ) -> torch.Tensor:
        """[R, G, H/G, Dh]: the decode queries (in row order) over their rows of the dense buffers,
        after filling the rows new this step from the paged blocks and writing the new keys and
        values in place."""
        plan, bs = self.decode_plan, self.cache.block_size
        G, Dh = q_RGrd.shape[1], q_RGrd.shape[3]
        for buf_LRGCd, new_RF, paged_NbF in zip((plan.k_LRGCd, plan.v_LRGCd), new_kv, paged_kv):
            buf_RGCd = buf_LRGCd[layer_idx]
            for fill in plan.fills:
                n = fill.block_ids.numel() * bs
                ctx_nGd = paged_NbF.index_select(0, fill.block_ids).view(n, G, Dh)
                buf_RGCd[fill.row, :, :n].copy_(ctx_nGd.transpose(0, 1))
                buf_RGCd[fill.row, :, n:].zero_()
            buf_RGCd.view(-1, Dh).index_copy_(0, plan.write_RG, new_RF.view(-1, Dh))
        R, W = len(plan.order_R), plan.width
        k_RGWd = plan.k_LRGCd[layer_idx, :R, :, :W]
        v_RGWd = plan.v_LRGCd[layer_idx, :R, :, :W]
        if self.decode_kernel is not None and self.decode_kernel.supports(k_RGWd):
            return self.decode_kernel(q_RGrd, k_RGWd, v_RGWd, plan.length_R)
        return sdpa(q_RGrd, k_RGWd, v_RGWd, attn_mask=plan.mask_R11W)

    def attend_latent(
        self,
        q_BHTd: torch.Tensor,
        state_BTc: torch.Tensor,
        mla: LatentProjections,
        layer_idx: int,
        *,
        index: IndexQuery | None = None,
    ) -> torch.Tensor:
        """MLA over cached latents: write the new tokens' state (and indexer keys), then attend the
        decode rows together and each prefill chunk alone (sparsely for DSA)."""
        latent_Pc = self.cache.latent_LPc[layer_idx]
        latent_Pc.index_copy_(0, self.slots_N, state_BTc[0])
        if index is not None and index.k_BTd is not None:
            self.cache.index_k_LPd[layer_idx].index_copy_(0, self.slots_N, index.k_BTd[0])
        o_1HNv = q_BHTd.new_empty(*q_BHTd.shape[:3], mla.v_dim)
        if self.decode_rows_S is not None:
            o_SHv = self._decode_latent(
                q_BHTd[0][:, self.decode_rows_S].transpose(0, 1), mla, layer_idx, index
            )
            o_1HNv[0][:, self.decode_rows_S] = o_SHv.transpose(0, 1)
        for i, s in self.prefills:
            rows = slice(s.q_start, s.q_start + s.q_len)
            o_1HNv[:, :, rows] = self._prefill_latent(q_BHTd[:, :, rows], i, s, mla, layer_idx, index)
        return o_1HNv

    def _decode_latent(
        self, q_SHd: torch.Tensor, mla: LatentProjections, layer_idx: int, index: IndexQuery | None
    ) -> torch.Tensor:
        """[S, H, v]: each decode query over its whole context (MLA) or its selected keys (DSA)."""
        latent_Pc = self.cache.latent_LPc[layer_idx]
        if index is None:
            keep_SC = None if self.decode_mask_S11C is None else self.decode_mask_S11C[:, 0, 0]
            return self._attend_rows(q_SHd, self._decode_context(latent_Pc), keep_SC, mla)
        idx_S1K = self._decode_selection(layer_idx, index)
        if self.paths.sparse:
            bs = self.cache.block_size
            pos_SK = idx_S1K[:, 0].long().clamp(min=0)
            slots_SK = self.decode_blocks_SB.gather(1, pos_SK // bs) * bs + pos_SK % bs
            rows_SKc = latent_Pc.index_select(0, slots_SK.flatten()).view(*slots_SK.shape, -1)
            return self._attend_rows(q_SHd, rows_SKc, idx_S1K[:, 0] >= 0, mla)
        rows_SCc = self._decode_context(latent_Pc)
        return self._attend_rows(q_SHd, rows_SCc, selection_mask(idx_S1K, rows_SCc.shape[1])[:, 0], mla)

    def _decode_context(self, buf_PX: torch.Tensor) -> torch.Tensor:
        """[S, C, X]: the decode sequences' whole blocks of a per-slot buffer (padding past each
        context's end)."""
        bs, S = self.cache.block_size, len(self.decode_rows_S)
        blocks_NbF = buf_PX.view(-1, bs * buf_PX.shape[-1])
        return blocks_NbF.index_select(0, self.decode_blocks_SB.flatten()).view(S, -1, buf_PX.shape[-1])

    def _decode_selection(self, layer_idx: int, index: IndexQuery) -> torch.Tensor:
        """idx [S, 1, K]: each decode query's top-k positions among its cached index keys."""
        if index.q_BHTd is None:
            return self.dsa_selection[(index.source_layer, "decode")]
        rows = self.decode_rows_S
        q_SH1d = index.q_BHTd[0][:, rows].transpose(0, 1).unsqueeze(2)
        keys_SCd = self._decode_context(self.cache.index_k_LPd[layer_idx])
        first_S1 = torch.zeros_like(self.decode_last_S1)
        idx_S1K = select_topk(
            q_SH1d, index.w_BTH[0][rows].unsqueeze(1), keys_SCd, first_S1, self.decode_last_S1, index.topk
        )
        if index.reused:
            self.dsa_selection[(layer_idx, "decode")] = idx_S1K
        return idx_S1K

    def _attend_rows(
        self,
        q_SHd: torch.Tensor,
        rows_SJc: torch.Tensor,
        keep_SJ: torch.Tensor | None,
        mla: LatentProjections,
    ) -> torch.Tensor:
        """[S, H, v]: one query per sequence over J latent rows (`keep_SJ` masks some): in the
        latent space with the projections absorbed (MQA: the H heads are H queries of one shared
        key/value head), or expanded to per-head K/V."""
        if not self.paths.latent_decode:
            k_SHJd, v_SHJv = mla.expand(rows_SJc)
            keep = None if keep_SJ is None else keep_SJ[:, None, None, :]
            return sdpa(q_SHd.unsqueeze(2), k_SHJd, v_SHJv, attn_mask=keep).squeeze(2)
        q_SHc = mla.absorb(q_SHd.unsqueeze(2)).squeeze(2)
        o_SHR = latent_attention(
            q_SHc, mla.latent(rows_SJc), keep_SJ, value_dim=mla.kv_lora_rank, scale=mla.softmax_scale
        )
        return mla.project_out(o_SHR.unsqueeze(2)).squeeze(2)

    def _prefill_latent(
        self,
        q_1HTd: torch.Tensor,
        i: int,
        s: SeqSlice,
        mla: LatentProjections,
        layer_idx: int,
        index: IndexQuery | None,
    ) -> torch.Tensor:
        """[1, H, T, v]: one prefill chunk over its context: expanded causal (MLA), or each query
        over its selected keys (DSA)."""
        ctx_C = self._context_slots(s)
        state_1Cc = self.cache.latent_LPc[layer_idx][ctx_C].unsqueeze(0)
        if index is None:
            k_1HCd, v_1HCv = mla.expand(state_1Cc)
            return _causal_sdpa(q_1HTd, k_1HCd, v_1HCv, gqa=False)
        if index.q_BHTd is None:
            idx_1TK = self.dsa_selection[(index.source_layer, i)]
        else:
            rows = slice(s.q_start, s.q_start + s.q_len)
            keys_1Cd = self.cache.index_k_LPd[layer_idx][ctx_C].unsqueeze(0)
            last_1T = torch.arange(s.num_ctx - s.q_len, s.num_ctx, device=q_1HTd.device).unsqueeze(0)
            idx_1TK = select_topk(
                index.q_BHTd[:, :, rows],
                index.w_BTH[:, rows],
                keys_1Cd,
                torch.zeros_like(last_1T),
                last_1T,
                index.topk,
            )
            if index.reused:
                self.dsa_selection[(layer_idx, i)] = idx_1TK
        attend = attend_selected if self.paths.sparse else attend_masked
        return attend(q_1HTd, state_1Cc, mla, idx_1TK)

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
        return sdpa(q_1HTd, k_1GCd, v_1GCd, is_causal=True, enable_gqa=gqa)
    mask_TC = torch.ones(T, C, dtype=torch.bool, device=q_1HTd.device).tril(diagonal=C - T)
    return sdpa(q_1HTd, k_1GCd, v_1GCd, attn_mask=mask_TC, enable_gqa=gqa)

"""Context parallel: each CP rank holds one contiguous chunk of a packed row; attention sees it all.

The trainer packs sequences into rows [1, T]. With cp ranks, rank c keeps tokens
[c*T/cp, (c+1)*T/cp) of every per-token stream (input ids, position ids, targets, masks,
advantages, routed experts, ...): `split_for_cp`. Everything except attention is per-token, so the
MoE router, experts (and EP dispatch), norms and the LM head run on the chunk unchanged.

Attention (`ContextParallelAttention`, plugged into `Transformer.forward(attention=...)`): each
layer all-gathers K and V along the sequence from the CP group, and the local queries attend over
the whole row with a mask that is causal in *global* token order and blocks attention across
packed-sequence boundaries (segments come from the full row's position ids, which every CP rank
has before splitting). The backward of the all-gather sums the K/V gradients from every rank and
keeps this rank's chunk (reduce-scatter). All-gather rather than ring: simpler and exact, at the
cost of holding the full K/V of one layer ([T, G, Dh] per rank, small next to the activations,
and with GQA G << H). Contiguous chunks leave the causal work unbalanced (the last rank attends
to the most keys); a zig-zag split would balance it and is not done here.

Rows whose length is not a multiple of cp are padded at the end (`pad_for_cp`); padded tokens
have no loss and, being later in causal order, never affect real tokens.

MLA layers (`attend_latent`) all-gather the per-token latent state (kv_lora_rank + rope dims)
instead of per-head K/V and expand it locally. DSA layers also gather the indexer keys (no
gradient), so each local query ranks every key of the row that it may see, and then attend over
the gathered latent in the latent space, each query over its selected rows only
(`asyncrl.model.latent_attention.attend_selected`): a rank holds per layer the whole row's latent
and index keys ([T, R + r] and [T, d], as the GQA path holds K/V), its queries' selections
(int32 [Tc, index_topk], kept for the step only where a "shared" layer reuses them) and one
chunk of gathered rows; nothing of size [Tc, T]. The backward of the latent's all-gather sums
the gradients that every rank's selected rows sent to each key.

Logprobs (and any per-token output) are gathered back with `gather_from_cp`.

Shape legend: B batch, T tokens of the full row, Tc tokens of this rank's chunk, H query heads,
G kv heads, Dh head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from asyncrl.model.compute import sdpa
from asyncrl.model.latent_attention import LatentProjections, attend_masked, attend_selected
from asyncrl.model.layers import segment_ids_from_positions
from asyncrl.model.sparse_index import IndexQuery, causal_key_ranges, select_topk

__all__ = ["ContextParallelAttention", "gather_from_cp", "pad_for_cp", "split_for_cp"]


def pad_for_cp(x: torch.Tensor, cp: int, dim: int, value: float | int) -> torch.Tensor:
    """Pad `dim` at the end to a multiple of cp with `value` (0 for position ids: a new segment)."""
    pad = (-x.shape[dim]) % cp
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def split_for_cp(x: torch.Tensor, cp: int, cp_rank: int, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of `dim` (which must be a multiple of cp; see pad_for_cp)."""
    if x.shape[dim] % cp:
        raise ValueError(
            f"context parallel: length {x.shape[dim]} along dim {dim} is not a multiple of cp ({cp}); "
            f"pad the row first with pad_for_cp"
        )
    return x.chunk(cp, dim=dim)[cp_rank].contiguous()


def gather_from_cp(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate the chunks of all CP ranks along `dim` (no gradient; for logging and outputs)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 ([B, G, Tc, Dh] -> [B, G, T, Dh]); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad_full):
        grad_full = grad_full.contiguous()
        size = dist.get_world_size(ctx.group)
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce_scatter
            dist.all_reduce(grad_full, group=ctx.group)
            return grad_full.chunk(size, dim=2)[ctx.rank].contiguous(), None
        chunks = [c.contiguous() for c in grad_full.chunk(size, dim=2)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=ctx.group)
        return out, None


class ContextParallelAttention:
    """`AttentionBackend` for a CP chunk: local queries over all-gathered keys and values.

    position_ids_BT is the FULL row's position ids (before splitting). The dense mask rows of this
    rank's chunk ([B, 1, Tc, T], for GQA and dense MLA layers) are built on first use and reused
    by every layer; DSA layers never build them. sparse=False runs DSA as the dense masked
    reference (`attend_masked`).
    """

    def __init__(
        self, position_ids_BT: torch.Tensor, group: dist.ProcessGroup, *, sparse: bool = True
    ) -> None:
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        T = position_ids_BT.shape[1]
        if T % cp:
            raise ValueError(f"context parallel: row length {T} is not a multiple of cp ({cp})")
        self.group, self.sparse = group, sparse
        self.position_ids_BT = position_ids_BT
        Tc = T // cp
        self.rows = slice(cp_rank * Tc, (cp_rank + 1) * Tc)
        self._mask_B1tT: torch.Tensor | None = None
        self.dsa_selection: dict[int, torch.Tensor] = {}  # layer -> idx [B, Tc, K] into the row

    @property
    def mask_B1tT(self) -> torch.Tensor:
        """Bool [B, 1, Tc, T]: causal in global token order, within each packed sequence."""
        if self._mask_B1tT is None:
            pos = self.position_ids_BT
            segments_BT = segment_ids_from_positions(pos)
            rows = torch.arange(pos.shape[1], device=pos.device)[self.rows]
            cols = torch.arange(pos.shape[1], device=pos.device)
            causal_tT = cols[None, :] <= rows[:, None]
            same_BtT = segments_BT[:, rows, None] == segments_BT[:, None, :]
            self._mask_B1tT = (same_BtT & causal_tT).unsqueeze(1)
        return self._mask_B1tT

    def attend_latent(
        self,
        q_BHtd: torch.Tensor,
        state_Btc: torch.Tensor,
        mla: LatentProjections,
        layer_idx: int,
        *,
        index: IndexQuery | None = None,
    ) -> torch.Tensor:
        """MLA: gather the latent state of the whole row; expand it here, or (DSA) attend over the
        selected rows of it in the latent space."""
        state_BTc = _GatherSeq.apply(state_Btc.unsqueeze(1), self.group).squeeze(1)
        if index is None:
            k_BHTd, v_BHTv = mla.expand(state_BTc)
            return sdpa(q_BHtd, k_BHTd, v_BHTv, attn_mask=self.mask_B1tT)
        if index.q_BHTd is None:
            idx_BtK = self.dsa_selection[index.source_layer]
        else:
            keys_BTd = gather_from_cp(index.k_BTd, self.group, dim=1)  # the indexer has no gradient
            first_BT, last_BT = causal_key_ranges(self.position_ids_BT)
            first_Bt, last_Bt = first_BT[:, self.rows], last_BT[:, self.rows]
            idx_BtK = select_topk(index.q_BHTd, index.w_BTH, keys_BTd, first_Bt, last_Bt, index.topk)
            if index.reused:
                self.dsa_selection[layer_idx] = idx_BtK
        attend = attend_selected if self.sparse else attend_masked
        return attend(q_BHtd, state_BTc, mla, idx_BtK)

    def __call__(
        self, q_BHtd: torch.Tensor, k_BGtd: torch.Tensor, v_BGtd: torch.Tensor, layer_idx: int
    ) -> torch.Tensor:
        k_BGTd = _GatherSeq.apply(k_BGtd, self.group)
        v_BGTd = _GatherSeq.apply(v_BGtd, self.group)
        gqa = q_BHtd.shape[1] != k_BGTd.shape[1]
        return sdpa(q_BHtd, k_BGTd, v_BGTd, attn_mask=self.mask_B1tT, enable_gqa=gqa)

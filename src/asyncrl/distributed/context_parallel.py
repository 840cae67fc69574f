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
instead of per-head K/V and expand it locally; DSA layers also gather the indexer keys, so the
indexer ranks every key of the row (the selection for shared layers is kept per layer).

Logprobs (and any per-token output) are gathered back with `gather_from_cp`.

Shape legend: B batch, T tokens of the full row, Tc tokens of this rank's chunk, H query heads,
G kv heads, Dh head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncrl.model.layers import segment_ids_from_positions
from asyncrl.model.sparse_index import IndexQuery, select_topk

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

    position_ids_BT is the FULL row's position ids (before splitting); the module computes the
    mask rows of this rank's chunk once and reuses them in every layer.
    """

    def __init__(self, position_ids_BT: torch.Tensor, group: dist.ProcessGroup) -> None:
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        T = position_ids_BT.shape[1]
        if T % cp:
            raise ValueError(f"context parallel: row length {T} is not a multiple of cp ({cp})")
        self.group = group
        Tc = T // cp
        segments_BT = segment_ids_from_positions(position_ids_BT)
        rows = torch.arange(cp_rank * Tc, (cp_rank + 1) * Tc, device=position_ids_BT.device)
        cols = torch.arange(T, device=position_ids_BT.device)
        causal_tT = cols[None, :] <= rows[:, None]
        same_BtT = segments_BT[:, rows, None] == segments_BT[:, None, :]
        self.mask_B1tT = (same_BtT & causal_tT).unsqueeze(1)
        self.dsa_selection: dict[int, torch.Tensor] = {}

    def attend_latent(
        self,
        q_BHtd: torch.Tensor,
        state_Btc: torch.Tensor,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        layer_idx: int,
        *,
        index: IndexQuery | None = None,
    ) -> torch.Tensor:
        """MLA: gather the latent state of the whole row, expand it to K/V here."""
        k_BHTd, v_BHTv = expand(_GatherSeq.apply(state_Btc.unsqueeze(1), self.group).squeeze(1))
        mask_BtT = self.mask_B1tT.squeeze(1)
        if index is not None:
            if index.q_BHTd is None:
                mask_BtT = self.dsa_selection[index.source_layer]
            else:
                keys_BTd = gather_from_cp(index.k_BTd, self.group, dim=1)  # the indexer has no gradient
                mask_BtT = select_topk(index.q_BHTd, index.w_BTH, keys_BTd, mask_BtT, index.topk)
                self.dsa_selection[layer_idx] = mask_BtT
        return F.scaled_dot_product_attention(q_BHtd, k_BHTd, v_BHTv, attn_mask=mask_BtT.unsqueeze(1))

    def __call__(
        self, q_BHtd: torch.Tensor, k_BGtd: torch.Tensor, v_BGtd: torch.Tensor, layer_idx: int
    ) -> torch.Tensor:
        k_BGTd = _GatherSeq.apply(k_BGtd, self.group)
        v_BGTd = _GatherSeq.apply(v_BGtd, self.group)
        gqa = q_BHtd.shape[1] != k_BGTd.shape[1]
        return F.scaled_dot_product_attention(
            q_BHtd, k_BGTd, v_BGTd, attn_mask=self.mask_B1tT, enable_gqa=gqa
        )

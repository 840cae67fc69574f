"""MLA attention in the latent space (weights absorbed), and DSA attention over selected keys only.

An MLA layer's keys and values are linear in its per-token latent state [c ; k_r] (R + r values):
k_h = [W_kb,h c ; k_r] and v_h = W_vb,h c. So q_h . k_h = [W_kb,h^T q_nope,h ; q_rope,h] . [c ; k_r],
and sum_s p_s v_h(s) = W_vb,h sum_s p_s c_s. With the query absorbed (`LatentProjections.absorb`,
width R + r) every head attends over the same rows, the latent state itself: one shared "head"
of width R + r for keys and R for values (MQA), and the value up-projection runs once per query
on the attention output (`LatentProjections.project_out`). Nothing per head is built per key.

DSA (asyncrl.model.dsa) gives each query its own K selected keys (asyncrl.model.sparse_index).
`sparse_latent_attention` gathers, a chunk of queries at a time, each query's selected latent rows
and attends over those only, so memory and work are linear in T for a fixed top-k; no [T, S] mask
or score matrix exists. Its backward recomputes the gathered rows and the probabilities chunk by
chunk from the saved log-sum-exp (as flash attention does), so autograd keeps only the inputs,
the output and one fp32 value per query and head. Queries, rows and probabilities are fp32
inside the kernel (fp64 for an fp64 model), whatever the model dtype.

`attend_selected` runs one DSA layer this way; `attend_masked` is the dense reference (expanded
per-head K/V, the selection as a boolean [T, S] mask, one SDPA call), kept as the oracle of the
tests and the baseline of benchmarks/bench_long_context.py.

Shape legend: B batch, H heads, T queries, S keys (context), N = B*T flattened queries, P rows of
a latent table, K selected keys per query, c = R + r latent width, R kv_lora_rank, d q/k head dim,
v value head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch

from asyncrl.model.compute import sdpa
from asyncrl.model.sparse_index import selection_mask

__all__ = [
    "MAX_GATHER_ELEMENTS",
    "LatentProjections",
    "attend_masked",
    "attend_selected",
    "sparse_latent_attention",
]

# fp32 elements of gathered latent rows [queries, K, c] per chunk (64 MiB); the scores and
# probabilities of a chunk are H / c times that.
MAX_GATHER_ELEMENTS = 2**24


class LatentProjections(Protocol):
    """What an MLA layer (asyncrl.model.mla.MLAttention) lends its attention backend."""

    kv_lora_rank: int  # R: the value width of the latent
    v_dim: int  # v: the per-head value width
    softmax_scale: float  # 1 / sqrt(qk head dim)

    def expand(self, state_BSc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [B, H, S, d] and values [B, H, S, v] of the latent state."""
        ...

    def latent(self, state_BSc: torch.Tensor) -> torch.Tensor:
        """The state as the up-projection reads it (FP8-rounded where kv_b_proj is FP8)."""
        ...

    def absorb(self, q_BHTd: torch.Tensor) -> torch.Tensor:
        """Queries in the latent space [B, H, T, c]."""
        ...

    def project_out(self, o_BHTR: torch.Tensor) -> torch.Tensor:
        """Per-head outputs [B, H, T, v] from latent-space outputs."""
        ...


def _chunk_len(K: int, c: int) -> int:
    """Queries per chunk (read at call time, so a test can shrink the budget)."""
    return max(1, MAX_GATHER_ELEMENTS // max(1, K * c))


def _acc(x: torch.Tensor) -> torch.dtype:
    """The kernel's compute dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _scores(q_nHc, kv_Pc, rows_nK, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered rows [n, K, c] and masked scores [n, H, K] of one chunk of queries, in fp32."""
    n, K = rows_nK.shape
    rows_nKc = kv_Pc.index_select(0, rows_nK.clamp(min=0).flatten().long()).view(n, K, -1).to(_acc(kv_Pc))
    s_nHK = torch.bmm(q_nHc.to(rows_nKc.dtype), rows_nKc.transpose(1, 2)).mul_(scale)
    return rows_nKc, s_nHK.masked_fill_((rows_nK < 0)[:, None, :], float("-inf"))


class _SparseLatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_NHc, kv_Pc, rows_NK, value_dim: int, scale: float):
        N, H, _ = q_NHc.shape
        step = _chunk_len(rows_NK.shape[1], kv_Pc.shape[1])
        o_NHR = torch.empty(N, H, value_dim, dtype=_acc(kv_Pc), device=q_NHc.device)
        lse_NH = torch.empty(N, H, dtype=_acc(kv_Pc), device=q_NHc.device)
        for n0 in range(0, N, step):
            part = slice(n0, n0 + step)
            rows_nKc, s_nHK = _scores(q_NHc[part], kv_Pc, rows_NK[part], scale)
            lse_NH[part] = s_nHK.logsumexp(-1)
            p_nHK = s_nHK.sub_(lse_NH[part, :, None]).exp_()
            o_NHR[part] = torch.bmm(p_nHK, rows_nKc[..., :value_dim])
        ctx.save_for_backward(q_NHc, kv_Pc, rows_NK, o_NHR, lse_NH)
        ctx.value_dim, ctx.scale = value_dim, scale
        return o_NHR.to(q_NHc.dtype)

    @staticmethod
    def backward(ctx, grad_NHR):
        q_NHc, kv_Pc, rows_NK, o_NHR, lse_NH = ctx.saved_tensors
        R, scale = ctx.value_dim, ctx.scale
        acc = o_NHR.dtype
        grad_q = torch.empty(q_NHc.shape, dtype=acc, device=q_NHc.device)
        grad_kv = torch.zeros(kv_Pc.shape, dtype=acc, device=kv_Pc.device)
        delta_NH = (grad_NHR.to(acc) * o_NHR).sum(-1)
        step = _chunk_len(rows_NK.shape[1], kv_Pc.shape[1])
        for n0 in range(0, q_NHc.shape[0], step):
            part = slice(n0, n0 + step)
            q_nHc, do_nHR = q_NHc[part].to(acc), grad_NHR[part].to(acc)
            rows_nKc, s_nHK = _scores(q_nHc, kv_Pc, rows_NK[part], scale)
            p_nHK = s_nHK.sub_(lse_NH[part, :, None]).exp_()
            dp_nHK = torch.bmm(do_nHR, rows_nKc[..., :R].transpose(1, 2))
            ds_nHK = p_nHK * (dp_nHK - delta_NH[part, :, None]) * scale
            grad_q[part] = torch.bmm(ds_nHK, rows_nKc)
            drows_nKc = torch.bmm(ds_nHK.transpose(1, 2), q_nHc)
            drows_nKc[..., :R] += torch.bmm(p_nHK.transpose(1, 2), do_nHR)
            # a -1 place has p = 0, so its gradient is exactly 0: adding it to row 0 changes nothing
            grad_kv.index_add_(0, rows_NK[part].clamp(min=0).flatten().long(), drows_nKc.flatten(0, 1))
        return grad_q.to(q_NHc.dtype), grad_kv.to(kv_Pc.dtype), None, None, None


def sparse_latent_attention(
    q_NHc: torch.Tensor, kv_Pc: torch.Tensor, rows_NK: torch.Tensor, *, value_dim: int, scale: float
) -> torch.Tensor:
    """[N, H, value_dim]: query n attends over rows kv[rows[n, k]] (-1: no row; every query needs one),
    keys the whole row, values its first `value_dim` entries. Differentiable in q and kv."""
    return _SparseLatentAttention.apply(q_NHc, kv_Pc, rows_NK, value_dim, scale)


def attend_selected(
    q_BHTd: torch.Tensor, state_BSc: torch.Tensor, mla: LatentProjections, idx_BTK: torch.Tensor
) -> torch.Tensor:
    """DSA: each query over its selected keys only (idx into the S keys of its row, -1 for none)."""
    B, H, T, _ = q_BHTd.shape
    S = state_BSc.shape[1]
    q_NHc = mla.absorb(q_BHTd).transpose(1, 2).flatten(0, 1)
    offsets_B11 = torch.arange(B, device=idx_BTK.device).view(B, 1, 1) * S
    rows_NK = torch.where(idx_BTK >= 0, idx_BTK + offsets_B11, -1).flatten(0, 1)
    kv_Pc = mla.latent(state_BSc).flatten(0, 1)
    o_NHR = sparse_latent_attention(
        q_NHc, kv_Pc, rows_NK, value_dim=mla.kv_lora_rank, scale=mla.softmax_scale
    )
    return mla.project_out(o_NHR.view(B, T, H, -1).transpose(1, 2))


def attend_masked(
    q_BHTd: torch.Tensor, state_BSc: torch.Tensor, mla: LatentProjections, idx_BTK: torch.Tensor
) -> torch.Tensor:
    """The dense reference of `attend_selected`: expanded K/V and the selection as a [T, S] mask."""
    k_BHSd, v_BHSv = mla.expand(state_BSc)
    keep_B1TS = selection_mask(idx_BTK, state_BSc.shape[1]).unsqueeze(1)
    return sdpa(q_BHTd, k_BHSd, v_BHSv, attn_mask=keep_B1TS, scale=mla.softmax_scale)

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
chunk, so autograd keeps only the inputs and the output. Queries, rows and probabilities are fp32
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
    "CPU_GATHER_ELEMENTS",
    "MAX_GATHER_ELEMENTS",
    "LatentProjections",
    "attend_masked",
    "attend_selected",
    "latent_attention",
    "sparse_latent_attention",
]

# fp32 elements of gathered latent rows [queries, K, c] per chunk (64 MiB; 4 MiB on a CPU, where
# passes over fresh buffers much larger than that page-fault); the scores and probabilities of a
# chunk are H / c times that.
MAX_GATHER_ELEMENTS = 2**24
CPU_GATHER_ELEMENTS = 2**20


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


def _chunk_len(kv_Pc: torch.Tensor, K: int) -> int:
    """Queries per chunk (the budgets are read at call time, so a test can shrink them)."""
    budget = CPU_GATHER_ELEMENTS if kv_Pc.device.type == "cpu" else MAX_GATHER_ELEMENTS
    return max(1, budget // max(1, K * kv_Pc.shape[1]))


def _acc(x: torch.Tensor) -> torch.dtype:
    """The kernel's compute dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _probabilities(
    qs_nHc: torch.Tensor, kv_Pc: torch.Tensor, rows_nK: torch.Tensor, buf_Xc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered rows [n, K, c] and attention probabilities [n, H, K] of one chunk of queries
    (already scaled), in the compute dtype; the rows are gathered into `buf_Xc`, reused by every
    chunk of a call."""
    n, K = rows_nK.shape
    gathered = torch.index_select(kv_Pc, 0, rows_nK.clamp(min=0).flatten(), out=buf_Xc[: n * K])
    rows_nKc = gathered.view(n, K, -1).to(qs_nHc.dtype)
    s_nHK = torch.bmm(qs_nHc, rows_nKc.transpose(1, 2))
    missing_nK = rows_nK < 0
    if bool(missing_nK.any()):
        s_nHK.masked_fill_(missing_nK[:, None, :], float("-inf"))
    return rows_nKc, torch.softmax(s_nHK, dim=-1)


class _SparseLatentAttention(torch.autograd.Function):
    """Forward a chunk of queries at a time; backward recomputes each chunk's rows and
    probabilities (nothing of size [N, K] but the row indices is kept)."""

    @staticmethod
    def forward(ctx, q_NHc, kv_Pc, rows_NK, value_dim: int, scale: float):
        (N, H, c), K, acc = q_NHc.shape, rows_NK.shape[1], _acc(kv_Pc)
        step = _chunk_len(kv_Pc, K)
        buf_Xc = kv_Pc.new_empty(min(N, step) * K, c)
        o_NHR = torch.empty(N, H, value_dim, dtype=acc, device=q_NHc.device)
        for n0 in range(0, N, step):
            part = slice(n0, n0 + step)
            rows_nKc, p_nHK = _probabilities(q_NHc[part].to(acc) * scale, kv_Pc, rows_NK[part], buf_Xc)
            torch.bmm(p_nHK, rows_nKc[..., :value_dim], out=o_NHR[part])
        ctx.save_for_backward(q_NHc, kv_Pc, rows_NK, o_NHR)
        ctx.value_dim, ctx.scale = value_dim, scale
        return o_NHR.to(q_NHc.dtype)

    @staticmethod
    def backward(ctx, grad_NHR):
        q_NHc, kv_Pc, rows_NK, o_NHR = ctx.saved_tensors
        R, scale, acc = ctx.value_dim, ctx.scale, o_NHR.dtype
        (N, _, c), K = q_NHc.shape, rows_NK.shape[1]
        step = _chunk_len(kv_Pc, K)
        buf_Xc = kv_Pc.new_empty(min(N, step) * K, c)
        grad_q = torch.empty(q_NHc.shape, dtype=acc, device=q_NHc.device)
        grad_kv = torch.zeros(kv_Pc.shape, dtype=acc, device=kv_Pc.device)
        delta_NH = (grad_NHR.to(acc) * o_NHR).sum(-1)
        for n0 in range(0, N, step):
            part = slice(n0, n0 + step)
            qs_nHc, do_nHR = q_NHc[part].to(acc) * scale, grad_NHR[part].to(acc)
            rows_nKc, p_nHK = _probabilities(qs_nHc, kv_Pc, rows_NK[part], buf_Xc)
            dp_nHK = torch.bmm(do_nHR, rows_nKc[..., :R].transpose(1, 2))
            ds_nHK = dp_nHK.sub_(delta_NH[part, :, None]).mul_(p_nHK)  # d(loss)/d(scaled scores)
            torch.bmm(ds_nHK, rows_nKc, out=grad_q[part])
            drows_nKc = torch.bmm(ds_nHK.transpose(1, 2), qs_nHc)
            drows_nKc[..., :R] += torch.bmm(p_nHK.transpose(1, 2), do_nHR)
            # a -1 place has p = 0, so its gradient is exactly 0: adding it to row 0 changes nothing
            grad_kv.index_add_(0, rows_NK[part].clamp(min=0).flatten(), drows_nKc.view(-1, c))
        return grad_q.mul_(scale).to(q_NHc.dtype), grad_kv.to(kv_Pc.dtype), None, None, None


def sparse_latent_attention(
    q_NHc: torch.Tensor, kv_Pc: torch.Tensor, rows_NK: torch.Tensor, *, value_dim: int, scale: float
) -> torch.Tensor:
    """[N, H, value_dim]: query n attends over rows kv[rows[n, k]] (-1: no row; every query needs one),
    keys the whole row, values its first `value_dim` entries. Differentiable in q and kv."""
    return _SparseLatentAttention.apply(q_NHc, kv_Pc, rows_NK, value_dim, scale)


def latent_attention(
    q_NHc: torch.Tensor, rows_NJc: torch.Tensor, keep_NJ: torch.Tensor | None, *, value_dim: int, scale: float
) -> torch.Tensor:
    """[N, H, value_dim] in q's dtype: query n attends over its own rows [J, c] (`keep` masks some
    out; each query keeps one at least), as `sparse_latent_attention` does, without the gather
    and without gradient (the engine's decode, whose rows come from its paged cache)."""
    acc = _acc(rows_NJc)
    s_NHJ = torch.bmm(q_NHc.to(acc) * scale, rows_NJc.to(acc).transpose(1, 2))
    if keep_NJ is not None:
        s_NHJ.masked_fill_(~keep_NJ[:, None, :], float("-inf"))
    return torch.bmm(torch.softmax(s_NHJ, dim=-1), rows_NJc[..., :value_dim].to(acc)).to(q_NHc.dtype)


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

"""Causal self-attention in blocks of queries, from batched matmuls: bf16 training on CPUs whose
bf16 matmuls are native but whose flash-attention kernel is not fast in bf16.

On a CPU with AVX-512 BF16 and no AMX, oneDNN's bf16 matmuls run about twice as fast as fp32 ones,
but torch's CPU flash-attention kernel gains nothing from bf16 there: its forward + backward of a
[4 x 8 heads x 512 x 64] causal attention costs the same in bf16 as in fp32, and attention is ~40%
of a small MoE's bf16 training step at 512 tokens a row (BENCHMARKS.md, "Model (AVX512
AVX512_BF16)"). `blocked_causal_attention` computes the same function from whole matmuls:

- queries go in blocks of `block` positions (all query heads of a kv group together, so GQA needs no
  copy of K/V); a block sees keys 0 .. its last position only, which skips most of the masked half;
- scores are fp32 products of the bf16 values, not rounded to bf16 (a bf16 matmul would round every
  score: several times the flash kernel's error): from `asyncrl.model.cpu_scores`'s C kernel where
  it runs (bf16 dot products summed in fp32, at the bf16 rate), else from an fp32 matmul (bf16
  inputs are exact in fp32); the softmax is in fp32; probabilities are rounded to bf16 for the bf16
  matmul with V, as the flash kernel does;
- the backward recomputes nothing: it keeps each block's fp32 probabilities (memory ~ B x H x T^2 /
  2 x 4 bytes per call, which is why `compute.sdpa` takes this path only up to
  `MAX_BLOCKED_SCORES`), takes dP in fp32 as the forward takes the scores, rounds dS to bf16 for the
  two bf16 matmuls that give dQ and dK, and sums dK and dV over the blocks in fp32.

    from asyncrl.model.blocked_attention import blocked_causal_attention
    o_BHTd = blocked_causal_attention(q_BHTd, k_BGTd, v_BGTv)   # = sdpa(..., is_causal=True, enable_gqa=True)

Inputs are [B, H, T, d] queries and [B, G, T, d] keys / [B, G, T, dv] values, H a multiple of G;
any float dtype (fp32 gives fp32 matmuls throughout). `compute.sdpa` takes this path where
`compute.blocked_attention` says so.
"""

from __future__ import annotations

import functools

import torch

from asyncrl.model import cpu_scores

__all__ = ["BLOCK_QUERIES", "blocked_causal_attention"]


# Query positions per block: smaller blocks skip more of the masked half, larger ones make larger
# matmuls. benchmarks/bench_attention.py (BENCHMARKS.md, "Training attention (CPU bf16)") times 32
# and 64: 64 faster in most rows of 1-4 rows of 128-2048 positions, 32 by 5-10% at 4 rows of 512.
BLOCK_QUERIES = 64


def blocked_causal_attention(
    q_BHTd: torch.Tensor,
    k_BGTd: torch.Tensor,
    v_BGTv: torch.Tensor,
    *,
    scale: float | None = None,
    block: int = BLOCK_QUERIES,
) -> torch.Tensor:
    """Causal attention of T queries over the same T positions, [B, H, T, dv]; differentiable.
    `block`: query positions per block."""
    B, H, T, d = q_BHTd.shape
    G = k_BGTd.shape[1]
    if H % G or k_BGTd.shape[:3] != (B, G, T) or v_BGTv.shape[:3] != (B, G, T) or k_BGTd.shape[3] != d:
        raise ValueError(
            f"blocked_causal_attention: q {tuple(q_BHTd.shape)}, k {tuple(k_BGTd.shape)} and "
            f"v {tuple(v_BGTv.shape)} are not [B, H, T, d], [B, G, T, d], [B, G, T, dv] with G | H"
        )
    scale = d**-0.5 if scale is None else float(scale)
    if block < 1:
        raise ValueError(f"blocked_causal_attention: block must be >= 1, got {block}")
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHTd, k_BGTd, v_BGTv))
    if grads:
        return _Blocked.apply(q_BHTd, k_BGTd, v_BGTv, scale, block)
    return _forward(q_BHTd, k_BGTd, v_BGTv, scale, block, keep=False)[0]


def _grouped(x_BHTd: torch.Tensor, G: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, T, d] -> [B*G, T*r, d] in `dtype`, one copy: row t*r + j is head g*r + j at position t."""
    B, H, T, d = x_BHTd.shape
    r = H // G
    out = torch.empty(B, G, T, r, d, dtype=dtype, device=x_BHTd.device)
    out.copy_(x_BHTd.view(B, G, r, T, d).transpose(2, 3))
    return out.view(B * G, T * r, d)


def _ungrouped(x_XRd: torch.Tensor, B: int, G: int, T: int) -> torch.Tensor:
    """The inverse of `_grouped`, laid out [B, T, H, d] in memory (as a projection's output is)."""
    d = x_XRd.shape[-1]
    r = x_XRd.shape[1] // T
    return x_XRd.view(B, G, T, r, d).permute(0, 2, 1, 3, 4).reshape(B, T, G * r, d).transpose(1, 2)


def _transposed(x_XTd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[X, T, d] -> [X, d, T] in `dtype`, contiguous."""
    X, T, d = x_XTd.shape
    out = torch.empty(X, d, T, dtype=dtype, device=x_XTd.device)
    out.copy_(x_XTd.transpose(1, 2))
    return out


@functools.cache
def _future(n: int, r: int, device: torch.device) -> torch.Tensor:
    """[n*r, n] bool: row t*r + j (query t) against key t' of the diagonal block, True where t' > t."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1).repeat_interleave(r, 0)


def _blocks(T: int, block: int) -> list[tuple[int, int]]:
    return [(a, min(a + block, T)) for a in range(0, T, block)]


def _forward(
    q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTv: torch.Tensor, scale: float, block: int, *, keep: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """(output [B, H, T, dv]; for the backward: output, queries, keys and values as the matmuls take
    them ([B*G, T*r, dv], [B*G, T*r, d], [B*G, T, d], [B*G, T, dv]), each block's fp32 probabilities if
    `keep`)."""
    B, H, T, _ = q_BHTd.shape
    G, dv = k_BGTd.shape[1], v_BGTv.shape[-1]
    r, low = H // G, q_BHTd.dtype
    qb = _grouped(q_BHTd, G, low)
    kb, vb = k_BGTd.reshape(B * G, T, -1), v_BGTv.reshape(B * G, T, dv)
    if cpu_scores.supports(qb, kb):  # fp32 scores at the bf16 rate, from bf16 operands
        kp = cpu_scores.pack(kb)

        def scores(a: int, b: int) -> torch.Tensor:
            return cpu_scores.scores(qb[:, a * r : b * r], kp, b, scale)

    else:
        qs = qb.to(torch.float32, copy=True).mul_(scale)
        kt = _transposed(kb, torch.float32)

        def scores(a: int, b: int) -> torch.Tensor:
            return torch.bmm(qs[:, a * r : b * r], kt[:, :, :b])

    out = torch.empty(B * G, T * r, dv, dtype=low, device=q_BHTd.device)
    kept = []
    for a, b in _blocks(T, block):
        s = scores(a, b)
        s[:, :, a:].masked_fill_(_future(b - a, r, s.device), float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[:, a * r : b * r] = torch.bmm(p.to(low), vb[:, :b])
        if keep:
            kept.append(p)
    return _ungrouped(out, B, G, T), (out, qb, kb, vb), kept


class _Blocked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTd, k_BGTd, v_BGTv, scale: float, block: int):  # type: ignore[override]
        o_BHTv, grouped, probs = _forward(q_BHTd, k_BGTd, v_BGTv, scale, block, keep=True)
        ctx.save_for_backward(*grouped, *probs)
        ctx.scale, ctx.block, ctx.shape = scale, block, (*q_BHTd.shape[:2], *k_BGTd.shape[1:3])
        return o_BHTv

    @staticmethod
    def backward(ctx, do_BHTv):  # type: ignore[override]
        out, qb, kb, vb, *probs = ctx.saved_tensors
        B, H, G, T = ctx.shape
        d, dv = qb.shape[-1], vb.shape[-1]
        r, low, scale = H // G, qb.dtype, ctx.scale
        dob = _grouped(do_BHTv, G, low)
        # Scores were scale * q.k: with dP = dO.v scaled, dS comes out scaled as dQ and dK need it.
        # D = scale * rowsum(dO * O): softmax's backward.
        D = (dob.float() * out.float()).sum(-1, keepdim=True).mul_(scale)
        if cpu_scores.supports(dob, vb):  # fp32 dP at the bf16 rate, as the forward's scores
            vp = cpu_scores.pack(vb)

            def dp_minus_D(rows: slice, b: int) -> torch.Tensor:
                return cpu_scores.scores(dob[:, rows], vp, b, scale).sub_(D[:, rows])

        else:
            dos = dob.to(torch.float32, copy=True).mul_(scale)
            vt = _transposed(vb, torch.float32)

            def dp_minus_D(rows: slice, b: int) -> torch.Tensor:
                return torch.baddbmm(D[:, rows], dos[:, rows], vt[:, :, :b], beta=-1)

        dq = torch.empty(B * G, T * r, d, dtype=low, device=qb.device)
        dk = torch.zeros(B * G, T, d, dtype=torch.float32, device=qb.device)
        dvv = torch.zeros(B * G, T, dv, dtype=torch.float32, device=qb.device)
        for (a, b), p in zip(_blocks(T, ctx.block), probs, strict=True):
            rows = slice(a * r, b * r)
            dvv[:, :b] += torch.bmm(p.to(low).transpose(1, 2), dob[:, rows])
            ds = dp_minus_D(rows, b).mul_(p)
            dsb = ds.to(low)
            dq[:, rows] = torch.bmm(dsb, kb[:, :b])
            dk[:, :b] += torch.bmm(dsb.transpose(1, 2), qb[:, rows])
        dq_BHTd = _ungrouped(dq, B, G, T)
        return dq_BHTd, dk.view(B, G, T, d).to(low), dvv.view(B, G, T, dv).to(low), None, None

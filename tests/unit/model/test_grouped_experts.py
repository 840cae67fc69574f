"""The grouped experts' paths (grouped GEMM without autograd and in native bf16 training, per-expert
loop otherwise) agree."""

from __future__ import annotations

import pytest
import torch

from asyncrl.model.compute import set_cpu_upcast
from asyncrl.model.moe import _use_grouped_mm, grouped_swiglu


def _inputs(N: int, D: int, hidden: int, E: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen)
    weights = [torch.randn(E, hidden, D, generator=gen), torch.randn(E, hidden, D, generator=gen)]
    weights.append(torch.randn(E, D, hidden, generator=gen))
    ids = torch.randint(0, E - 1, (N,), generator=gen)  # the last expert gets no tokens
    counts = torch.bincount(ids, minlength=E)
    return x[ids.argsort(stable=True)], counts, weights


def test_grouped_gemm_matches_the_loop_bit_for_bit_and_the_loop_keeps_gradients():
    x, counts, (g, u, d) = _inputs(N=37, D=64, hidden=32, E=5)
    with torch.no_grad():
        assert _use_grouped_mm(x, g, d) == hasattr(torch.nn.functional, "grouped_mm")
        fast = grouped_swiglu(x, counts, g, u, d)
    g.requires_grad_()
    assert not _use_grouped_mm(x, g, d)  # autograd on: the loop
    loop = grouped_swiglu(x, counts, g, u, d)
    assert torch.equal(fast, loop.detach())
    loop.square().sum().backward()
    assert g.grad is not None and torch.equal(g.grad[-1], torch.zeros_like(g.grad[-1]))  # unused expert
    e0 = slice(0, int(counts[0]))
    ref = (torch.nn.functional.silu(x[e0] @ g[0].T) * (x[e0] @ u[0].T)) @ d[0].T
    assert torch.allclose(loop[e0], ref, atol=1e-4)


def test_unaligned_rows_fall_back_to_the_loop():
    x, counts, (g, u, d) = _inputs(N=9, D=6, hidden=3, E=2)
    with torch.no_grad():
        assert not _use_grouped_mm(x, g, d)
        out = grouped_swiglu(x, counts, g, u, d)
    assert out.shape == (9, 6)


@pytest.fixture
def native_bf16():
    """bf16 ops take torch's native kernels, as on a CPU with AVX-512 BF16 or AMX."""
    set_cpu_upcast(False)
    yield
    set_cpu_upcast(None)


def _fwd_bwd(x, counts, weights, dtype, linear=None):
    x = x.to(dtype).requires_grad_()
    params = [w.to(dtype).requires_grad_() for w in weights]
    y = grouped_swiglu(x, counts, *params, linear=linear)
    y.float().square().sum().backward()
    return [t.float() for t in (y, x.grad, *(p.grad for p in params))]


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="torch lacks F.grouped_mm")
def test_native_bf16_training_takes_the_grouped_gemm_close_to_fp32(native_bf16):
    x, counts, weights = _inputs(N=45, D=64, hidden=32, E=5)
    weights = [w * 0.1 for w in weights]
    bf16_x = x.bfloat16().requires_grad_()
    assert _use_grouped_mm(bf16_x, weights[0].bfloat16(), weights[2].bfloat16())
    assert not _use_grouped_mm(x.requires_grad_(), weights[0], weights[2])  # fp32 training: the loop
    grouped = _fwd_bwd(x.detach(), counts, weights, torch.bfloat16)
    loop = _fwd_bwd(x.detach(), counts, weights, torch.bfloat16, linear=lambda a, w: a @ w.T)
    ref = _fwd_bwd(x.detach(), counts, weights, torch.float32)
    for name, g, lp, r in zip(("out", "x", "gate", "up", "down"), grouped, loop, ref, strict=True):
        scale = r.abs().max()
        assert (g - r).abs().max() / scale < 2e-2, name  # bf16 rounding of inputs and outputs only
        assert (g - lp).abs().max() / scale < 1e-2, name
    assert torch.equal(grouped[4][-1], torch.zeros_like(grouped[4][-1]))  # the expert with no tokens

"""The grouped experts' paths (grouped GEMM without autograd, per-expert loop with it) agree."""

from __future__ import annotations

import torch

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

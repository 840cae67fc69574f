"""The grouped experts' paths (grouped GEMM without autograd and in native bf16 training, a padded
batched matmul in native bf16 inference, per-expert loop otherwise) agree."""

from __future__ import annotations

import pytest
import torch

from asyncrl.model import compute, moe
from asyncrl.model.compute import set_cpu_upcast
from asyncrl.model.moe import _use_grouped_mm, _use_padded_bmm, grouped_swiglu


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


def _balanced(N: int, D: int, hidden: int, E: int, seed: int = 0):
    """Like `_inputs`, with every expert but the last getting N // (E - 1) rows or one more."""
    x, _, weights = _inputs(N, D, hidden, E, seed)
    counts = torch.full((E,), N // (E - 1))
    counts[: N % (E - 1)] += 1
    counts[-1] = 0
    return x, counts, [w * 0.1 for w in weights]


def test_native_bf16_inference_pads_experts_into_one_batched_matmul_close_to_the_loop(native_bf16):
    x, counts, weights = _balanced(N=47, D=64, hidden=32, E=6)
    xb, wb = x.bfloat16(), [w.bfloat16() for w in weights]
    with torch.inference_mode():
        assert _use_padded_bmm(xb, counts)
        padded = grouped_swiglu(xb, counts, *wb)
        loop = grouped_swiglu(xb, counts, *wb, linear=lambda a, w: a @ w.T)
        ref = grouped_swiglu(xb.float(), counts, *(w.float() for w in wb))
    assert padded.dtype == torch.bfloat16 and padded.shape == (47, 64)
    scale = ref.abs().max()
    assert (padded.float() - loop.float()).abs().max() / scale < 1e-2
    assert (padded.float() - ref).abs().max() / scale < 2e-2  # bf16 rounding of the products only
    # each row lands back at its own place: permuting the rows within an expert permutes the output
    flipped = torch.cat([part.flip(0) for part in xb.split(counts.tolist())])
    with torch.inference_mode():
        again = grouped_swiglu(flipped, counts, *wb)
    assert torch.equal(torch.cat([part.flip(0) for part in again.split(counts.tolist())]), padded)


def test_the_padded_batch_is_for_balanced_native_bf16_inference_only(native_bf16):
    x, counts, _ = _balanced(N=40, D=64, hidden=32, E=5)
    xb = x.bfloat16()
    skewed = torch.tensor([34, 2, 2, 2, 0])  # 5 x 34 padded rows for 40 real ones
    with torch.inference_mode():
        assert _use_padded_bmm(xb, counts) and not _use_padded_bmm(xb, skewed)
        assert not _use_padded_bmm(x, counts)  # fp32: torch's grouped GEMM
        assert not _use_padded_bmm(xb[:0], torch.zeros(5, dtype=torch.long))
    assert not _use_padded_bmm(xb, counts)  # autograd: training keeps the grouped GEMM
    set_cpu_upcast(True)  # a CPU without native bf16: the fp32 path
    with torch.inference_mode():
        assert not _use_padded_bmm(xb, counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_match_the_grouped_path_and_follow_new_weights(dtype):
    if dtype == torch.bfloat16 and not compute.cpu_kernels().native_bf16:
        pytest.skip("this CPU has no native bf16 kernels: bf16 experts are never packed here")
    x, counts, weights = _inputs(N=40, D=64, hidden=32, E=5)
    x, (g, u, d) = x.to(dtype), [w.to(dtype) for w in weights]
    with torch.no_grad():
        ref = grouped_swiglu(x, counts, g, u, d)
    compute.set_cpu_packing(True)
    try:
        with torch.inference_mode():
            packed = grouped_swiglu(x, counts, g, u, d)
            kept = moe._packed_experts(g, u, d)
            assert moe._packed_experts(g, u, d) is kept  # packed once, kept
        with torch.no_grad():
            d.mul_(2.0)
        with torch.inference_mode():
            doubled = grouped_swiglu(x, counts, g, u, d)
    finally:
        compute.set_cpu_packing(None)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(packed, ref, **tol)
    torch.testing.assert_close(doubled, 2 * ref, **tol)  # the new down projection, not the kept one

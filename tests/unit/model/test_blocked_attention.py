"""Causal attention from blocked matmuls (asyncrl.model.blocked_attention) against SDPA in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncrl.model import cpu_scores
from asyncrl.model.blocked_attention import BLOCK_QUERIES, blocked_causal_attention

_NAMES = ("o", "q", "k", "v")


def _inputs(B: int, H: int, G: int, T: int, d: int, dv: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v laid out as projections give them ([B, T, heads, d] in memory, viewed [B, heads, T, d])."""
    gen = torch.Generator().manual_seed(seed)

    def make(heads: int, dim: int) -> torch.Tensor:
        return torch.randn(B, T, heads, dim, generator=gen).to(dtype).transpose(1, 2).requires_grad_()

    return make(H, d), make(G, d), make(G, dv), torch.randn(B, H, T, dv, generator=gen).to(dtype)


def _reference(q, k, v, do, scale=None):
    """Output and input gradients of SDPA in fp64 on the same values."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True, scale=scale)
    o.backward(do.double())
    return o, q64.grad, k64.grad, v64.grad


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(params=[True, False], ids=["score kernel", "fp32 score matmuls"])
def score_kernel(request):
    """Scores and dP from the C kernel (where it runs here) and from fp32 matmuls."""
    if request.param and not cpu_scores.available():
        pytest.skip(f"no score kernel here: {cpu_scores.note()}")
    cpu_scores.set_enabled(request.param)
    yield request.param
    cpu_scores.set_enabled(True)


@pytest.mark.parametrize(
    ("B", "H", "G", "T", "block", "d"),
    [
        (2, 4, 2, 37, 8, 16),
        (1, 4, 4, 64, 64, 64),
        (3, 6, 2, 20, 7, 16),
        (1, 2, 1, 5, 32, 16),
        (1, 2, 1, 9, 4, 15),
    ],
)
def test_bf16_output_and_gradients_match_fp64_sdpa_as_closely_as_the_flash_kernel(
    B, H, G, T, block, d, score_kernel
):
    q, k, v, do = _inputs(B, H, G, T, d, 16, torch.bfloat16)
    ref = _reference(q, k, v, do)
    out = blocked_causal_attention(q, k, v, block=block)
    out.backward(do)
    got = (out, q.grad, k.grad, v.grad)
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert out.shape == (B, H, T, 16) and q.grad.shape == q.shape and k.grad.shape == k.shape
    for t in (q, k, v):
        t.grad = None
    flash = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    flash.backward(do)
    for name, mine, theirs, r in zip(_NAMES, got, (flash, q.grad, k.grad, v.grad), ref, strict=True):
        # bf16 carries 8 bits: ~4e-3 relative per rounding; both round P (and dS) to bf16 once
        assert _rel_err(mine, r) < 2e-2, name
        assert _rel_err(mine, r) < 2 * _rel_err(theirs, r) + 4e-3, name


def test_fp32_is_sdpa_up_to_summation_order_with_its_own_scale_and_value_width():
    q, k, v, do = _inputs(2, 4, 2, 33, 8, 12, torch.float32, seed=1)
    ref = _reference(q, k, v, do, scale=0.3)
    out = blocked_causal_attention(q, k, v, scale=0.3, block=5)
    out.backward(do)
    for name, got, r in zip(_NAMES, (out, q.grad, k.grad, v.grad), ref, strict=True):
        assert _rel_err(got, r) < 1e-5, name


def test_without_autograd_the_forward_is_the_same_and_keeps_nothing():
    q, k, v, _ = _inputs(2, 4, 2, 40, 16, 16, torch.bfloat16)
    with_grad = blocked_causal_attention(q, k, v)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        plain = blocked_causal_attention(q, k, v)
    assert plain.grad_fn is None and torch.equal(plain, with_grad)


def test_the_first_query_sees_only_the_first_key():
    q, k, v, _ = _inputs(1, 2, 1, 9, 4, 4, torch.float32)
    out = blocked_causal_attention(q, k, v, block=4)
    assert torch.allclose(out[0, :, 0], v[0, 0, 0].expand(2, 4))


def test_the_default_block_covers_a_short_sequence_in_one_block():
    q, k, v, _ = _inputs(1, 2, 1, BLOCK_QUERIES, 8, 8, torch.float32)
    one_block = blocked_causal_attention(q, k, v)
    assert torch.allclose(one_block, blocked_causal_attention(q, k, v, block=7), atol=1e-6)


def test_bad_shapes_are_named():
    q, k, v, _ = _inputs(1, 3, 2, 8, 4, 4, torch.float32)
    with pytest.raises(ValueError, match=r"G \| H"):
        blocked_causal_attention(q, k, v)
    q, k, v, _ = _inputs(1, 4, 2, 8, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="are not"):
        blocked_causal_attention(q, k[:, :, :5], v)
    with pytest.raises(ValueError, match="block must be >= 1"):
        blocked_causal_attention(q, k, v, block=0)

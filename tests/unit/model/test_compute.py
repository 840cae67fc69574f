"""The fp32 path of low-precision CPU ops (asyncrl.model.compute) against torch's own bf16 kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncrl.model import Transformer, compute, preset_args
from asyncrl.model.compute import as_fp32, cpu_upcast, drop_kept_copies, linear, sdpa, set_cpu_upcast


@pytest.fixture
def forced():
    """Set the upcast choice for one test; detection is restored afterwards."""
    yield set_cpu_upcast
    set_cpu_upcast(None)


def test_only_low_precision_cpu_tensors_are_upcast(forced):
    forced(True)
    assert cpu_upcast(torch.zeros(2, dtype=torch.bfloat16))
    assert cpu_upcast(torch.zeros(2, dtype=torch.float16))
    assert not cpu_upcast(torch.zeros(2, dtype=torch.float32))
    forced(False)
    assert not cpu_upcast(torch.zeros(2, dtype=torch.bfloat16))


def test_linear_and_sdpa_match_native_bf16_and_keep_dtypes(forced):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(32, 64, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(32, generator=gen).bfloat16()
    forced(True)
    y = linear(x, w, b)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.float(), b.float())
    native = F.linear(x, w, b).float()
    # both round an fp32-accumulated result to bf16: each within one bf16 step of the fp32 value
    tol = ref.abs() * 2**-7 + 1e-3
    assert (y.float() - ref).abs().le(tol).all() and (native - ref).abs().le(tol).all()

    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen).bfloat16() for _ in range(3))
    o = sdpa(q, k, v, is_causal=True)
    o_ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert o.dtype == torch.bfloat16
    assert (o.float() - o_ref).abs().max() < 2e-2


def test_bf16_model_upcast_close_to_native_and_fp32(forced):
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(seed=0)
    ids = torch.randint(0, model.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        model.bfloat16()
        forced(False)
        native = model(ids).logits.float()
        forced(True)
        upcast = model(ids).logits.float()
    assert not torch.equal(upcast, native)  # the two paths really differ (rounding points)
    err_native = (native - ref).abs().max()
    err_upcast = (upcast - ref).abs().max()
    assert err_upcast < 2 * err_native + 1e-3, (err_upcast, err_native)


def test_fp32_copy_is_kept_under_inference_mode_until_the_weight_changes():
    w = torch.nn.Parameter(torch.randn(4, 3).bfloat16(), requires_grad=False)
    with torch.inference_mode():
        first = as_fp32(w)
        assert as_fp32(w) is first and torch.equal(first, w.float())  # kept, not cast again
    with torch.no_grad():
        w.add_(1.0)  # an in-place write bumps the version
    with torch.inference_mode():
        assert torch.equal(as_fp32(w), w.float())
    w.data = torch.randn(4, 3).bfloat16()  # the engine's weight swap: another tensor
    with torch.inference_mode():
        assert torch.equal(as_fp32(w), w.float())
    assert as_fp32(w) is not as_fp32(w)  # outside inference mode (training): cast every time


def test_bf16_model_after_a_weight_swap_computes_with_the_new_weights(forced):
    forced(True)
    old, new = Transformer(preset_args("tiny-moe")), Transformer(preset_args("tiny-moe"))
    old.init_weights(seed=0)
    new.init_weights(seed=1)
    old.bfloat16(), new.bfloat16()
    ids = torch.randint(0, old.args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        old(ids)  # fills the kept fp32 copies
        for name, p in old.named_parameters():
            p.data = new.get_parameter(name).detach().clone()
        assert torch.equal(old(ids).logits, new(ids).logits)


def test_rms_norm_fused_inference_path_equals_the_autograd_path():
    from asyncrl.model.layers import RMSNorm

    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(0)) * 3
    for dtype in (torch.float32, torch.bfloat16):
        norm.to(dtype)
        with torch.no_grad():
            fused = norm(x.to(dtype))
        assert torch.equal(fused, norm(x.to(dtype)).detach())


def test_fp32_copy_is_not_served_for_a_new_tensor_at_the_same_address():
    # Two tensors over one buffer: the second is a new tensor (its own storage) at the address the
    # first had, as after a swap whose new tensor the allocator put where the old one was.
    memory = np.zeros((64, 32), np.int16)
    w = torch.nn.Parameter(torch.from_numpy(memory).view(torch.bfloat16), requires_grad=False)
    with torch.inference_mode():
        assert not as_fp32(w).any()
    memory[:] = torch.ones(64, 32, dtype=torch.bfloat16).view(torch.int16).numpy()
    new = torch.from_numpy(memory).view(torch.bfloat16)
    w.data = new  # the swap: same address, the weight's version counter unchanged
    assert w.data_ptr() == new.data_ptr() and w._version == 0
    with torch.inference_mode():
        assert torch.equal(as_fp32(w), torch.ones(64, 32))


def test_drop_kept_copies_forgets_writes_the_version_counter_cannot_see():
    w = torch.nn.Parameter(torch.randn(4, 3).bfloat16(), requires_grad=False)
    alias = w.data  # shares the storage, not the version counter
    with torch.inference_mode():
        as_fp32(w)
    alias.fill_(2.0)
    drop_kept_copies([w])
    with torch.inference_mode():
        assert torch.equal(as_fp32(w), torch.full((4, 3), 2.0))


@pytest.fixture
def avx512_bf16(monkeypatch):
    """Detection as on a CPU with AVX-512 BF16 and no AMX, whatever this one has."""
    monkeypatch.setattr(compute, "_cpu_native", lambda dtype: True)
    kernels = compute.CpuKernels(isa="AVX512 AVX512_BF16", native_bf16=True, amx=False)
    monkeypatch.setattr(compute, "cpu_kernels", lambda: kernels)


def test_avx512_bf16_cpu_upcasts_only_small_experts_outside_autograd(avx512_bf16):
    x = torch.zeros(2, dtype=torch.bfloat16)
    with torch.inference_mode():  # the engine's steps
        assert cpu_upcast(x, expert_numel=128 * 128)
        assert not cpu_upcast(x, expert_numel=448 * 512)
        assert not cpu_upcast(x.float(), expert_numel=128 * 128)
    assert not cpu_upcast(x, expert_numel=128 * 128)  # training: torch's grouped GEMM in bf16
    assert not cpu_upcast(x)  # attention native


def test_avx512_bf16_cpu_takes_fp32_for_small_linears_outside_autograd_only(avx512_bf16):
    x = torch.randn(3, 128).bfloat16()
    small, lm_head = torch.randn(128, 128).bfloat16(), torch.randn(260, 128).bfloat16()
    with torch.inference_mode():  # the engine's steps
        assert cpu_upcast(x, linear_numel=small.numel()) and not cpu_upcast(x, linear_numel=lm_head.numel())
        y = compute.linear(x, small)
        assert compute.as_fp32(small) is compute.as_fp32(small)  # the fp32 copy is kept, not remade
    assert not cpu_upcast(x, linear_numel=small.numel())  # training: native
    # the fp32 path gives the exact products of the bf16 values, rounded once
    assert y.dtype == torch.bfloat16 and torch.equal(y, (x.float() @ small.float().T).bfloat16())


def test_cpu_kernels_decisions_and_startup_line():
    avx2 = compute.CpuKernels(isa="AVX2", native_bf16=False, amx=False)
    amx = compute.CpuKernels(isa="AVX512 AVX512_BF16 AMX", native_bf16=True, amx=True)
    avx512 = compute.CpuKernels(isa="AVX512 AVX512_BF16", native_bf16=True, amx=False)
    assert "no native bf16" in avx2.describe() and not avx2.native_experts(10**6, autograd=True)
    assert amx.native_experts(16)
    assert avx512.native_experts(16, autograd=True) and not avx512.native_experts(16)
    assert amx.native_linear(16) and avx512.native_linear(16, autograd=True)
    assert not avx512.native_linear(128 * 128) and avx512.native_linear(260 * 128)
    assert not avx2.native_linear(10**6, autograd=True)
    assert "AMX" in amx.describe() and "MoE experts native; " in amx.describe()
    assert f"weights of {compute.MIN_PACKED}+ elements packed" in amx.describe()
    assert f"linear native from {compute.MIN_NATIVE_LINEAR} weights" in avx512.describe()
    assert "training's causal attention from blocked bf16 matmuls" in avx512.describe()
    assert "CPU AVX" in compute.cpu_kernels().describe()  # this machine's line


@pytest.fixture
def packing():
    """Set the packed-weights choice for one test; the size rule is restored afterwards."""
    yield compute.set_cpu_packing
    compute.set_cpu_packing(None)


def test_packed_weights_only_in_inference_mode_on_large_fp32_or_native_bf16_weights():
    x = torch.zeros(2, 8)
    big, small = compute.MIN_PACKED, compute.MIN_PACKED - 1
    assert not compute.packs(x, big)  # training and no_grad forwards: F.linear
    with torch.inference_mode():
        assert compute.packs(x, big) and not compute.packs(x, small)
        bf16 = x.bfloat16()
        assert compute.packs(bf16, big) == compute.cpu_kernels().native_bf16
        assert not compute.packs(x.half(), big)


def test_a_torch_build_whose_onednn_cannot_pack_keeps_f_linear(packing, monkeypatch):
    monkeypatch.setattr(compute, "_packs_dtype", lambda dtype: False)
    packing(True)
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    with torch.inference_mode():
        assert not compute.packs(x, w.numel())
        assert torch.equal(compute.linear(x, w), F.linear(x, w)) and not hasattr(w, compute._KEPT)
    assert "weights not packed" in compute.cpu_kernels().describe()


def test_packed_linear_matches_f_linear_and_is_kept_until_the_weight_changes(packing):
    packing(True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=gen)
    w = torch.nn.Parameter(torch.randn(48, 64, generator=gen), requires_grad=False)
    b = torch.randn(48, generator=gen)
    with torch.inference_mode():
        y = compute.linear(x, w, b)
        first = compute.packed(w)
        assert compute.packed(w) is first  # kept, not packed again
    assert y.shape == (2, 5, 48)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        w.mul_(-1.0)  # an in-place write bumps the version
    with torch.inference_mode():
        assert compute.packed(w) is not first
        torch.testing.assert_close(compute.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        kept = compute.packed(w)
    w.data.fill_(0.5)  # a write the version counter cannot see: the swap's caller drops the copies
    drop_kept_copies([w])
    with torch.inference_mode():
        assert compute.packed(w) is not kept
        torch.testing.assert_close(compute.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_packed_bf16_linear_equals_the_native_kernel(packing):
    if not compute.cpu_kernels().native_bf16:
        pytest.skip("this CPU has no native bf16 kernels: bf16 weights are never packed here")
    packing(True)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 512, generator=gen).bfloat16(), torch.randn(896, 512, generator=gen).bfloat16()
    with torch.inference_mode():
        assert torch.equal(compute.linear(x, w), F.linear(x, w))


@pytest.fixture
def blocked_rule():
    yield compute.set_cpu_blocked_attention
    compute.set_cpu_blocked_attention(None)


def _qkv(T: int = 16, dtype: torch.dtype = torch.bfloat16, grad: bool = True):
    q = torch.randn(2, 4, T, 8).to(dtype).requires_grad_(grad)
    k = torch.randn(2, 2, T, 8).to(dtype).requires_grad_(grad)
    return q, k, k.detach().clone().requires_grad_(grad)


def test_avx512_bf16_training_attention_takes_the_blocked_matmuls(avx512_bf16, blocked_rule):
    causal = {"is_causal": True, "enable_gqa": True}
    q, k, v = _qkv()
    assert compute.blocked_attention(q, k, v, causal)
    assert compute.blocked_attention(q, k, v, causal | {"scale": 0.5})
    assert not compute.blocked_attention(q, k, v, {"enable_gqa": True})  # not causal
    assert not compute.blocked_attention(q, k, v, causal | {"attn_mask": None})
    assert not compute.blocked_attention(q, k[:, :, :8], v[:, :, :8], causal)  # queries after a prefix
    with torch.no_grad():  # the engine's prefill, a logprob pass: the flash kernel
        assert not compute.blocked_attention(q, k, v, causal)
    assert not compute.blocked_attention(*_qkv(grad=False), causal)
    assert not compute.blocked_attention(*_qkv(dtype=torch.float32), causal)
    long = _qkv(T=compute.MAX_BLOCKED_LEN + 1)
    assert not compute.blocked_attention(*long, causal)
    blocked_rule(False)
    assert not compute.blocked_attention(q, k, v, causal)
    blocked_rule(True)
    assert compute.blocked_attention(*_qkv(dtype=torch.float32, grad=False), causal)


def test_amx_and_avx2_keep_the_flash_kernel(monkeypatch, forced):
    q, k, v = _qkv()
    causal = {"is_causal": True, "enable_gqa": True}
    amx = compute.CpuKernels(isa="AVX512 AVX512_BF16 AMX", native_bf16=True, amx=True)
    monkeypatch.setattr(compute, "cpu_kernels", lambda: amx)
    forced(False)
    assert not compute.blocked_attention(q, k, v, causal)
    forced(True)  # no native bf16: attention in fp32
    assert not compute.blocked_attention(q, k, v, causal)


def test_sdpa_routes_to_the_blocked_matmuls_when_chosen(blocked_rule):
    from asyncrl.model.blocked_attention import blocked_causal_attention

    q, k, v = _qkv(T=24, dtype=torch.float32)
    blocked_rule(True)
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, blocked_causal_attention(q, k, v))
    out.sum().backward()
    assert q.grad is not None and "Blocked" in type(out.grad_fn).__name__
    blocked_rule(False)
    assert "Blocked" not in type(sdpa(q, k, v, is_causal=True, enable_gqa=True).grad_fn).__name__

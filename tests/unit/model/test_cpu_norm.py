"""The CPU RMSNorm kernel (asyncrl.model.cpu_norm): forward and backward against torch's composition
and fp64, in fp32 and bf16, on widths that are not multiples of a vector; which calls it takes; the
same results from one thread or two; a model's gradients with and without it; torch's ops when it
cannot be built."""

import copy
import shutil

import pytest
import torch

from asyncrl.model import cpu_norm, preset_args
from asyncrl.model.layers import RMSNorm, torch_rms_norm
from asyncrl.model.transformer import Transformer

HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
SHAPES = [(1, 37), (3, 7, 48), (130, 512), (2, 5, 4, 72)]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not HAS_CC:
        pytest.skip("no C compiler on PATH: RMSNorm runs torch's ops (tested below)")
    lib, note = cpu_norm.load()
    assert lib is not None, note
    assert note == "RMSNorm C kernel"


def _case(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(*shape, generator=g)
    w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    grad = torch.randn(*shape, generator=g)
    return x.to(dtype), w.to(dtype), grad.to(dtype)


def _run(fn, x, w, grad) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, input grad, weight grad) of `fn(x, w)` backpropagating `grad`."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


def _kernel(x, w):
    assert cpu_norm.takes(x, w)
    return cpu_norm.rms_norm(x, w, 1e-6)


def _torch(x, w):
    return torch_rms_norm(x, w, 1e-6)


def _fp64(x, w):
    x64, w64 = x.double(), w.double()
    return w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_torch_and_fp64(shape):
    x, w, grad = _case(shape, torch.float32)
    got, want = _run(_kernel, x, w, grad), _run(_torch, x, w, grad)
    exact = _run(_fp64, x.double(), w.double(), grad.double())
    for a, b, ref in zip(got, want, exact, strict=True):
        assert _rel(a, b) < 1e-6
        assert _rel(a, ref) < 1e-6


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_rounds_where_torch_rounds(shape):
    x, w, grad = _case(shape, torch.bfloat16)
    (y, dx, dw), (y_t, dx_t, dw_t) = _run(_kernel, x, w, grad), _run(_torch, x, w, grad)
    # Output and input gradient: torch's bf16 values, but for a sum order that can move a value
    # across a rounding boundary (one bf16 step).
    for a, b in ((y, y_t), (dx, dx_t)):
        assert (a == b).float().mean() >= 0.995
        assert ((a.float() - b.float()).abs() <= b.float().abs() * 2**-7 + 1e-6).all()
    # Weight gradient: torch rounds each product to bf16 before the sum; the kernel sums in fp32, so
    # it is no further from fp64 than torch's.
    dw64 = _run(_fp64, x.double(), w.double(), grad.double())[2]
    assert _rel(dw, dw64) <= _rel(dw_t, dw64) + 1e-3


def test_non_contiguous_input_equals_contiguous():
    x, w, grad = _case((6, 4, 64), torch.bfloat16)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, strided
    assert not xt.is_contiguous()
    for got, want in zip(_run(_kernel, xt, w, grad), _run(_kernel, x, w, grad), strict=True):
        assert torch.equal(got, want)


def test_one_thread_or_two_give_the_same_values():
    x, w, grad = _case((401, 96), torch.float32)  # past the kernel's PARALLEL_MIN values
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(_kernel, x, w, grad)
        torch.set_num_threads(2)
        two = _run(_kernel, x, w, grad)
        again = _run(_kernel, x, w, grad)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])  # rows are independent
    assert _rel(two[2], one[2]) < 1e-6  # the weight gradient sums per-thread parts
    for a, b in zip(two, again, strict=True):
        assert torch.equal(a, b)


def test_no_grad_forward_equals_the_autograd_forward():
    x, w, _ = _case((3, 7, 48), torch.bfloat16)
    with torch.inference_mode():
        plain = cpu_norm.rms_norm(x, w, 1e-6)
    assert torch.equal(plain, cpu_norm.rms_norm(x, w.clone().requires_grad_(), 1e-6).detach())


def test_takes_only_plain_cpu_tensors_of_its_dtypes():
    x, w, _ = _case((4, 16), torch.float32)
    assert cpu_norm.takes(x, w) and cpu_norm.takes(x.bfloat16(), w.bfloat16())
    assert not cpu_norm.takes(x.half(), w.half())
    assert not cpu_norm.takes(x.double(), w.double())
    assert not cpu_norm.takes(x.bfloat16(), w)  # the weight in another dtype
    assert not cpu_norm.takes(x.to("meta"), w.to("meta"))
    assert not cpu_norm.takes(x, w[:8])
    assert not cpu_norm.takes(x[:0], w)
    cpu_norm.set_enabled(False)
    try:
        assert not cpu_norm.takes(x, w)
        assert cpu_norm.note() == "RMSNorm torch (kernel turned off)"
    finally:
        cpu_norm.set_enabled(True)


def test_rmsnorm_module_takes_the_kernel():
    norm = RMSNorm(48).bfloat16()
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16, requires_grad=True)
    assert type(norm(x).grad_fn).__name__ == "_RMSNormBackward"
    cpu_norm.set_enabled(False)
    try:
        assert type(norm(x).grad_fn).__name__ != "_RMSNormBackward"
    finally:
        cpu_norm.set_enabled(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_gradients_with_and_without_the_kernel(dtype):
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(seed=0)
    model = model.to(dtype)
    ids = torch.randint(0, model.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    def grads(enabled: bool) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(model)
        cpu_norm.set_enabled(enabled)
        try:
            m(ids).logits.float().pow(2).mean().backward()
        finally:
            cpu_norm.set_enabled(True)
        return {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    got, want = grads(True), grads(False)
    assert got.keys() == want.keys() and any("norm" in n for n in got)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for name in want:
        assert _rel(got[name], want[name]) < tol, name


def test_no_compiler_means_torchs_ops_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCRL_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", "no-such-compiler-asyncrl")
    cpu_norm.load.cache_clear()
    try:
        lib, note = cpu_norm.load()
        assert lib is None
        assert note == "RMSNorm torch (CC='no-such-compiler-asyncrl' not found)"
        assert cpu_norm.note() == note
        x, w, _ = _case((3, 16), torch.float32)
        assert not cpu_norm.takes(x, w)
        norm = RMSNorm(16)
        with torch.no_grad():
            norm.weight.copy_(w)
        y = norm(x.requires_grad_())
        assert type(y.grad_fn).__name__ != "_RMSNormBackward"
        assert torch.equal(y, torch_rms_norm(x, w, 1e-6))
    finally:
        cpu_norm.load.cache_clear()


def test_first_load_inside_a_checkpointed_forward():
    # Activation checkpointing counts the tensors autograd saves in the forward and again in the
    # recomputation: loading the kernel (and checking it) on the first call must save none.
    from torch.utils.checkpoint import checkpoint

    norm = RMSNorm(32)
    x, _, grad = _case((2, 4, 32), torch.float32)
    x.requires_grad_()
    cpu_norm.load.cache_clear()  # the library stays built on disk: this loads and checks it again
    y = checkpoint(norm, x, use_reentrant=False)
    y.backward(grad)
    want = _run(lambda a, b: torch_rms_norm(a, b, norm.eps), x.detach(), norm.weight.detach(), grad)
    assert _rel(x.grad, want[1]) < 1e-6 and _rel(norm.weight.grad, want[2]) < 1e-6

"""RMSNorm on CPUs: a small C kernel (cpu_norm.c) for the forward and the backward.

Under autograd, torch runs `RMSNorm` as about a dozen elementwise ops and their backwards, each a
pass over the activations into a fresh tensor: on the moe-57m-16e model's bf16 training step (4 x 512
tokens, one thread, AVX-512 BF16) the norms (17 of [2048, 512], 16 per-head q/k norms) took ~14% of
the step. The kernel reads a row once forward and once backward. Outside autograd (the engine) it
replaces torch's fused `rms_norm` and the scale by the weight, 3-4x faster at decode sizes. Figures:
BENCHMARKS.md, "Model".

It computes in fp32 and rounds a bf16 value wherever torch's composition rounds one (cpu_norm.c), so
its results equal torch's up to the order of the sums. The trainer and the engine both take it, so
an fp32 run still computes the same norms in both. `asyncrl.cpu_build` builds it on first use, once
per compiler and CPU; loading it checks it against the formulas in fp64 on small random rows. Where
it cannot run (no C compiler, a failed build or check), RMSNorm keeps torch's ops
(`layers.torch_rms_norm`), and `note()` says why. `set_enabled(False)` turns it off (tests,
benchmarks).

Shape legend: R rows (every dim but the last), D normalised dim.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from asyncrl.cpu_build import load_checked

__all__ = ["load", "note", "rms_norm", "set_enabled", "takes"]

_SOURCE = Path(__file__).with_name("cpu_norm.c")
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_PLAIN = (torch.Tensor, nn.Parameter)  # not DTensor or other subclasses
_enabled = True


class _Library:
    """The C functions of cpu_norm.c per dtype."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self.fwd, self.bwd = {}, {}
        for dtype, suffix in _DTYPES.items():
            fwd = getattr(lib, f"asyncrl_rms_norm_fwd_{suffix}")
            fwd.argtypes, fwd.restype = [ptr] * 4 + [i64, i64, f32], None
            bwd = getattr(lib, f"asyncrl_rms_norm_bwd_{suffix}")
            bwd.argtypes, bwd.restype = [ptr] * 7 + [i64] * 3, None
            self.fwd[dtype], self.bwd[dtype] = fwd, bwd


@functools.cache
def load() -> tuple[_Library | None, str]:
    """The kernel library (None: not available) and a one-line note of why; once per process."""
    lib, why = load_checked(_SOURCE, "CPU RMSNorm kernel", _checked)
    return lib, "RMSNorm C kernel" if lib is not None else f"RMSNorm torch ({why})"


def _checked(cdll: ctypes.CDLL) -> _Library:
    lib = _Library(cdll)
    _self_check(lib)
    return lib


def note() -> str:
    """How RMSNorm runs on this CPU, for a start-up line."""
    if not _enabled:
        return "RMSNorm torch (kernel turned off)"
    return load()[1]


def set_enabled(value: bool) -> None:
    """Turn the kernel on (the default, where it loads) or off."""
    global _enabled
    _enabled = value


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` computes this call: plain CPU tensors of one kernel dtype, kernel loaded."""
    return (
        _enabled
        and x.device.type == "cpu"
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and type(x) in _PLAIN
        and type(weight) in _PLAIN
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
        and x.numel() > 0
        and load()[0] is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * norm(x)` over the last dim, differentiable in both under autograd (call where
    `takes`)."""
    lib = load()[0]
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, lib)
    return _forward(lib, x.contiguous(), weight.contiguous(), eps)[0]


def _forward(
    lib: _Library, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and each row's 1 / rms (fp32), of contiguous `x` and `weight`."""
    D = x.shape[-1]
    R = x.numel() // D
    y = torch.empty_like(x)
    rstd_R = torch.empty(R, dtype=torch.float32)
    lib.fwd[x.dtype](x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd_R.data_ptr(), R, D, eps)
    return y, rstd_R


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, lib: _Library) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        y, rstd_R = _forward(lib, x, weight, eps)
        ctx.save_for_backward(x, weight, rstd_R)
        ctx.lib = lib
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight, rstd_R = ctx.saved_tensors
        dx, dw = _backward(ctx.lib, g.contiguous(), x, weight, rstd_R)
        return dx, dw.to(weight.dtype), None, None


def _backward(
    lib: _Library, g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input's gradient and the weight's (fp32), of contiguous tensors."""
    D = x.shape[-1]
    R = x.numel() // D
    threads = torch.get_num_threads()
    dx = torch.empty_like(x)
    dw_part = torch.zeros(threads, D, dtype=torch.float64)
    dw = torch.empty(D, dtype=torch.float32)
    ptrs = (g, x, weight, rstd_R, dx, dw_part, dw)
    lib.bwd[x.dtype](*(t.data_ptr() for t in ptrs), threads, R, D)
    return dx, dw


@torch.no_grad()
def _self_check(lib: _Library) -> None:
    """Forward and backward against the formulas in fp64 on rows of a width that is not a multiple
    of the vector length, in both dtypes. No autograd: a first call can come inside a forward under
    activation checkpointing, which counts the tensors autograd saves."""
    g = torch.Generator().manual_seed(0)
    R, D, eps = 5, 37, 1e-6
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        x, w, grad = (
            t.to(dtype)
            for t in (
                torch.randn(R, D, generator=g),
                1 + 0.1 * torch.randn(D, generator=g),
                torch.randn(R, D, generator=g),
            )
        )
        y, rstd_R = _forward(lib, x, w, eps)
        dx, dw = _backward(lib, grad, x, w, rstd_R)
        x64, w64, g64 = x.double(), w.double(), grad.double()
        r64 = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
        xh, gn = x64 * r64, g64 * w64
        want = (w64 * xh, r64 * (gn - xh * (gn * xh).mean(-1, keepdim=True)), (g64 * xh).sum(0))
        for name, a, b in zip(("output", "input grad", "weight grad"), (y, dx, dw), want, strict=True):
            err = ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
            if not err <= tol:
                raise RuntimeError(f"self-check: {dtype} {name} differs from fp64 by {err:.2e} (> {tol})")

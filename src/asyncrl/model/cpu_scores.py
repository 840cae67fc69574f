"""fp32 attention scores of bf16 values on CPUs with AVX-512 BF16: a small C kernel (cpu_scores.c)
for `asyncrl.model.blocked_attention`.

The blocked attention takes its scores (q.k) and, in the backward, dP (dO.v) from fp32 matmuls of
its bf16 inputs, so that they are not rounded to bf16 as a bf16 matmul's output is. oneDNN's fp32
matmul runs at ~1/3 of its bf16 rate on such a CPU (head dim 64: 1.8 ms against 0.7 ms for
16 x [128 x 64] @ [64 x 512]) and needs fp32 copies of the operands; these two products were about
a third of the blocked attention's time. The kernel multiplies the bf16 values with the CPU's bf16
dot product (exact products, fp32 sums) and writes fp32: the fp32 matmul's result up to the order of
the sums, at the bf16 rate, from a bf16 copy of the keys (or values) packed in pairs along the head
dim.

`asyncrl.cpu_build` builds it on first use, once per compiler and CPU; loading it checks it against
fp64 on a small case. Where it cannot run (no compiler, no AVX-512 BF16, a failed build or check),
the blocked attention keeps the fp32 matmuls, and `note()` says why. `set_enabled(False)` turns it
off (tests, benchmarks).

Shape legend: X batch (B x kv groups), M rows (query positions x heads per group), N keys, k head dim.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from asyncrl.cpu_build import Unavailable, load_checked

__all__ = ["available", "load", "note", "pack", "scores", "set_enabled", "supports"]

_SOURCE = Path(__file__).with_name("cpu_scores.c")
_enabled = True


class _Library:
    """The C functions of cpu_scores.c."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        supported = lib.asyncrl_scores_supported
        supported.argtypes, supported.restype = [], ctypes.c_int
        if not supported():
            raise Unavailable("this CPU has no AVX-512 BF16")
        self.scores = lib.asyncrl_scores_bf16
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self.scores.argtypes = [ptr, i64, i64] * 3 + [i64] * 4 + [ctypes.c_float]
        self.scores.restype = None


@functools.cache
def load() -> tuple[_Library | None, str]:
    """The kernel library (None: not available) and a one-line note of why; once per process."""
    lib, why = load_checked(_SOURCE, "CPU attention-score kernel", _checked)
    return lib, "attention scores C kernel" if lib is not None else f"attention scores fp32 matmuls ({why})"


def note() -> str:
    """How the blocked attention's scores are computed on this CPU."""
    if not _enabled:
        return "attention scores fp32 matmuls (kernel turned off)"
    return load()[1]


def set_enabled(value: bool) -> None:
    """Turn the kernel on (the default, where it loads) or off."""
    global _enabled
    _enabled = value


def available() -> bool:
    """Whether `scores` runs here (enabled and loaded)."""
    return _enabled and load()[0] is not None


def pack(b_XNk: torch.Tensor) -> torch.Tensor:
    """bf16 [X, N, k] (k even, unit stride along k) -> [X, k/2, N, 2]: the kernel's layout, each pair
    of neighbours along k kept together (one 32-bit word)."""
    X, N, k = b_XNk.shape
    words = b_XNk.contiguous().view(torch.int32)  # [X, N, k/2]
    return words.transpose(1, 2).contiguous().view(torch.bfloat16).view(X, k // 2, N, 2)


def scores(a_XMk: torch.Tensor, packed: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """fp32 [X, M, n]: scale * a @ b[:, :n].T for `packed` = pack(b), b [X, N >= n, k]; `a` bf16 with
    unit stride along k (any row and batch strides)."""
    return _scores(load()[0], a_XMk, packed, n, scale)


def _scores(lib: _Library, a_XMk: torch.Tensor, packed: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    X, M, k = a_XMk.shape
    if a_XMk.stride(2) != 1:
        a_XMk = a_XMk.contiguous()
    out = torch.empty(X, M, n, dtype=torch.float32, device=a_XMk.device)
    lib.scores(
        a_XMk.data_ptr(),
        a_XMk.stride(0),
        a_XMk.stride(1),
        packed.data_ptr(),
        packed.stride(0),
        packed.stride(1),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        X,
        M,
        n,
        k,
        scale,
    )
    return out


def supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `scores` takes these operands (bf16 on a CPU, even head dims) and the kernel runs."""
    return (
        a.device.type == "cpu"
        and a.dtype == b.dtype == torch.bfloat16
        and a.shape[-1] % 2 == 0
        and b.shape[-1] % 2 == 0
        and available()
    )


def _checked(cdll: ctypes.CDLL) -> _Library:
    lib = _Library(cdll)
    g = torch.Generator().manual_seed(0)
    X, M, N, k, n, scale = 2, 11, 37, 6, 35, 0.3
    a = torch.randn(X, M, k, generator=g).bfloat16()
    b = torch.randn(X, N, k, generator=g).bfloat16()
    want = scale * a.double() @ b[:, :n].double().transpose(1, 2)
    out = _scores(lib, a, pack(b), n, scale)
    err = ((out.double() - want).abs().max() / want.abs().max()).item()
    if not err <= 1e-5:
        raise RuntimeError(f"self-check: scores differ from fp64 by {err:.2e} (> 1e-5)")
    return lib

"""Decode attention on CPUs: a small C kernel (cpu_decode.c), built with the system's C compiler on
first use, over the engine's dense decode rows or the blocks it gathers from the paged pool.

Each decode sequence has one query token. Torch's CPU flash kernel runs it as tiny matrix products
per (sequence, kv head) and over every position up to the step's widest context, masked; the
kernel reads each sequence's keys and values once, only up to its own length, and shares them
between the query heads of a kv group (scores and softmax in fp32; bf16 keys and values widened
exactly). It reads the queries where the model left them, scales them itself and writes the output
in the model's dtype, so a step pays no torch ops (casts, copies) for those. It runs on torch's own
OpenMP threads.

`asyncrl.cpu_build` builds the shared library once per source, compiler and CPU, where it
says. Loading it checks it against SDPA on a small random case. Anything that fails (no compiler,
a build error, a wrong result) leaves the engine on SDPA, and `load()`'s note says why; the
server's start-up line states which runs.

Shape legend: R decode rows, G kv heads, r query heads per kv head, W positions of the widest row,
Dh head dim.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncrl.cpu_build import BUILD_ERRORS, Unavailable, build

__all__ = ["KERNEL_DTYPES", "DecodeKernel", "KernelBuild", "load"]

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_SOURCE = Path(__file__).with_name("cpu_decode.c")


@dataclass(frozen=True)
class KernelBuild:
    """The loaded kernel (None: not available) and a one-line note of how it came to be."""

    kernel: DecodeKernel | None
    note: str


class DecodeKernel:
    """Callable over one layer's dense rows: `(q_RGrd, k_RGWd, v_RGWd, length_R) -> o_RGrd`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.asyncrl_decode_f32, torch.bfloat16: lib.asyncrl_decode_bf16}
        for fn in self._fns.values():
            fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_float] + [ctypes.c_int64] * 13
            fn.restype = ctypes.c_int

    @staticmethod
    def supports(k_RGWd: torch.Tensor) -> bool:
        """Whether the kernel takes these keys (else the caller runs SDPA)."""
        return k_RGWd.device.type == "cpu" and k_RGWd.dtype in KERNEL_DTYPES and k_RGWd.stride(3) == 1

    def __call__(
        self, q_RGrd: torch.Tensor, k_RGWd: torch.Tensor, v_RGWd: torch.Tensor, length_R: torch.Tensor
    ) -> torch.Tensor:
        """Attention of each row's r queries per kv head over that row's first `length_R[row]`
        positions of k and v (default softmax scale), in q's dtype (k's and v's too). q may be a strided
        view, as the decode rows' queries are: it is read in place where its head dim is contiguous."""
        R, G, r, dh = q_RGrd.shape
        W = k_RGWd.shape[2]
        if not (self.supports(k_RGWd) and v_RGWd.dtype == k_RGWd.dtype and v_RGWd.stride(3) == 1):
            raise ValueError("keys and values need one dtype of KERNEL_DTYPES and a contiguous head dim")
        if q_RGrd.dtype != k_RGWd.dtype:
            raise ValueError(f"queries in {q_RGrd.dtype} for keys in {k_RGWd.dtype}: they need one dtype")
        if k_RGWd.shape != (R, G, W, dh) or v_RGWd.shape != k_RGWd.shape:
            raise ValueError(
                f"shapes: q {tuple(q_RGrd.shape)}, k {tuple(k_RGWd.shape)}, v {tuple(v_RGWd.shape)}"
            )
        if length_R.dtype != torch.int64 or not length_R.is_contiguous() or length_R.shape != (R,):
            raise ValueError(
                f"length_R must be a contiguous int64 [{R}], got {length_R.dtype} {tuple(length_R.shape)}"
            )
        if R and not (int(length_R.min()) >= 1 and int(length_R.max()) <= W):
            raise ValueError(f"row lengths must lie in [1, {W}] (the keys' positions)")
        q = q_RGrd if q_RGrd.stride(3) == 1 else q_RGrd.contiguous()
        out = torch.empty(R, G, r, dh, dtype=q.dtype)
        qs, ks, vs = q.stride(), k_RGWd.stride(), v_RGWd.stride()
        code = self._fns[k_RGWd.dtype](
            q.data_ptr(), k_RGWd.data_ptr(), v_RGWd.data_ptr(), length_R.data_ptr(), out.data_ptr(),
            dh**-0.5, R, G, r, dh, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        )  # fmt: skip
        if code:
            raise MemoryError(
                f"decode kernel: no memory for its scratch ({r} x {int(length_R.max())} floats)"
            )
        return out


@functools.cache
def load() -> KernelBuild:
    """Build (or find built) and load the kernel, once per process."""
    try:
        path = build(_SOURCE, "CPU decode kernel")
        kernel = DecodeKernel(ctypes.CDLL(str(path)))
        _self_check(kernel)
    except Unavailable as e:
        log.info("CPU decode kernel not used: %s", e)
        return KernelBuild(None, f"decode attention SDPA ({e})")
    except BUILD_ERRORS as e:
        log.warning("CPU decode kernel not used (SDPA instead): %s", e)
        return KernelBuild(None, f"decode attention SDPA (kernel failed: {e})")
    return KernelBuild(kernel, "decode attention C kernel")


def _self_check(kernel: DecodeKernel) -> None:
    """The kernel against SDPA on a small case with unequal lengths, in both dtypes."""
    g = torch.Generator().manual_seed(0)
    R, G, r, dh, W = 3, 2, 2, 16, 37
    length_R = torch.tensor([37, 1, 20])
    keep = (torch.arange(W)[None, :] < length_R[:, None])[:, None, None, :]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, k, v = (torch.randn(R, G, n, dh, generator=g).to(dtype) for n in (r, W, W))
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep)
        got = kernel(q, k, v, length_R).float()
        err = (got - want).abs().max().item()
        if not err <= tol:
            raise RuntimeError(f"self-check: {dtype} output differs from SDPA by {err:.2e} (> {tol})")

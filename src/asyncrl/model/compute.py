"""Matmul-heavy ops (linear, attention) that stay fast in bf16/fp16 on CPUs without native kernels.

On a CPU without AVX-512 BF16 / AMX (oneDNN reports no bf16 support), torch's bf16 matmul and
attention fall back to scalar reference loops: on an AVX2 machine a bf16 1024^3 matmul runs ~100x
slower than fp32, so a bf16 model trains and decodes ~15-20x slower than the same model in fp32.
There these ops cast their low-precision operands to fp32, compute, and round the result back to
the input's dtype. Products of bf16 numbers are exact in fp32 and the native kernels accumulate in
fp32 too, so the result is what a native bf16 kernel gives up to summation order; weights and
activations stay in bf16 between ops (memory and the numerics of everything else unchanged).
On CUDA and on CPUs with native bf16 nothing changes.

    from asyncrl.model.compute import Linear, linear, sdpa
    y = linear(x, w)               # F.linear, upcast where the CPU lacks native kernels for x.dtype
    o = sdpa(q, k, v, is_causal=True)

The MoE experts (asyncrl.model.moe.grouped_swiglu) ask `cpu_upcast` and run their SwiGLU in fp32.

Under `torch.inference_mode()` (the embedded engine's steps) the fp32 copy of a weight is kept
(`as_fp32`) rather than made again on every call: decoding a small batch would otherwise spend as
long casting the weights as multiplying by them. That costs an fp32 copy of the weights in memory,
on these CPUs only; training (autograd through the cast) never keeps one. A kept copy is used only
while the weight still reads the very storage it was made from (held by a weak reference, so a new
tensor that the allocator puts at a freed address never matches), at the same offset, shape and
stride, with an unchanged version counter. Writes a version counter cannot see (through another
alias of the storage, or to an inference tensor) must call `drop_fp32_copies`; `hf.load_into`, the
engine's weight swap, does so for every tensor it sets.

`set_cpu_upcast(True | False | None)` forces the choice (None: detect), for tests and benchmarks.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "as_fp32", "cpu_upcast", "drop_fp32_copies", "linear", "sdpa", "set_cpu_upcast"]

_FORCED: bool | None = None


@functools.cache
def _cpu_native(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def set_cpu_upcast(value: bool | None) -> None:
    """Force (True/False) or restore detection (None) of the fp32 path for low-precision CPU ops."""
    global _FORCED
    _FORCED = value


def cpu_upcast(x: torch.Tensor) -> bool:
    """Whether ops on `x` take the fp32 path: a bf16/fp16 CPU tensor without native kernels."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return _FORCED if _FORCED is not None else not _cpu_native(x.dtype)


_KEPT = "_asyncrl_fp32"


def _version(w: torch.Tensor) -> int:
    try:
        return w._version
    except RuntimeError:  # an inference tensor: no version counter, written only by a swap
        return -1


def _source_key(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), tuple(w.shape), w.stride(), _version(w))


def as_fp32(w: torch.Tensor) -> torch.Tensor:
    """`w.float()`; kept from call to call under inference mode while `w` is unchanged."""
    if w.dtype == torch.float32 or not torch.is_inference_mode_enabled():
        return w.float()
    storage, key = w.untyped_storage(), _source_key(w)
    hit = getattr(w, _KEPT, None)  # (weak ref to the source storage, key, the fp32 copy), on the weight
    if hit is not None and hit[0]() is storage and hit[1] == key:
        return hit[2]
    out = w.float()
    setattr(w, _KEPT, (weakref.ref(storage), key, out))
    return out


def drop_fp32_copies(tensors: Iterable[torch.Tensor]) -> None:
    """Forget the fp32 copies `as_fp32` keeps of `tensors`, and free them now."""
    for w in tensors:
        if hasattr(w, _KEPT):
            delattr(w, _KEPT)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b); in fp32 and rounded back to x's dtype where `cpu_upcast(x)`."""
    if not cpu_upcast(x):
        return F.linear(x, w, b)
    return F.linear(x.float(), as_fp32(w), None if b is None else as_fp32(b)).to(x.dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention; in fp32 where `cpu_upcast(q)` (a float mask is upcast too)."""
    if not cpu_upcast(q):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kw["attn_mask"] = mask.float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)


class Linear(nn.Linear):
    """nn.Linear through `linear`: same parameters and state-dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

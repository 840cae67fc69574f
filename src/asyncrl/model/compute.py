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
alias of the storage, or to an inference tensor) must call `drop_kept_copies`; `hf.load_into`, the
engine's weight swap, does so for every tensor it sets.

On a CPU with native bf16 (AVX-512 BF16, AMX) the choice is made per op from the CPU's
capabilities, once (`cpu_kernels()`), because native is not always faster there:

- linear: native for weights of at least `MIN_NATIVE_LINEAR` elements; smaller ones outside
  autograd (a small model's q/k/v/o projections in the engine's steps) take the fp32 path on kept
  fp32 copies: oneDNN's bf16 call costs ~2x sgemm's there when the caches are cold, as they are
  between the layers of a decode step (64 x 128 by 128 x 128: ~118 against ~65 us); a 260 x 128
  lm_head is already faster native. The copies are at most `MIN_NATIVE_LINEAR` elements each. (The
  engine's CPU matmul kernel, where it takes a call, computes these in bf16 instead: a linear
  rounds once either way; asyncrl.inference.cpu_matmul.)
- the MoE experts: in the engine's steps (no autograd), on packed copies of their weights from
  `MIN_PACKED` weights per matrix (below); smaller ones as one padded batched matmul per projection
  over all experts, natively (asyncrl.model.moe), while padding at most doubles the rows. Otherwise
  torch's grouped GEMM: native on AMX, under autograd (training), and for experts of at
  least `MIN_NATIVE_EXPERT` weights per matrix elsewhere. Below that size without autograd (the
  engine's steps whose routing is too skewed for the padded batch: tiny experts, a few rows each),
  oneDNN's per-call bf16 overhead exceeds the matmul, and the fp32 path on the kept fp32 weights is
  ~2x faster. Training runs torch's grouped GEMM in
  bf16 instead (asyncrl.model.moe): it pays that overhead once per layer rather than once per
  expert, and its forward+backward of 128 x 128 experts is ~1.7x faster than the fp32 path.
- attention: native (torch's flash kernel reads the engine's strided K/V views as they are; an fp32
  path would copy them), except causal self-attention under autograd (training) up to
  `MAX_BLOCKED_LEN` positions and `MAX_BLOCKED_SCORES` scores (B x H x T^2) per call: it goes through
  `asyncrl.model.blocked_attention`, batched matmuls over blocks of queries, because torch's flash
  kernel runs bf16 no faster than fp32 there while oneDNN's bf16 matmuls run ~2x faster
  (BENCHMARKS.md, "Training attention (CPU bf16)"; docs/trainer.md, "bf16 on CPU"). Inference (no
  autograd: the engine's prefill, logprob passes) keeps the flash kernel: the forward alone gains
  less, and the engine's steps have not been measured with it.
  `set_cpu_blocked_attention(True | False | None)` forces the choice.

`set_cpu_upcast(True | False | None)` forces the choice (None: detect), for tests and benchmarks:
True takes the fp32 path everywhere, False the native kernels everywhere.
`cpu_kernels().describe()` is the line a server prints at start.

Packed weights (any CPU with oneDNN, fp32 or native bf16, under inference mode): `F.linear` and
torch's batched matmuls rearrange the weight into the kernel's blocked layout on every call, a
large share of the call when a decode step gives a matmul a few rows (an MoE expert's share of 64
tokens). `linear` and the MoE experts use instead a packed copy (`packed`: made once by `pack`,
kept like the fp32 copies by `kept`) of each weight of at least `MIN_PACKED` elements (figures in
docs/inference.md, Performance). Smaller weights lose more to oneDNN's cost per call than they
win. Packed copies take as much memory again as their weights; fp32 results differ from sgemm's by
summation order. `set_cpu_packing(True | False | None)` forces the choice (None: the size rule).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model.blocked_attention import blocked_causal_attention

__all__ = [
    "MAX_BLOCKED_LEN",
    "MAX_BLOCKED_SCORES",
    "MIN_NATIVE_EXPERT",
    "MIN_NATIVE_LINEAR",
    "MIN_PACKED",
    "CpuKernels",
    "Linear",
    "as_fp32",
    "cpu_kernels",
    "cpu_upcast",
    "drop_kept_copies",
    "kept",
    "linear",
    "pack",
    "packed",
    "packed_linear",
    "packing_note",
    "packs",
    "sdpa",
    "set_cpu_blocked_attention",
    "set_cpu_packing",
    "set_cpu_upcast",
]

_FORCED: bool | None = None
# Elements of one expert matrix from which native bf16 beats the fp32 path without AMX (measured on
# AVX-512 BF16: 128 x 128 experts ~2x faster in fp32, 448 x 512 ~2x faster native).
MIN_NATIVE_EXPERT = 65536
# Elements of a linear weight from which native bf16 beats the fp32 path outside autograd without AMX.
MIN_NATIVE_LINEAR = 32768
# Elements of a weight from which a matmul on oneDNN's packed copy of it pays in inference.
MIN_PACKED = 65536
# The rows oneDNN is told to expect when it packs a weight (its layout barely depends on it).
_PACK_ROWS = 64
_PACK_FORCED: bool | None = None
# Causal self-attention under autograd on native bf16 without AMX takes asyncrl.model.blocked_attention
# up to this length (past it the gain fades: ~1.05x the flash kernel at 2048 positions of one row,
# while the backward's memory grows with T^2) and this many scores per call (its backward keeps
# about half of them in fp32: 64 MiB at the limit).
MAX_BLOCKED_LEN = 1024
MAX_BLOCKED_SCORES = 1 << 25
_BLOCKED_FORCED: bool | None = None


@dataclass(frozen=True, kw_only=True)
class CpuKernels:
    """Which low-precision kernels this CPU runs natively, and so how bf16 ops run on it.

    Example::

        CpuKernels(isa="AVX512 AVX512_BF16", native_bf16=True, amx=False)
    """

    isa: str  # torch's CPU capability, and AVX512_BF16 / AMX where present
    native_bf16: bool  # oneDNN has bf16 kernels (AVX-512 BF16 or AMX)
    amx: bool

    def native_experts(self, weight_numel: int, *, autograd: bool = False) -> bool:
        """Whether bf16 MoE experts of `weight_numel` weights per matrix run native kernels."""
        return self.native_bf16 and (self.amx or autograd or weight_numel >= MIN_NATIVE_EXPERT)

    def native_linear(self, weight_numel: int, *, autograd: bool = False) -> bool:
        """Whether a bf16 linear over a weight of `weight_numel` elements runs the native kernel."""
        return self.native_bf16 and (self.amx or autograd or weight_numel >= MIN_NATIVE_LINEAR)

    def describe(self) -> str:
        """One line: the ISA, where the engine's bf16 ops go native or through fp32, and which weights
        it packs."""
        return f"{self._bf16()}; {packing_note()}"

    def _bf16(self) -> str:
        if not self.native_bf16:
            return f"CPU {self.isa}: no native bf16, bf16 matmuls and attention computed in fp32"
        if self.amx:
            return f"CPU {self.isa}: bf16 linear, attention and MoE experts native"
        return (
            f"CPU {self.isa}: bf16 attention native (training's causal attention from blocked bf16 "
            f"matmuls), linear native from {MIN_NATIVE_LINEAR} weights "
            f"(fp32 below, inference only), MoE experts batched natively in inference, else native from "
            f"{MIN_NATIVE_EXPERT} weights per expert (fp32 below)"
        )


def packing_note() -> str:
    """Which weights the engine's steps use packed copies of (the start-up line's part)."""
    if _PACK_FORCED is False:
        return "weights not packed (cpu_packed_weights = false)"
    if not _packs_dtype(torch.float32):
        return "weights not packed (no oneDNN packing in this torch build)"
    return f"weights of {MIN_PACKED}+ elements packed for oneDNN in inference"


@functools.cache
def cpu_kernels() -> CpuKernels:
    """This CPU's kernels, detected once."""
    amx = torch.cpu._is_amx_tile_supported()
    flags = [torch.backends.cpu.get_cpu_capability()]
    flags += ["AVX512_BF16"] * torch.cpu._is_avx512_bf16_supported() + ["AMX"] * amx
    return CpuKernels(isa=" ".join(flags), native_bf16=_cpu_native(torch.bfloat16), amx=amx)


@functools.cache
def _cpu_native(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def set_cpu_upcast(value: bool | None) -> None:
    """Force (True/False) or restore detection (None) of the fp32 path for low-precision CPU ops."""
    global _FORCED
    _FORCED = value


def cpu_upcast(x: torch.Tensor, expert_numel: int | None = None, linear_numel: int | None = None) -> bool:
    """Whether ops on `x` take the fp32 path: a bf16/fp16 CPU tensor without native kernels, or,
    outside autograd, MoE experts (`expert_numel`: the size of one expert matrix) or a linear
    (`linear_numel`: its weight's size) too small for them."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if _FORCED is not None:
        return _FORCED
    if not _cpu_native(x.dtype):
        return True
    if x.dtype != torch.bfloat16:
        return False
    kernels, autograd = cpu_kernels(), torch.is_grad_enabled()
    if expert_numel is not None:
        return not kernels.native_experts(expert_numel, autograd=autograd)
    return linear_numel is not None and not kernels.native_linear(linear_numel, autograd=autograd)


_KEPT = "_asyncrl_kept"  # on a weight: {kind: (weak refs to the sources' storages, their keys, value)}


def _version(w: torch.Tensor) -> int:
    try:
        return w._version
    except RuntimeError:  # an inference tensor: no version counter, written only by a swap
        return -1


def _source_key(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), tuple(w.shape), w.stride(), _version(w))


def kept(kind: str, make: Callable[[], object], w: torch.Tensor, *more: torch.Tensor) -> object:
    """`make()`, kept on `w` under the name `kind` from call to call while `w` and `more` read the
    very storages, offsets, shapes, strides and versions they had when it was made."""
    sources = (w, *more)
    storages = [t.untyped_storage() for t in sources]
    key = tuple(_source_key(t) for t in sources)
    slots = getattr(w, _KEPT, None)
    if slots is None:
        slots = {}
        setattr(w, _KEPT, slots)
    hit = slots.get(kind)
    if hit is not None and hit[1] == key and all(r() is s for r, s in zip(hit[0], storages, strict=True)):
        return hit[2]
    out = make()
    slots[kind] = (tuple(weakref.ref(s) for s in storages), key, out)
    return out


def as_fp32(w: torch.Tensor) -> torch.Tensor:
    """`w.float()`; kept from call to call under inference mode while `w` is unchanged."""
    if w.dtype == torch.float32 or not torch.is_inference_mode_enabled():
        return w.float()
    return kept("fp32", w.float, w)  # type: ignore[return-value]


def drop_kept_copies(tensors: Iterable[torch.Tensor]) -> None:
    """Forget what is kept for `tensors` (fp32 copies, packed weights), and free it now."""
    for w in tensors:
        if hasattr(w, _KEPT):
            delattr(w, _KEPT)


def set_cpu_packing(value: bool | None) -> None:
    """Force (True/False) or restore the size rule (None) for packed weights in inference."""
    global _PACK_FORCED
    _PACK_FORCED = value


def packs(x: torch.Tensor, weight_numel: int) -> bool:
    """Whether a matmul of `x` by a weight of `weight_numel` elements runs on a packed copy of the
    weight: on a CPU with oneDNN, under inference mode, for weights of at least `MIN_PACKED`
    elements, in fp32 or native bf16."""
    if x.device.type != "cpu" or not torch.is_inference_mode_enabled() or type(x) is not torch.Tensor:
        return False  # tensor subclasses (DTensor, FP8 wrappers) keep their own path
    if x.dtype != torch.float32 and (x.dtype != torch.bfloat16 or not _cpu_native(x.dtype)):
        return False
    wanted = _PACK_FORCED if _PACK_FORCED is not None else weight_numel >= MIN_PACKED
    return wanted and _packs_dtype(x.dtype)


@functools.cache
def _packs_dtype(dtype: torch.dtype) -> bool:
    """Whether this torch build packs and multiplies `dtype` weights through oneDNN (checked once on a
    small weight: builds without oneDNN, or whose oneDNN lacks the op, keep the unpacked paths)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        with torch.inference_mode():
            w, x = torch.ones(4, 8, dtype=dtype), torch.ones(2, 8, dtype=dtype)
            return bool(torch.equal(packed_linear(x, pack(w)), F.linear(x, w)))
    except RuntimeError:
        return False


def pack(w: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of the 2-D weight `w` ([out, in]), for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _PACK_ROWS)


def packed(w: torch.Tensor) -> torch.Tensor:
    """`pack(w)`, kept while `w` is unchanged."""
    return kept("packed", lambda: pack(w), w)  # type: ignore[return-value]


def packed_linear(x: torch.Tensor, w_packed: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)` from `packed(w)`."""
    k = x.shape[-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, k).contiguous(), w_packed, b, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b); in fp32 and rounded back to x's dtype where `cpu_upcast(x)`; from a packed
    copy of the weight where `packs`."""
    if not cpu_upcast(x, linear_numel=w.numel()):
        return _linear(x, w, b)
    return _linear(x.float(), as_fp32(w), None if b is None else as_fp32(b)).to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if packs(x, w.numel()) and w.dtype == x.dtype and (b is None or b.dtype == x.dtype):
        return packed_linear(x, packed(w), b)
    return F.linear(x, w, b)


def set_cpu_blocked_attention(value: bool | None) -> None:
    """Force (True/False) or restore the rule (None) for `blocked_attention`; forced on, it takes any
    dtype and size, with or without autograd."""
    global _BLOCKED_FORCED
    _BLOCKED_FORCED = value


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict) -> bool:
    """Whether `sdpa(q, k, v, **kw)` goes through `asyncrl.model.blocked_attention` (module docstring)."""
    if set(kw) - {"is_causal", "enable_gqa", "scale"} or not kw.get("is_causal") or q.device.type != "cpu":
        return False
    if q.dim() != 4 or k.dim() != 4 or q.shape[2] != k.shape[2] or q.shape[2] < 2:
        return False
    if _BLOCKED_FORCED is not None:
        return _BLOCKED_FORCED
    B, H, T, _ = q.shape
    too_large = T > MAX_BLOCKED_LEN or B * H * T * T > MAX_BLOCKED_SCORES
    if q.dtype != torch.bfloat16 or cpu_upcast(q) or too_large:
        return False
    kernels = cpu_kernels()
    if not kernels.native_bf16 or kernels.amx or not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in (q, k, v))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention; in fp32 where `cpu_upcast(q)` (a float mask is upcast too);
    from blocked matmuls where `blocked_attention`."""
    if blocked_attention(q, k, v, kw):
        return blocked_causal_attention(q, k, v, scale=kw.get("scale"))
    if not cpu_upcast(q):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kw["attn_mask"] = mask.float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)


class LinearKernel(Protocol):
    """A linear computed elsewhere where it `takes` the call (asyncrl.inference.cpu_matmul)."""

    def takes(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool: ...

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Linear):
    """nn.Linear through `linear`: same parameters and state-dict keys. `cpu_kernel`, where set (the
    inference engine's CPU matmul kernel), computes the calls it takes."""

    cpu_kernel: LinearKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.cpu_kernel
        if kernel is not None and kernel.takes(x, self.weight, self.bias):
            return kernel(x, self.weight)
        return linear(x, self.weight, self.bias)

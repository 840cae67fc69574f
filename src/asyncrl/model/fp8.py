"""FP8 block-scale linear layers (DeepSeek-V3 recipe), shared by the trainer and the inference engine.

    report = apply_fp8(model)                       # swap eligible linears in place
    report.converted                                # ("model.layers.0.self_attn.q_proj", ...)
    y = fp8_linear(x, weight)                       # one call, same numerics as FP8Linear

Activations are quantized in 1x128 groups along the contraction dim (one scale per token per
128 channels), weights in 128x128 blocks, both to float8 e4m3 with scale = max(amax, floor) / 448,
so each group's largest magnitude maps to e4m3's largest finite value. Master weights stay in
their own precision and are re-quantized on every call: nothing quantized is cached, so an
optimizer step or a weight update takes effect immediately.

Backends:
  emulated   quantize to torch.float8_e4m3fn, dequantize to fp32, fp32 matmul, cast to x's dtype.
             Exact up to fp32 accumulation order; runs anywhere (the CPU path).
  scaled_mm  torch.nn.functional.scaled_mm with BlockWise1x128 x BlockWise128x128 recipes (CUDA,
             compute capability 9.0+). Same quantized operands, fp32 accumulation in the kernel.
  auto       scaled_mm where a one-time probe shows it works and agrees with the emulation on
             this device, otherwise emulated (with a warning naming the reason).

Gradients: the forward uses the quantized operands; the backward computes the input and weight
gradients in high precision from the saved quantized operands (straight-through for the
rounding). DeepSeek-V3 also runs its backward GEMMs in FP8; we do not, which only changes the
gradient noise, not the forward numerics that trainer-inference mismatch depends on.

Shape legend: N tokens (all leading dims flattened), K input (contraction) dim, O output dim,
G = K/128 activation groups, Ob = O/128 and Kb = K/128 weight blocks.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.fp8_options import BLOCK, DEFAULT_FP8_IGNORE, FP8Backend
from asyncrl.model.moe import GroupedExperts

__all__ = [
    "AMAX_FLOOR",
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8Linear",
    "FP8Report",
    "NonFiniteInputError",
    "apply_fp8",
    "dequantize_activation",
    "dequantize_weight",
    "fp8_linear",
    "plan_fp8",
    "quantize_activation",
    "quantize_weight",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
AMAX_FLOOR = 1e-12  # an all-zero (or tiny) group gets scale AMAX_FLOOR / 448, not 0, so no 0/0


class NonFiniteInputError(ValueError):
    """An FP8 operand held NaN or inf: a block scale would be non-finite and poison the whole block."""


def _check_finite(amax: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteInputError(
            f"fp8: the {what} holds NaN or inf; FP8 block scaling needs finite values (check the "
            f"preceding layer or lower the learning rate)"
        )


def _to_fp8(x_f32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x / (amax/448) can land a rounding step above 448; e4m3fn has no inf, so clamp before the cast.
    return (x_f32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activation(x_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 groups: (q_NK float8_e4m3fn, scale_NG fp32), x ~= q * scale."""
    N, K = x_NK.shape
    if K % BLOCK:
        raise ValueError(f"fp8: activation dim {K} is not a multiple of {BLOCK}")
    x_NGB = x_NK.float().view(N, K // BLOCK, BLOCK)
    amax_NG = x_NGB.abs().amax(dim=-1)
    _check_finite(amax_NG, "activation")
    scale_NG = amax_NG.clamp(min=AMAX_FLOOR) / FP8_MAX
    return _to_fp8(x_NGB, scale_NG[..., None]).view(N, K), scale_NG


def quantize_weight(w_OK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks: (q_OK float8_e4m3fn, scale_ObKb fp32), w ~= q * scale (per block)."""
    out_dim, K = w_OK.shape
    if out_dim % BLOCK or K % BLOCK:
        raise ValueError(f"fp8: weight shape {[out_dim, K]} is not a multiple of {BLOCK} in both dims")
    w_blocks = w_OK.float().view(out_dim // BLOCK, BLOCK, K // BLOCK, BLOCK)
    amax_ObKb = w_blocks.abs().amax(dim=(1, 3))
    _check_finite(amax_ObKb, "weight")
    scale_ObKb = amax_ObKb.clamp(min=AMAX_FLOOR) / FP8_MAX
    q = _to_fp8(w_blocks, scale_ObKb[:, None, :, None])
    return q.view(out_dim, K), scale_ObKb


def dequantize_activation(q_NK: torch.Tensor, scale_NG: torch.Tensor) -> torch.Tensor:
    N, K = q_NK.shape
    return (q_NK.float().view(N, -1, BLOCK) * scale_NG[..., None]).view(N, K)


def dequantize_weight(q_OK: torch.Tensor, scale_ObKb: torch.Tensor) -> torch.Tensor:
    out_dim, K = q_OK.shape
    blocks = q_OK.float().view(out_dim // BLOCK, BLOCK, K // BLOCK, BLOCK) * scale_ObKb[:, None, :, None]
    return blocks.view(out_dim, K)


# -- matmul backends ------------------------------------------------------------------------------
def _mm_emulated(xq, xs, wq, ws) -> torch.Tensor:
    return dequantize_activation(xq, xs) @ dequantize_weight(wq, ws).T


def _mm_scaled(xq, xs, wq, ws) -> torch.Tensor:
    """F.scaled_mm, 1x128 x 128x128 blockwise; scale layouts as torch 2.13's checks require."""
    Kb = xq.shape[1] // BLOCK
    L4 = -(-Kb // 4) * 4
    scale_a = xs.t().contiguous().t()  # [N, Kb], stride [1, N]
    scale_b = F.pad(ws, (0, L4 - Kb)).contiguous().t()  # [L4, Ob], stride [1, L4]
    return F.scaled_mm(
        xq,
        wq.t(),
        scale_a,
        F.ScalingType.BlockWise1x128,
        scale_b,
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    ).float()


@functools.cache
def _scaled_mm_works(device_index: int) -> bool:
    """Probe once per device: does blockwise scaled_mm run here and agree with the emulation?"""
    if not hasattr(F, "scaled_mm") or torch.cuda.get_device_capability(device_index) < (9, 0):
        return False
    gen = torch.Generator(device=f"cuda:{device_index}").manual_seed(0)
    x = torch.randn(256, 512, device=f"cuda:{device_index}", generator=gen)
    w = torch.randn(384, 512, device=f"cuda:{device_index}", generator=gen)
    ops = (*quantize_activation(x), *quantize_weight(w))
    try:
        got = _mm_scaled(*ops)
    except (
        RuntimeError,
        ValueError,
        AttributeError,
        TypeError,
    ) as err:  # kernel, recipe or scale layout missing here
        warnings.warn(f"fp8: blockwise scaled_mm unavailable ({err}); using the emulated path", stacklevel=3)
        return False
    want = _mm_emulated(*ops)
    rel = float((got - want).abs().max() / want.abs().max())
    if rel > 1e-2:  # bf16 output rounding is ~4e-3
        warnings.warn(
            f"fp8: scaled_mm disagrees with the emulation (rel {rel:.2e}); using emulated", stacklevel=3
        )
        return False
    return True


def _matmul(xq, xs, wq, ws, backend: FP8Backend) -> torch.Tensor:
    """fp32 [N, O] from quantized operands."""
    if backend == "scaled_mm":
        if not xq.is_cuda:
            raise ValueError("fp8 backend 'scaled_mm' needs CUDA tensors; use 'emulated' or 'auto' on CPU")
        return _mm_scaled(xq, xs, wq, ws)
    if backend == "auto" and xq.is_cuda and _scaled_mm_works(xq.device.index or 0):
        return _mm_scaled(xq, xs, wq, ws)
    return _mm_emulated(xq, xs, wq, ws)


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_OK: torch.Tensor, backend: FP8Backend) -> torch.Tensor:
        xq, xs = quantize_activation(x_NK)
        wq, ws = quantize_weight(w_OK)
        ctx.save_for_backward(xq, xs, wq, ws)
        ctx.dtypes = (x_NK.dtype, w_OK.dtype)
        return _matmul(xq, xs, wq, ws, backend).to(x_NK.dtype)

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        xq, xs, wq, ws = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g = grad_NO.float()
        grad_x = g @ dequantize_weight(wq, ws) if ctx.needs_input_grad[0] else None
        grad_w = g.T @ dequantize_activation(xq, xs) if ctx.needs_input_grad[1] else None
        return (
            None if grad_x is None else grad_x.to(x_dtype),
            None if grad_w is None else grad_w.to(w_dtype),
            None,
        )


def fp8_linear(
    x: torch.Tensor, weight_OK: torch.Tensor, bias: torch.Tensor | None = None, backend: FP8Backend = "auto"
) -> torch.Tensor:
    """y = x @ weight.T (+ bias) with both operands block-quantized to e4m3; y in x's dtype."""
    K = x.shape[-1]
    y_NO = _FP8Matmul.apply(x.reshape(-1, K), weight_OK, backend)
    y = y_NO.view(*x.shape[:-1], weight_OK.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


class FP8Linear(nn.Linear):
    """nn.Linear whose forward runs `fp8_linear`; same parameters and state-dict keys."""

    backend: FP8Backend = "auto"

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: FP8Backend = "auto") -> FP8Linear:
        """Wrap the same Parameter objects (optimizer state and weight tying stay valid)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.backend = backend
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.backend)

    def rounded_weight(self) -> torch.Tensor:
        """fp32 [O, K]: the weight as `forward` multiplies by it (e4m3 blocks, dequantized), with
        the straight-through gradient of `forward`; for code that reuses the weight in another form
        (MLA's absorbed attention)."""
        w = self.weight
        return w.float() + (dequantize_weight(*quantize_weight(w)) - w.float()).detach()

    def rounded_input(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x as `forward` reads it (1x128 groups per row, dequantized), straight-through."""
        x_NK = x.reshape(-1, x.shape[-1]).float()
        rounded = dequantize_activation(*quantize_activation(x_NK))
        return (x_NK + (rounded - x_NK).detach()).view(x.shape)


@dataclass(frozen=True, kw_only=True)
class FP8Report:
    """What `apply_fp8` did. Example: converted=("model.layers.0.self_attn.q_proj", ...),
    kept={"lm_head": "ignored", "model.layers.0.self_attn.k_proj": "dims [128, 64] not multiples of 128"}.
    """

    converted: tuple[str, ...]
    kept: dict[str, str]


def _ignored(name: str, ignore: Sequence[str]) -> bool:
    return any(name == pat or fnmatch.fnmatchcase(name, pat) for pat in ignore)


def _why_not(name: str, dims: Sequence[int], ignore: Sequence[str]) -> str | None:
    if _ignored(name, ignore):
        return "ignored"
    if any(d % BLOCK for d in dims):
        return f"dims {list(dims)} not multiples of {BLOCK}"
    return None


def plan_fp8(model: nn.Module, ignore: Sequence[str] = DEFAULT_FP8_IGNORE) -> FP8Report:
    """Which modules `apply_fp8` quantizes (`converted`) and which it keeps, and why; changes nothing.

    An FP8Linear counts as converted; an nn.Linear or GroupedExperts stack is converted unless a
    name in `ignore` matches it or its dims are not multiples of 128. Names are `named_modules()`'s.
    """
    converted, kept = [], {}
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            converted.append(name)
            continue
        if isinstance(module, nn.Linear):
            dims: Sequence[int] = (module.out_features, module.in_features)
        elif isinstance(module, GroupedExperts):
            dims = tuple(module.gate_proj.shape[1:])  # [E, I, D] -> (I, D)
        else:
            continue
        reason = _why_not(name, dims, ignore)
        if reason is None:
            converted.append(name)
        else:
            kept[name] = reason
    return FP8Report(converted=tuple(converted), kept=kept)


def apply_fp8(
    model: nn.Module, ignore: Sequence[str] = DEFAULT_FP8_IGNORE, backend: FP8Backend = "auto"
) -> FP8Report:
    """Swap eligible nn.Linear modules for FP8Linear and turn on FP8 in GroupedExperts, in place.

    `ignore` holds module names or fnmatch patterns (e.g. "lm_head", "*.self_attn.o_proj",
    "model.layers.0.*"). A linear or expert stack whose dims are not multiples of 128 stays in
    high precision (`plan_fp8` says which). Norms, embeddings and routers are never nn.Linear and
    are never touched.
    """
    if backend not in get_args(FP8Backend):
        raise ValueError(f"fp8 backend must be one of {list(get_args(FP8Backend))}, got {backend!r}")
    report = plan_fp8(model, ignore)
    for name in report.converted:
        module = model.get_submodule(name)
        if isinstance(module, GroupedExperts):
            module.expert_linear = functools.partial(fp8_linear, backend=backend)
        elif not isinstance(module, FP8Linear):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, FP8Linear.from_linear(module, backend))
    return report

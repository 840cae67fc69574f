"""Rotary position embeddings: the inverse frequencies of plain RoPE and of YaRN, and YaRN's two
attention corrections, as transformers computes them for every family we run.

    inv_freq_f = inverse_frequencies(dim, theta, args.rope_scaling)   # [dim / 2] fp32
    cos, sin = cos(pos * inv_freq) * cos_sin_factor(scaling), ...     # (RotaryEmbedding does this)
    q *= softmax_gain(args)                                           # MLA layers only

YaRN (rope_type "yarn") keeps the high frequencies (which turn many times within the original
context, beta_fast rotations or more) as they are, divides the low ones (fewer than beta_slow
rotations) by `factor`, and ramps linearly between the two in dimension index. It then multiplies
cos and sin by an attention factor (so q.k by its square): 0.1 ln(factor) + 1, or with DeepSeek's
`mscale` / `mscale_all_dim` the ratio mscale(factor, mscale) / mscale(factor, mscale_all_dim).
DeepSeek's MLA (DeepSeek-V3, Kimi-K2, GLM-5) also multiplies its softmax scale by
mscale(factor, mscale_all_dim)^2. With mscale = mscale_all_dim, as DeepSeek-V3 and Kimi-K2 ship,
cos and sin are unchanged and only the softmax scale grows (1.87x for DeepSeek-V3's factor 40).

Everything here is recomputed per call from the config (a few scalars and dim / 2 values), so a
model materialised from the meta device needs no re-initialisation.

Shape legend: f = dim / 2 frequencies.
"""

from __future__ import annotations

import math

import torch

from asyncrl.model.args import ModelArgs, YarnScaling

__all__ = ["cos_sin_factor", "inverse_frequencies", "softmax_gain"]


def inverse_frequencies(
    dim: int, theta: float, scaling: YarnScaling | None, device: torch.device | None = None
) -> torch.Tensor:
    """fp32 [dim / 2]: theta^(-2i/dim), YaRN-interpolated when `scaling` is set."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if scaling is None:
        return 1.0 / (theta**exponents)
    base_f = theta**exponents
    extrapolated_f, interpolated_f = 1.0 / base_f, 1.0 / (scaling.factor * base_f)
    keep_f = 1.0 - _ramp(*_correction_range(dim, theta, scaling), dim // 2, device)
    return interpolated_f * (1.0 - keep_f) + extrapolated_f * keep_f


def cos_sin_factor(scaling: YarnScaling | None) -> float:
    """What cos and sin are multiplied by (1 without YaRN)."""
    if scaling is None:
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _mscale(scaling.factor, scaling.mscale) / _mscale(scaling.factor, scaling.mscale_all_dim)
    return _mscale(scaling.factor)


def softmax_gain(args: ModelArgs) -> float:
    """What an MLA layer's softmax scale qk_head_dim^-0.5 is multiplied by (1 without YaRN)."""
    scaling = args.rope_scaling
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return _mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_range(dim: int, theta: float, scaling: YarnScaling) -> tuple[float, float]:
    """The dims where the frequency turns beta_fast, and beta_slow, times in the original context."""

    def dim_for(rotations: float) -> float:
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_for(scaling.beta_fast), dim_for(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _ramp(low: float, high: float, n: int, device: torch.device | None) -> torch.Tensor:
    """fp32 [n]: 0 up to `low`, rising linearly to 1 at `high`."""
    if low == high:
        high += 0.001  # a step, not a division by zero (Kimi-K2 sets beta_fast = beta_slow)
    return ((torch.arange(n, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)

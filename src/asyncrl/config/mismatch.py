"""Trainer-inference mismatch settings: the FP8 block-scale switch and the mismatch gate.

Example (a trainer or inference TOML)::

    [fp8]
    enabled = true                      # quantize eligible linears and expert stacks (e4m3, 128 blocks)
    ignore = ["lm_head", "*.mlp.gate", "model.layers.0.*"]

    [mismatch]
    max_mismatch_kl = 1e-3              # mean k3 KL over a step's current-version tokens
    gate = "fail"                       # "warn": log and continue; "fail": stop the run

The same `[fp8]` section goes to the inference server (FP8 inference) and the trainer (FP8
training): set both to match precision, or only one to study the mismatch it causes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig
from asyncrl.fp8_options import DEFAULT_FP8_IGNORE, FP8Backend

__all__ = ["FP8Config", "MismatchConfig"]


class FP8Config(BaseConfig):
    """FP8 block-scale linears (DeepSeek-V3 recipe); see docs/mismatch.md."""

    enabled: bool = Field(False, description="quantize eligible linears and expert stacks (e4m3, 128 blocks)")
    ignore: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FP8_IGNORE),
        description="module names or fnmatch patterns kept in high precision (dims not multiple of 128 always are)",
    )
    backend: FP8Backend = Field(
        "auto",
        description="scaled_mm: blockwise F.scaled_mm (CUDA); emulated: dequantize, fp32 matmul; auto: scaled_mm where a probe shows it works",
    )


class MismatchConfig(BaseConfig):
    """Per-step mismatch metrics and the gate on mismatch KL."""

    max_mismatch_kl: float | None = Field(
        None, gt=0, description="gate threshold on the mean k3 KL of current-version tokens; None: off"
    )
    gate: Literal["warn", "fail"] = Field("warn", description="over the threshold: log, or stop the run")
    ratio_low: float = Field(0.5, gt=0, description="tokens with pi/mu below this count as outliers")
    ratio_high: float = Field(2.0, gt=0, description="tokens with pi/mu above this count as outliers")

    @model_validator(mode="after")
    def _check_bounds(self) -> MismatchConfig:
        if self.ratio_low >= self.ratio_high:
            raise ValueError(
                f"mismatch.ratio_low ({self.ratio_low}) must be below mismatch.ratio_high ({self.ratio_high})"
            )
        return self

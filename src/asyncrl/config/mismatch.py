"""Trainer-inference mismatch settings: the per-step metrics' outlier bounds and the mismatch gate.

Example (a trainer TOML)::

    [mismatch]
    max_mismatch_kl = 1e-3              # mean k3 KL over a step's current-version tokens
    gate = "fail"                       # "warn": log and continue; "fail": stop the run

FP8, one source of mismatch, has its own section (asyncrl.config.fp8).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig

__all__ = ["MismatchConfig"]


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

"""FP8 block-scale settings, one `[fp8]` section for the inference server and the trainer.

Example (a trainer or inference TOML)::

    [fp8]
    enabled = true                      # quantize eligible linears and expert stacks (e4m3, 128 blocks)
    ignore = ["lm_head", "*.mlp.gate", "model.layers.0.*"]

The same section goes to the inference server (FP8 inference) and the trainer (FP8 training): set
both to match precision, or only one to study the mismatch it causes (docs/mismatch.md).
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.base import BaseConfig
from asyncrl.fp8_options import DEFAULT_FP8_IGNORE, FP8Backend

__all__ = ["FP8Config"]


class FP8Config(BaseConfig):
    """FP8 block-scale linears (DeepSeek-V3 recipe); see docs/mismatch.md."""

    enabled: bool = Field(False, description="quantize eligible linears and expert stacks (e4m3, 128 blocks)")
    ignore: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FP8_IGNORE),
        description="module names or fnmatch patterns kept in high precision (dims not multiple of 128 "
        "always are)",
    )
    backend: FP8Backend = Field(
        "auto",
        description="scaled_mm: blockwise F.scaled_mm (CUDA); emulated: dequantize, fp32 matmul; auto: "
        "scaled_mm where a probe shows it works",
    )

"""The FP8 options that the config (pydantic) and the model (torch) both read.

Dependency-free, so that `asyncrl.model` imports where pydantic is not installed (the GPU
machine's image, docs/gpu-check.md) and `asyncrl.config` stays torch-free.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["BLOCK", "DEFAULT_FP8_IGNORE", "FP8Backend"]

# The router is an asyncrl Router (never an nn.Linear), so it stays high precision regardless; it is
# listed so that the default reads as the policy. The LM head must stay: the trainer's chunked
# logprobs read lm_head.weight directly, so an FP8 LM head would only apply on the engine side.
DEFAULT_FP8_IGNORE: tuple[str, ...] = ("lm_head", "*.mlp.gate")
FP8Backend = Literal["auto", "emulated", "scaled_mm"]
BLOCK = 128  # edge of a block-scale FP8 block: one scale per 128 x 128 weights, per 1 x 128 activations

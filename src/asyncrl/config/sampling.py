"""Sampling controls shared by every request path (vLLM's names), usable as a config section.

The limits below are the one definition of what a request may ask for: this section, the HTTP
schemas (`asyncrl.wire`, the server's OpenAI endpoints) and the engine's own check all read them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from asyncrl.config.base import BaseConfig

__all__ = [
    "MAX_SAMPLED_TOKENS",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "MaxTokens",
    "MinP",
    "SamplingParams",
    "StopStrings",
    "Temperature",
    "TopK",
    "TopP",
]

# Below MIN_TEMPERATURE, logits / temperature overflows float32 for realistic logits; use 0 (greedy).
# Only the engine enforces it: a vLLM server takes any temperature the schemas allow.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1  # torch.Generator seeds are 64-bit
MAX_SAMPLED_TOKENS = 1_048_576  # the largest max_tokens a request may ask for
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # each engine step decodes a tail proportional to the longest stop string
MAX_STOP_TOKEN_IDS = 256

Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_SAMPLED_TOKENS)]
StopStrings = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]


class SamplingParams(BaseConfig):
    """Sampling controls, shared by /v1/generate and the OpenAI endpoints (vLLM's names)."""

    temperature: Temperature = Field(1.0, description="0 = greedy")
    top_p: TopP = Field(1.0, description="nucleus sampling: keep the smallest set with this mass")
    top_k: TopK = Field(-1, description="-1 or 0 disables top-k")
    min_p: MinP = Field(0.0, description="drop tokens below min_p * the top probability")
    seed: int | None = Field(None, description="per-request sampling seed; unset = the engine's generator")
    max_tokens: MaxTokens = Field(16, description="most tokens sampled per request (turn)")
    stop: StopStrings = Field(default_factory=list, description="stop strings")
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a completion")
    ignore_eos: bool = Field(False, description="keep sampling past the end-of-sequence token")

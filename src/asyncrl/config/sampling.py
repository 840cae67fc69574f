"""Sampling controls shared by every request path (vLLM's names), usable as a config section."""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.base import BaseConfig

__all__ = ["SamplingParams"]


class SamplingParams(BaseConfig):
    """Sampling controls, shared by /v1/generate and the OpenAI endpoints (vLLM's names)."""

    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="nucleus sampling: keep the smallest set with this mass"
    )
    top_k: int = Field(-1, ge=-1, description="-1 or 0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p * the top probability")
    seed: int | None = Field(None, description="per-request sampling seed; unset = the engine's generator")
    max_tokens: int = Field(16, ge=1, le=1_048_576, description="most tokens sampled per request (turn)")
    stop: list[str] = Field(default_factory=list, max_length=16, description="stop strings")
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a completion")
    ignore_eos: bool = Field(False, description="keep sampling past the end-of-sequence token")

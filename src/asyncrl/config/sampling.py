"""Sampling controls shared by every request path (vLLM's names), usable as a config section."""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.base import BaseConfig

__all__ = ["SamplingParams"]


class SamplingParams(BaseConfig):
    """Sampling controls, shared by /v1/generate and the OpenAI endpoints (vLLM's names)."""

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    max_tokens: int = Field(16, ge=1, le=1_048_576)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

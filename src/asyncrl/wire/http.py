"""HTTP messages of the token-in/token-out API (`POST /v1/generate`) and admin endpoints.

The OpenAI-compatible endpoints follow OpenAI's schema and live with the server; these are the
asyncrl-specific messages that the orchestrator and the engine both speak. Torch-free.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.config.sampling import SamplingParams

__all__ = [
    "GenerateRequest",
    "GenerateResponse",
    "PauseRequest",
    "RoutedExperts",
    "SamplingParams",
    "UpdateWeightsRequest",
    "UpdateWeightsResponse",
]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(SamplingParams):
    """`POST /v1/generate`: exact prompt token ids in, sampled token ids out."""

    prompt_token_ids: list[int] = Field(min_length=1)
    cache_salt: str | None = None
    return_routed_experts: bool = False
    routed_experts_start: int = Field(
        0, ge=0, description="skip routing for the first N (already known) tokens"
    )

    @classmethod
    def build(cls, prompt_token_ids: list[int], sampling: SamplingParams, **fields) -> GenerateRequest:
        """The request of an `InferenceClient.generate` call: its sampling params plus the rest."""
        return cls(**sampling.model_dump(), prompt_token_ids=prompt_token_ids, **fields)


class RoutedExperts(_Message):
    """Expert ids per token, [tokens, layers, top_k], as base64 of the raw little-endian array."""

    data: str
    shape: list[int]
    dtype: Literal["uint8", "uint16"]
    start: int = 0

    @classmethod
    def from_array(cls, arr: np.ndarray, start: int = 0) -> RoutedExperts:
        if arr.dtype not in (np.uint8, np.uint16) or arr.ndim != 3:
            raise ValueError(f"routed experts must be uint8/uint16 [T, L, K], got {arr.dtype} {arr.shape}")
        raw = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        return cls(
            data=base64.b64encode(raw).decode(), shape=list(arr.shape), dtype=str(arr.dtype), start=start
        )

    def to_array(self) -> np.ndarray:
        dtype = np.dtype(self.dtype).newbyteorder("<")
        arr = np.frombuffer(base64.b64decode(self.data), dtype=dtype)
        return arr.reshape(self.shape).astype(np.dtype(self.dtype))


class GenerateResponse(_Message):
    token_ids: list[int]
    logprobs: list[float]  # under the sampling distribution (temperature applied), one per token
    policy_versions: list[int]  # one per token
    finish_reason: Literal["stop", "length", "abort"]
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    routed_experts: RoutedExperts | None = None


class PauseRequest(_Message):
    mode: Literal["keep", "abort"] = "keep"


class UpdateWeightsRequest(_Message):
    path: str
    version: int = Field(ge=0)
    mode: Literal["keep", "abort"] = "keep"


class UpdateWeightsResponse(_Message):
    version: int
    load_seconds: float
    paused_seconds: float

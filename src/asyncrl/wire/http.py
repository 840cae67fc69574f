"""HTTP messages of the token-in/token-out API (`POST /v1/generate`) and admin endpoints.

The OpenAI-compatible endpoints follow OpenAI's schema and live with the server; these are the
asyncrl-specific messages that the orchestrator and the engine both speak. Torch-free.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from asyncrl.config.sampling import MAX_SEED, SamplingParams

__all__ = [
    "FieldValueError",
    "GenerateRequest",
    "GenerateResponse",
    "PauseRequest",
    "PauseResponse",
    "ResumeResponse",
    "RoutedExperts",
    "SamplingParams",
    "UpdateWeightsRequest",
    "UpdateWeightsResponse",
    "ValidUnicode",
    "WeightsInfo",
    "find_lone_surrogate",
]

MAX_VERSION = 2**31 - 1  # policy versions travel as int32 in rollout samples


class FieldValueError(ValueError):
    """A validator's error about a nested field; servers report `field` as the offending param."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in a JSON value that is not valid Unicode, or None.

    JSON may spell lone surrogates (`"\\ud800"`); they cannot be tokenized, hashed or encoded.
    """
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{path}.{key}" if path else str(key)
        if (bad := find_lone_surrogate(key, name) if isinstance(key, str) else None) is not None:
            return bad
        if (bad := find_lone_surrogate(item, name)) is not None:
            return bad
    return None


class ValidUnicode(BaseModel):
    """Mixin: reject any string field (at any depth) holding lone surrogates, naming its path."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (bad := find_lone_surrogate(data)) is not None:
            raise FieldValueError(bad, "text is not valid Unicode (lone surrogate)")
        return data


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(SamplingParams, ValidUnicode):
    """`POST /v1/generate`: exact prompt token ids in, sampled token ids out."""

    seed: int | None = Field(None, ge=0, le=MAX_SEED)
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
    """Expert ids per token, [tokens, layers, top_k] from token `start` on, uint8 (<= 256 experts) or uint16.

    In JSON `data` is base64 of the raw little-endian array. A message built with `from_array`
    holds the array itself and encodes it only when dumped to JSON, so the binary body
    (`asyncrl.wire.binary`) carries the rows raw and never base64.

        RoutedExperts.from_array(np.zeros((3, 4, 2), np.uint8), start=5).to_array().shape  # (3, 4, 2)
    """

    data: str = ""
    shape: list[int] = Field(min_length=3, max_length=3)
    dtype: Literal["uint8", "uint16"]
    start: int = Field(0, ge=0)
    _rows: np.ndarray | None = PrivateAttr(None)  # uint8|uint16 [tokens, layers, top_k], native order

    @model_validator(mode="after")
    def _data_fits_shape(self) -> RoutedExperts:
        num_bytes = math.prod(self.shape) * np.dtype(self.dtype).itemsize
        if self._rows is None and len(self.data) != 4 * math.ceil(num_bytes / 3):
            raise ValueError(
                f"data holds {len(self.data)} base64 characters; shape {self.shape} of {self.dtype} "
                f"needs {4 * math.ceil(num_bytes / 3)}"
            )
        return self

    @model_serializer(mode="wrap")
    def _encode_rows(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if self._rows is not None:
            out["data"] = base64.b64encode(self.to_bytes()).decode()
        return out

    @classmethod
    def from_array(cls, arr: np.ndarray, start: int = 0) -> RoutedExperts:
        if arr.dtype not in (np.uint8, np.uint16) or arr.ndim != 3:
            raise ValueError(f"routed experts must be uint8/uint16 [T, L, K], got {arr.dtype} {arr.shape}")
        if start < 0:
            raise ValueError(f"routed experts start must be >= 0, got {start}")
        out = cls.model_construct(shape=list(arr.shape), dtype=str(arr.dtype), start=start)
        out._rows = arr
        return out

    def to_array(self) -> np.ndarray:
        if self._rows is None:
            raw = np.frombuffer(base64.b64decode(self.data), dtype=np.dtype(self.dtype).newbyteorder("<"))
            self._rows = raw.reshape(self.shape).astype(np.dtype(self.dtype), copy=False)
        return self._rows

    def to_bytes(self) -> bytes:
        """The rows as raw little-endian bytes, C order."""
        rows = self.to_array()
        return np.ascontiguousarray(rows).astype(rows.dtype.newbyteorder("<"), copy=False).tobytes()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        return (self.shape, self.dtype, self.start) == (other.shape, other.dtype, other.start) and (
            np.array_equal(self.to_array(), other.to_array())
        )


class GenerateResponse(_Message):
    token_ids: list[int]
    logprobs: list[float]  # under the sampling distribution (temperature applied), one per token
    policy_versions: list[int]  # one per token
    finish_reason: Literal["stop", "length", "abort"]
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    routed_experts: RoutedExperts | None = None
    # The oldest weights version whose KV this request's context was computed with (a prompt
    # prefilled in chunks across an update, or a prefix-cache hit, can predate its first sampled
    # token). None: the server does not report it; readers then take the first token's version.
    context_version: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_entry_per_token(self) -> GenerateResponse:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.policy_versions) != n:
            raise ValueError(
                f"{n} token_ids but {len(self.logprobs)} logprobs and {len(self.policy_versions)} "
                "policy_versions (one of each per token)"
            )
        return self


class PauseRequest(_Message, ValidUnicode):
    """`POST /pause`: keep (running requests hold their KV cache) or abort them."""

    mode: Literal["keep", "abort"] = "keep"


class PauseResponse(_Message):
    paused: Literal[True]
    mode: Literal["keep", "abort"]
    num_aborted: int = Field(ge=0)


class ResumeResponse(_Message):
    paused: Literal[False]


class WeightsInfo(_Message):
    """`GET /weights`: the policy version a server holds, and where it was loaded from (None: v0)."""

    version: int = Field(ge=0)
    path: str | None = None


class UpdateWeightsRequest(_Message, ValidUnicode):
    """Load version `version`: from the files at `path` (filesystem), or (distributed) the version the
    server received from the trainer over its update channel, waiting for it a bounded time; `path`
    then names the version's publication and is not read."""

    path: str = Field(min_length=1, max_length=4096)
    version: int = Field(ge=0, le=MAX_VERSION)
    mode: Literal["keep", "abort"] = "keep"
    transport: Literal["filesystem", "distributed"] = "filesystem"


class UpdateWeightsResponse(_Message):
    version: int  # the version loaded (distributed: the newest the server received, >= the one asked)
    load_seconds: float  # reading the files, or waiting for the received version and converting it
    paused_seconds: float  # generation stopped for the swap
    receive_seconds: float | None = None  # distributed: the transfer itself, while the server generated

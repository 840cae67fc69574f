"""Request schemas of the OpenAI-compatible endpoints, and the JSON error body every 4xx carries.

Fields follow OpenAI's API plus vLLM's extensions that asyncrl relies on (`cache_salt`,
`return_token_ids`, `ignore_eos`, `top_k`, `min_p`, `stop_token_ids`) and `return_routed_experts`.
Unknown fields are rejected with an error naming them.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, field_validator

from asyncrl.config.sampling import (
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    MaxTokens,
    MinP,
    StopStrings,
    Temperature,
    TopK,
    TopP,
)
from asyncrl.inference.request import SamplingOptions
from asyncrl.wire import SamplingParams
from asyncrl.wire.http import ValidUnicode

__all__ = ["ChatCompletionRequest", "CompletionRequest", "error_response", "to_options"]

MAX_CHOICES = 64  # most samples (n) per request; choice i samples with seed + i


class _OpenAIRequest(ValidUnicode):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    seed: int | None = Field(None, ge=0, le=MAX_SEED - MAX_CHOICES)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: StopStrings | None = Field(None, description="a string or a list")
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported; must be 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported; must be 0")
    user: str | None = None
    # vLLM / asyncrl extensions
    cache_salt: str | None = None
    return_token_ids: bool = False
    return_routed_experts: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=1, description="0 or 1: the sampled token's logprob")
    echo: bool = Field(False, description="not supported; must be false")


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only 0 is supported")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(None, description="refused unless allow_request_chat_template")


def to_options(p: SamplingParams | _OpenAIRequest, max_tokens: int, seed_offset: int = 0) -> SamplingOptions:
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    return SamplingOptions(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=None if p.seed is None else p.seed + seed_offset,
        max_tokens=max_tokens,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


def error_response(
    status: int, message: str, param: str | None, kind: str = "invalid_request_error"
) -> JSONResponse:
    """OpenAI's error shape; `param` names the offending field."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)

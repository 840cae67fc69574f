"""vLLM's token-in/token-out messages (`POST /inference/v1/generate`, vLLM >= 0.32) <-> ours.

    body = to_vllm_generate(request)                     # our GenerateRequest -> vLLM's JSON body
    response = from_vllm_generate(payload, request)      # vLLM's JSON answer -> our GenerateResponse

vLLM's request carries `token_ids`, `sampling_params`, `cache_salt`, `kv_transfer_params`; its
answer carries per choice `token_ids`, `logprobs.content[i].logprob`, `finish_reason`,
`routed_experts` (base64 of an `.npy` array, [prompt + completion - 1, layers, top_k]) and
`weight_versions`: spans {version, start, end} over output-token indexes, one per weight version
that sampled them. The spans make our per-token `policy_versions` exact: asyncrl labels each
version with its integer step (`POST /update_weight_version`), and vLLM's own "default" label of
the weights it started with is version 0. Torch-free.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from asyncrl.wire.http import GenerateRequest, GenerateResponse, RoutedExperts

__all__ = ["BASE_VERSION_LABEL", "VLLMProtocolError", "from_vllm_generate", "to_vllm_generate"]

BASE_VERSION_LABEL = "default"  # vLLM's label of the weights it was started with
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMProtocolError(ValueError):
    """vLLM's answer does not have the shape asyncrl relies on."""


def to_vllm_generate(request: GenerateRequest, *, kv_transfer_params: dict[str, Any] | None = None) -> dict:
    """Our `GenerateRequest` as the JSON body of vLLM's `POST /inference/v1/generate`."""
    sampling = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k if request.top_k > 0 else -1,
        "min_p": request.min_p,
        "max_tokens": request.max_tokens,
        "stop": list(request.stop),
        "stop_token_ids": list(request.stop_token_ids),
        "ignore_eos": request.ignore_eos,
        "logprobs": 0,  # the sampled token's logprob only
    }
    if request.seed is not None:
        sampling["seed"] = request.seed
    body: dict[str, Any] = {"token_ids": request.prompt_token_ids, "sampling_params": sampling}
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def parse_version_label(label: str) -> int:
    """vLLM's weight-version label -> our integer version ('default' = the base model, 0)."""
    if label == BASE_VERSION_LABEL:
        return 0
    try:
        return int(label)
    except ValueError:
        raise VLLMProtocolError(f"weight version label {label!r} is not an asyncrl version") from None


def _versions(spans: list[dict] | None, num_tokens: int, fallback: int | None) -> list[int]:
    if not spans:
        if num_tokens == 0:
            return []
        if fallback is None:
            raise VLLMProtocolError("answer has no weight_versions (vLLM < 0.32?) and no fallback version")
        return [fallback] * num_tokens
    out: list[int] = []
    for span in spans:
        if span["start"] != len(out) or span["end"] < span["start"]:
            raise VLLMProtocolError(f"weight_versions spans are not contiguous: {spans}")
        out += [parse_version_label(str(span["version"]))] * (span["end"] - span["start"])
    if len(out) != num_tokens:
        raise VLLMProtocolError(f"weight_versions cover {len(out)} tokens, the answer has {num_tokens}")
    return out


def _routed(data: str | None, request: GenerateRequest) -> RoutedExperts | None:
    if data is None or not request.return_routed_experts:
        return None
    arr = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    if arr.ndim != 3:
        raise VLLMProtocolError(f"routed_experts must be [tokens, layers, top_k], got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint16).max):
        raise VLLMProtocolError("routed_experts ids out of the uint16 range")
    dtype = np.uint8 if not arr.size or arr.max() <= np.iinfo(np.uint8).max else np.uint16
    start = min(request.routed_experts_start, len(request.prompt_token_ids))
    return RoutedExperts.from_array(np.ascontiguousarray(arr[start:]).astype(dtype), start=start)


def from_vllm_generate(
    payload: dict, request: GenerateRequest, *, fallback_version: int | None = None
) -> GenerateResponse:
    """vLLM's JSON answer as our `GenerateResponse`; VLLMProtocolError when it breaks the contract.

    `fallback_version` stamps every token when an answer carries no `weight_versions` (the
    conservative, documented fallback: the version the server held when the request was sent).
    """
    try:
        choice = payload["choices"][0]
        token_ids = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        finish = _FINISH.get(choice.get("finish_reason") or "")
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise VLLMProtocolError(
            f"unexpected /inference/v1/generate answer: {type(e).__name__}: {e}"
        ) from None
    if finish is None:
        raise VLLMProtocolError(f"unexpected finish_reason {choice.get('finish_reason')!r}")
    if len(logprobs) != len(token_ids):
        raise VLLMProtocolError(f"{len(token_ids)} token_ids but {len(logprobs)} logprobs")
    usage = payload.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return GenerateResponse(
        token_ids=token_ids,
        logprobs=logprobs,
        policy_versions=_versions(choice.get("weight_versions"), len(token_ids), fallback_version),
        finish_reason=finish,
        num_cached_tokens=int(cached),
        prompt_token_ids=request.prompt_token_ids,
        routed_experts=_routed(choice.get("routed_experts"), request),
    )

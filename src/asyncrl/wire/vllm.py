"""vLLM's token-in/token-out messages (`POST /inference/v1/generate`, vLLM >= 0.32) <-> ours.

    body = to_vllm_generate(request)                     # our GenerateRequest -> vLLM's JSON body
    response = from_vllm_generate(payload, request)      # vLLM's JSON answer -> our GenerateResponse

and the other way round, for the embedded server, which serves the same endpoint:

    request = VLLMGenerateRequest.model_validate(body).to_request()
    payload = to_vllm_answer(response, request)

vLLM's request carries `token_ids`, `sampling_params`, `cache_salt`, `kv_transfer_params`; its
answer carries per choice `token_ids`, `logprobs.content[i].logprob`, `finish_reason`,
`routed_experts` (base64 of an `.npy` array, [prompt + completion - 1 - start, layers, top_k], uint8
up to 256 experts, else uint16, from token `sampling_params.routed_experts_prompt_start` on) and
`weight_versions`: spans {version, start, end} over output-token indexes, one per weight version
that sampled them. The spans make our per-token `policy_versions` exact: asyncrl labels each
version with its integer step (`POST /update_weight_version`), and vLLM's own "default" label of
the weights it started with is version 0. Torch-free.
"""

from __future__ import annotations

import base64
import io
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.config.sampling import SamplingParams
from asyncrl.wire.http import GenerateRequest, GenerateResponse, RoutedExperts

__all__ = [
    "BASE_VERSION_LABEL",
    "VLLMGenerateRequest",
    "VLLMProtocolError",
    "from_vllm_generate",
    "to_vllm_answer",
    "to_vllm_generate",
]

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
    if request.return_routed_experts:
        # vLLM returns routing server-wide when started with --enable-return-routed-experts and
        # skips the prompt tokens before `routed_experts_prompt_start` (it rejects a start past the
        # prompt). `return_routed_experts` is asyncrl's extension: the embedded server returns
        # routing per request, and vLLM ignores the key.
        sampling["routed_experts_prompt_start"] = min(
            request.routed_experts_start, len(request.prompt_token_ids)
        )
        body["return_routed_experts"] = True
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


def _routed(choice: dict, request: GenerateRequest, num_tokens: int) -> RoutedExperts | None:
    """The answer's routing rows from the start we asked for; ids keep the engine's uint8/uint16.

    asyncrl's embedded server says where its rows start (`routed_experts_start`). vLLM does not:
    its rows end at the last token it fed forward (prompt + completion - 1), so their count gives
    the start, which is the one we asked for, or 0 from a vLLM that ignored it.
    """
    data = choice.get("routed_experts")
    if data is None or not request.return_routed_experts:
        return None
    arr = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    if arr.ndim != 3:
        raise VLLMProtocolError(f"routed_experts must be [tokens, layers, top_k], got shape {arr.shape}")
    asked = min(request.routed_experts_start, len(request.prompt_token_ids))
    if choice.get("routed_experts_start") is not None:
        sent_from = int(choice["routed_experts_start"])
    else:
        sent_from = len(request.prompt_token_ids) + num_tokens - 1 - arr.shape[0]
        if sent_from not in (0, asked):
            raise VLLMProtocolError(
                f"{arr.shape[0]} routed_experts rows for {len(request.prompt_token_ids)} prompt and "
                f"{num_tokens} completion tokens from start {asked}"
            )
    start = max(asked, sent_from)
    return RoutedExperts.from_array(_expert_ids(arr[start - sent_from :]), start=start)


def _expert_ids(arr: np.ndarray) -> np.ndarray:
    """uint8/uint16 as vLLM chose them by expert count; a wider type (an older vLLM's int32) as uint16,
    the same for every answer, since an episode's or batch's rows must share one dtype."""
    if arr.dtype in (np.uint8, np.uint16):
        return np.ascontiguousarray(arr)
    if not np.issubdtype(arr.dtype, np.integer):
        raise VLLMProtocolError(f"routed_experts must hold integer expert ids, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint16).max):
        raise VLLMProtocolError("routed_experts ids out of the uint16 range")
    return np.ascontiguousarray(arr).astype(np.uint16)


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
        routed_experts=_routed(choice, request, len(token_ids)),
    )


# -- the embedded server's side of /inference/v1/generate --------------------------------------------


class VLLMSamplingParams(SamplingParams):
    """vLLM's `sampling_params`, as far as asyncrl's engine serves them; other fields are 400s."""

    logprobs: int | None = Field(None, ge=0, le=1, description="0 or 1: the sampled token's logprob")
    detokenize: bool = True  # accepted for vLLM clients; the answer is token ids either way
    routed_experts_prompt_start: int = Field(0, ge=0, description="routing from this prompt token on")


class VLLMGenerateRequest(BaseModel):
    """The body of vLLM's `POST /inference/v1/generate`, as asyncrl's embedded server accepts it.

    `return_routed_experts` is asyncrl's extension (vLLM returns routed experts server-wide when
    started with `--enable-return-routed-experts`); both skip the prompt tokens before
    `sampling_params.routed_experts_prompt_start`.
    """

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(min_length=1)
    sampling_params: VLLMSamplingParams = Field(default_factory=VLLMSamplingParams)
    request_id: str | None = None
    model: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    stream: Literal[False] = False
    output_mode: Literal["tokens"] = "tokens"
    return_routed_experts: bool = False
    # A prefill/decode hop's (asyncrl.client.disaggregated); the embedded server has no KV connector
    # and computes every prompt itself (asyncrl.inference.server).
    kv_transfer_params: dict[str, Any] | None = None

    def to_request(self) -> GenerateRequest:
        sampling = self.sampling_params.model_dump(
            exclude={"logprobs", "detokenize", "routed_experts_prompt_start"}
        )
        return GenerateRequest(
            **sampling,
            prompt_token_ids=self.token_ids,
            cache_salt=self.cache_salt,
            return_routed_experts=self.return_routed_experts,
            routed_experts_start=self.sampling_params.routed_experts_prompt_start,
        )


def _spans(versions: list[int]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def to_vllm_answer(
    response: GenerateResponse,
    request: GenerateRequest,
    request_id: str = "",
    *,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict:
    """Our `GenerateResponse` in vLLM's answer shape (`output_mode` "tokens"), one choice.

    Versions become `weight_versions` spans labelled by the integer version; routed experts an
    `.npy` in base64 whose rows start at `routed_experts_start` (asyncrl's extension; vLLM's at 0).
    """
    routed, routed_start = None, 0
    if response.routed_experts is not None:
        buf = io.BytesIO()
        np.save(buf, response.routed_experts.to_array(), allow_pickle=False)
        routed, routed_start = base64.b64encode(buf.getvalue()).decode(), response.routed_experts.start
    n_prompt, n_out = len(request.prompt_token_ids), len(response.token_ids)
    choice = {
        "index": 0,
        "finish_reason": response.finish_reason,
        "stop_reason": None,
        "token_ids": response.token_ids,
        "logprobs": {
            "content": [
                {"token_id": t, "logprob": lp} for t, lp in zip(response.token_ids, response.logprobs)
            ]
        },
        "weight_versions": _spans(response.policy_versions),
        "routed_experts": routed,
        "routed_experts_start": routed_start,
    }
    return {
        "request_id": request_id,
        "output_mode": "tokens",
        "choices": [choice],
        "kv_transfer_params": kv_transfer_params,
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": response.num_cached_tokens},
        },
    }

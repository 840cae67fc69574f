"""Engine-side request state: sampling options, the per-sequence record, and per-step output deltas.

The engine is token-in/token-out: a `Request` holds token ids only. Stop strings are checked
through a `detokenize` callable that the server hands to the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

__all__ = [
    "FinishReason",
    "InvalidRequestError",
    "Request",
    "RequestFailedError",
    "RequestOutput",
    "SamplingOptions",
]


class InvalidRequestError(ValueError):
    """A request the engine cannot serve; `field` names the offending input (for 4xx errors)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.status = field, message, status


class RequestFailedError(RuntimeError):
    """The engine could not compute this request (it failed alone; the others kept going)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id, self.message = request_id, message


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How to sample one sequence.

    Example::

        SamplingOptions(temperature=0.7, top_p=0.9, max_tokens=64, stop_token_ids=(258,), seed=1)

    temperature 0 means greedy; its logprobs are then reported under temperature 1.
    top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(kw_only=True, eq=False)
class Request:
    """One sequence in the engine: prompt, generated tokens so far, and its KV-cache bookkeeping."""

    request_id: str
    prompt_token_ids: list[int]
    options: SamplingOptions
    cache_salt: str | None = None
    return_routed_experts: bool = False
    arrival: int = 0  # admission order; preemption evicts the latest arrival first
    # False: no per-step outputs; the final output carries every token (built once per request)
    stream: bool = True

    # generation state
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    needs_final_routing: bool = False  # finished; one more forward computes the last token's routing
    generator: torch.Generator | None = None

    # KV-cache state
    block_ids: list[int] = field(default_factory=list)
    slot_table: torch.Tensor | None = None  # long [len(block_ids) * block_size]; cache of flat KV slots
    block_table: torch.Tensor | None = None  # long [len(block_ids)]; cache of block_ids on the device
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hits at first admission; -1 until admitted
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)
    weights_epoch: int = -1  # the scheduler's weights epoch at admission; keys `block_hashes`
    num_preemptions: int = 0
    # The oldest weights version that computed any KV this request attended over (its own chunks
    # and prefix-cache hits); None until its first forward. A preemption keeps it: tokens sampled
    # before the recompute saw the older KV.
    context_version: int | None = None

    def note_kv_version(self, version: int | None) -> None:
        """Fold in the version of KV this request's context now includes."""
        if version is not None and (self.context_version is None or version < self.context_version):
            self.context_version = version

    def set_blocks(self, block_ids: list[int]) -> None:
        self.block_ids, self.slot_table, self.block_table = block_ids, None, None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None and not self.needs_final_routing


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one engine step produced for one request: the new tokens, and the result when finished.

    Example::

        RequestOutput(request_id="r1", new_token_ids=[42], new_logprobs=[-1.3], new_versions=[0])
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_versions: list[int]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    routed_experts: torch.Tensor | None = None  # uint8|uint16 [tokens, layers, top_k]; when finished
    error: str | None = None  # set when the engine failed this request (finish_reason is then 'abort')
    # When finished: the oldest weights version whose KV the request attended over (a prompt
    # prefilled across an update, or a prefix-cache hit, can predate its first sampled token);
    # None when nothing was computed.
    context_version: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

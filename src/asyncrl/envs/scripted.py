"""A scripted, in-process `InferenceClient`: replies from a script, for tests and demos.

Each reply is the script's text, encoded with the chat tokenizer and followed by eos, with
deterministic logprobs, a settable policy version, and (when asked) deterministic routed experts
for every prompt and completion token from `routed_experts_start` on. With `route_last_token=False`
the last sampled token has no routing, the way an engine that never fed it forward would answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from asyncrl.client import RequestClient
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.wire import GenerateRequest, GenerateResponse, RoutedExperts

__all__ = ["ScriptedClient", "scripted_routing"]

Script = Callable[[int, list[int]], str]  # (call index, prompt ids) -> reply text


def scripted_routing(
    token_ids: list[int], start: int, num_layers: int, top_k: int, num_experts: int
) -> np.ndarray:
    """Deterministic [T - start, layers, top_k] expert ids: a function of (position, token, layer, slot)."""
    pos = np.arange(start, len(token_ids))[:, None, None]
    tok = np.asarray(token_ids[start:])[:, None, None]
    layer = np.arange(num_layers)[None, :, None]
    slot = np.arange(top_k)[None, None, :]
    return ((tok * 7 + pos * 3 + layer * 5 + slot) % num_experts).astype(np.uint8)


@dataclass
class ScriptedClient(RequestClient):
    """`InferenceClient` whose policy is a script. `version` may change between calls (weight updates)."""

    tokenizer: ChatTokenizer
    script: Script | Sequence[str]
    version: int = 0
    routing: tuple[int, int, int] | None = None  # (layers, top_k, experts) when the "model" is MoE
    route_last_token: bool = True  # asyncrl's engine runs one more forward to route the last token
    calls: list[list[int]] = field(default_factory=list)  # every prompt it received

    def __post_init__(self) -> None:
        RequestClient.__init__(self, self._answer)

    async def _answer(self, request: GenerateRequest) -> GenerateResponse:
        prompt_token_ids, routed_experts_start = request.prompt_token_ids, request.routed_experts_start
        index = len(self.calls)
        self.calls.append(list(prompt_token_ids))
        text = self.script(index, prompt_token_ids) if callable(self.script) else self.script[index]
        ids = [*self.tokenizer.encode(text), self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > request.max_tokens:
            ids, finish = ids[: request.max_tokens], "length"
        routed = None
        if request.return_routed_experts and self.routing is not None:
            layers, top_k, experts = self.routing
            seen = [*prompt_token_ids, *(ids if self.route_last_token else ids[:-1])]
            rows = scripted_routing(seen, routed_experts_start, layers, top_k, experts)
            routed = RoutedExperts.from_array(rows, start=routed_experts_start)
        return GenerateResponse(
            token_ids=ids,
            logprobs=[-0.01 * (i + 1) for i in range(len(ids))],
            policy_versions=[self.version] * len(ids),
            finish_reason=finish,
            routed_experts=routed,
        )

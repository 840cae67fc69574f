"""Stitching an episode's turns into training samples of exact token ids.

Turn k's prompt is turn k-1's prompt + completion + the new environment/tool tokens. The new tokens
are the suffix of the re-rendered conversation, taken only after checking that the re-rendered
prefix equals the ids we already hold. Nothing is re-tokenized. When the chat template cannot
extend the previous ids exactly (a template that rewrites history, a completion whose text does
not re-encode to the same ids), the current sample is closed and a new one starts from the full
rendering; `num_resets` counts this. Sampled tokens are never dropped. (With
`EnvConfig.stitching = "bridge"`, `TokenPolicy` first tries `ChatTokenizer.render_bridged`, which
keeps the sampled ids when only their text fails to round-trip.)

Per token: the loss mask is true only on sampled tokens; logprobs and policy versions come from
`/v1/generate` (0.0 and -1 on tokens the model did not sample); KV versions are the turn's
`context_version` on its sampled tokens, the oldest weights version whose KV the engine attended
over (each token's own version when the server does not report one; -1 on other tokens);
temperatures are the sampling temperature of the turn the token belongs to (prompt tokens take the
temperature of the turn they prompt, so a trainer dividing logits by it never sees 0). Routed
experts are gathered for every token of the sample, [T, layers, top_k].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asyncrl.client import InferenceError
from asyncrl.wire import GenerateResponse, RolloutSample

__all__ = ["NOT_SAMPLED_VERSION", "TrajectoryBuilder"]

NOT_SAMPLED_VERSION = -1  # policy_versions value of prompt/env/tool tokens


@dataclass
class _Segment:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)
    routed: list[bool] = field(default_factory=list)  # per token: its routing row is known
    # uint8|uint16 [>= tokens, layers, top_k]: one buffer, grown by doubling, so a turn's rows land
    # in one copy and a long episode holds no per-token arrays
    routing: np.ndarray | None = None

    def append(
        self,
        ids: list[int],
        *,
        sampled: bool,
        logprobs: list[float],
        temperature: float,
        versions: list[int],
        kv_versions: list[int],
    ) -> None:
        self.token_ids += ids
        self.loss_mask += [sampled] * len(ids)
        self.logprobs += logprobs
        self.temperatures += [temperature] * len(ids)
        self.versions += versions
        self.kv_versions += kv_versions
        self.routed += [False] * len(ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def trimmed(self) -> _Segment:
        """This segment up to and including its last sampled token."""
        end = len(self.loss_mask) - self.loss_mask[::-1].index(True)
        lists = {f: getattr(self, f)[:end] for f in _Segment.__dataclass_fields__ if f != "routing"}
        return _Segment(**lists, routing=None if self.routing is None else self.routing[:end])

    def known_routing_prefix(self) -> int:
        return self.routed.index(False) if False in self.routed else len(self.routed)

    def place_routing(self, rows_TLK: np.ndarray, start: int) -> None:
        """Rows [start, start + len(rows_TLK)) of the routing buffer, grown to hold every token."""
        end = start + rows_TLK.shape[0]
        if self.routing is None or self.routing.shape[0] < len(self.routed):
            grown = np.zeros(
                (max(len(self.routed), 2 * self._capacity()), *rows_TLK.shape[1:]), rows_TLK.dtype
            )
            if self.routing is not None:
                grown[: self.routing.shape[0]] = self.routing
            self.routing = grown
        self.routing[start:end] = rows_TLK
        self.routed[start:end] = [True] * (end - start)

    def _capacity(self) -> int:
        return 0 if self.routing is None else self.routing.shape[0]


class TrajectoryBuilder:
    """Accumulates one episode's tokens; `build` turns them into `RolloutSample`s (one per reset).

    Example (two turns; the env's reply is the suffix of the re-rendered chat)::

        traj = TrajectoryBuilder()
        prompt = traj.extend_prompt(tok.render(messages), temperature=1.0)
        traj.add_completion(await client.generate(prompt, sampling), temperature=1.0)
        messages += [assistant_msg, tool_msg]
        prompt = traj.extend_prompt(tok.render(messages), temperature=1.0)   # exact extension
    """

    def __init__(self) -> None:
        self._done: list[_Segment] = []
        self._cur = _Segment()
        self.num_resets = 0
        self._routing_shape: tuple[tuple[int, int], np.dtype] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self._cur.token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens in every sample of the episode so far."""
        return sum(len(s.token_ids) for s in self._done) + len(self._cur.token_ids)

    @property
    def routing_start(self) -> int:
        """Leading tokens of the current sample whose routing is already known (for
        `routed_experts_start`)."""
        return self._cur.known_routing_prefix()

    def extend_prompt(self, rendered: list[int], *, temperature: float) -> list[int]:
        """Make `rendered` the current prompt, extending the current sample or starting a new one."""
        have = self._cur.token_ids
        if have and (len(rendered) < len(have) or rendered[: len(have)] != have):
            self._done.append(self._cur)
            self._cur = _Segment()
            self.num_resets += 1
            have = self._cur.token_ids
        new = rendered[len(have) :]
        self._cur.append(
            new,
            sampled=False,
            logprobs=[0.0] * len(new),
            temperature=temperature,
            versions=[NOT_SAMPLED_VERSION] * len(new),
            kv_versions=[NOT_SAMPLED_VERSION] * len(new),
        )
        return list(self._cur.token_ids)

    def add_completion(self, response: GenerateResponse, *, temperature: float) -> None:
        """Append the sampled tokens and place the returned routing rows (prompt + completion positions)."""
        ids = response.token_ids  # a GenerateResponse has one logprob and one version per token
        context = response.context_version
        self._cur.append(
            list(ids),
            sampled=True,
            logprobs=list(response.logprobs),
            temperature=temperature,
            versions=list(response.policy_versions),
            kv_versions=list(response.policy_versions) if context is None else [context] * len(ids),
        )
        if response.routed_experts is not None:
            self._place_routing(response.routed_experts.to_array(), response.routed_experts.start)

    def _place_routing(self, rows_TLK: np.ndarray, start: int) -> None:
        key = (rows_TLK.shape[1:], rows_TLK.dtype)
        if self._routing_shape is not None and key != self._routing_shape:
            raise InferenceError(
                f"routed_experts changed shape/dtype within an episode: {key} vs {self._routing_shape}"
            )
        self._routing_shape = key
        end = start + rows_TLK.shape[0]
        if end > len(self._cur.routed):
            raise InferenceError(
                f"routed_experts rows [{start}, {end}) exceed the {len(self._cur.routed)} prompt + "
                "completion tokens"
            )
        self._cur.place_routing(rows_TLK, start)

    def build(
        self, *, reward: float, env: str, episode_id: str, metrics: dict[str, float]
    ) -> list[RolloutSample]:
        """One sample per stitched segment that holds at least one sampled token."""
        segments = [s.trimmed() for s in [*self._done, self._cur] if s.num_sampled > 0]
        samples = []
        for i, seg in enumerate(segments):
            routed, routing_metrics = _stack_routing(seg.routing, seg.routed)
            samples.append(
                RolloutSample(
                    token_ids=np.asarray(seg.token_ids, np.int32),
                    loss_mask=np.asarray(seg.loss_mask, np.bool_),
                    inference_logprobs=np.asarray(seg.logprobs, np.float32),
                    advantages=np.zeros(len(seg.token_ids), np.float32),
                    temperatures=np.asarray(seg.temperatures, np.float32),
                    policy_versions=np.asarray(seg.versions, np.int32),
                    kv_versions=np.asarray(seg.kv_versions, np.int32),
                    routed_experts=routed,
                    reward=reward,
                    env=env,
                    episode_id=episode_id if len(segments) == 1 else f"{episode_id}/{i}",
                    metrics={**metrics, **routing_metrics, "sample_index": float(i)},
                )
            )
        return samples


def _stack_routing(
    routing: np.ndarray | None, routed: list[bool]
) -> tuple[np.ndarray | None, dict[str, float]]:
    """[T, layers, top_k] when every row is known. The last token may lack routing: no step fed it
    to the model as input, and its routing only shapes logits past the sequence end (which no loss
    reads), so it is filled with the previous row and counted. Any other gap drops routing."""
    num_known = sum(routed)
    if routing is None or num_known == 0:
        return None, {}
    out = routing[: len(routed)].copy()
    if num_known == len(routed):
        return out, {}
    if num_known == len(routed) - 1 and not routed[-1] and len(routed) > 1:
        out[-1] = out[-2]
        return out, {"routing_filled_tokens": 1.0}
    return None, {"routing_missing_tokens": float(len(routed) - num_known)}

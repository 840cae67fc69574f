"""`dataset`: single-turn tasks read from disk (JSONL, JSON, Parquet, a save_to_disk directory).

    [[orchestrator.envs.envs]]
    name = "dataset"
    args.data = { path = "gsm.jsonl", prompt_field = "question", answer_field = "answer" }
    args.reward = "number"

The rows, splits and seeded order come from `asyncrl.envs.task_data.TaskTable` (see there for
every `data` setting). The reward compares the model's final text with the row's answer:
`exact` (stripped strings equal), `contains` (the answer appears in the reply), `number` (the
last number of the reply equals the answer, as `calculator` scores), or `lcs` (LCS ratio, partial
credit). An answer that is a list accepts any of its items. `exact` is always reported (a metric
when another reward is chosen). `reference(task)` is the answer, so `asyncrl sft-data` works.
For other rewards or multi-turn tasks, write a factory that calls `TaskTable.load` itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from asyncrl.envs.base import Environment, EpisodeState, Reward, Rubric, Split, Task
from asyncrl.envs.builtin.scoring import last_number, lcs_ratio
from asyncrl.envs.task_data import TaskDataConfig, TaskDataError, TaskTable

__all__ = ["DatasetEnv"]

RewardKind = Literal["exact", "contains", "number", "lcs"]


def _answers(state: EpisodeState) -> list[Any]:
    answer = state.task.answer
    return list(answer) if isinstance(answer, list) else [answer]


def _exact(state: EpisodeState) -> float:
    reply = state.final_text.strip()
    return float(any(reply == str(a).strip() for a in _answers(state)))


def _contains(state: EpisodeState) -> float:
    return float(any(str(a).strip() and str(a).strip() in state.final_text for a in _answers(state)))


def _number(state: EpisodeState) -> float:
    got = last_number(state.final_text)
    if got is None:
        return 0.0
    for a in _answers(state):
        want = a if isinstance(a, int | float) and not isinstance(a, bool) else last_number(str(a))
        if want is not None and math.isclose(got, float(want), rel_tol=1e-9, abs_tol=1e-9):
            return 1.0
    return 0.0


def _lcs(state: EpisodeState) -> float:
    reply = state.final_text.strip()
    return max(lcs_ratio(reply, str(a).strip()) for a in _answers(state))


_REWARDS: dict[str, Callable[[EpisodeState], float]] = {
    "exact": _exact,
    "contains": _contains,
    "number": _number,
    "lcs": _lcs,
}


class DatasetEnv(Environment):
    name = "dataset"

    def __init__(
        self, *, data: dict[str, Any] | TaskDataConfig, reward: RewardKind = "exact", seed: int = 0
    ) -> None:
        if reward not in _REWARDS:
            raise TaskDataError(f"dataset: unknown reward {reward!r}; choose one of {sorted(_REWARDS)}")
        super().__init__(seed=seed)
        self.table = TaskTable.load(data, seed=seed)
        if not self.table.config.answer_field:
            raise TaskDataError(
                f"dataset: reward {reward!r} compares with the answer, but data.answer_field is empty"
            )
        rewards = [Reward(name=reward, fn=_REWARDS[reward])]
        if reward != "exact":
            rewards.append(Reward(name="exact", fn=_exact, weight=0.0))
        self.rubric = Rubric(rewards=tuple(rewards))

    def task(self, split: Split, index: int) -> Task:
        row = self.table.row(split, index)
        return Task(
            id=f"{self.name}/{split}/{index}",
            prompt=[dict(m) for m in row.prompt],
            answer=row.answer,
            info={"row": row.row, "where": row.where},
        )

    def reference(self, task: Task) -> list[dict[str, Any]]:
        answer = task.answer[0] if isinstance(task.answer, list) else task.answer
        return [{"role": "assistant", "content": str(answer)}]

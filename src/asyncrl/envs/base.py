"""The environment protocol: tasks, per-episode state, tools, the env's replies, and a reward rubric.

An environment is a class with:
- `task(split, index)`: a deterministic `Task` for (seed, split, index); train and eval never overlap.
- `tools(state)`: the tools of one episode (bound to its state, e.g. its sandbox directory).
- `respond(state, text)`: called when the model ends a turn without tool calls. Return messages to
  continue the episode, or None when it is over (the default: single-turn, or "answered"). A tool
  may also end it: `state.done = True` stops the episode ("done") after that turn's tool calls.
- `rubric`: named reward functions with weights; the episode reward is their weighted sum.
- `reference(task)`: assistant/tool messages that solve the task, for SFT data generation.
- `setup(task)` / `teardown(state)`: per-episode resources.

The rollout loop (`asyncrl.envs.rollout`) drives these; environments never see token ids.
"""

from __future__ import annotations

import hashlib
import inspect
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from asyncrl.envs.tools import Tool

__all__ = [
    "EnvConfigError",
    "Environment",
    "EpisodeState",
    "ReferenceExample",
    "Reward",
    "Rubric",
    "Split",
    "Task",
    "iter_reference_examples",
    "split_of",
    "task_rng",
]


class EnvConfigError(ValueError):
    """An environment name, factory path or argument in the config is wrong; the message says which."""


Split = Literal["train", "eval"]
T = TypeVar("T")
Message = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Task:
    """One problem. `prompt` is the opening messages; `answer` is whatever the rubric needs.

    Example::

        Task(id="reverse-text/train/17", prompt=[{"role": "user", "content": "Reverse: abc"}], answer="cba")
    """

    id: str
    prompt: list[Message]
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class EpisodeState:
    """Mutable state of one episode, shared by the rollout loop, tools, `respond` and rewards."""

    task: Task
    messages: list[Message]
    num_turns: int = 0
    final_text: str = ""  # text of the last assistant turn
    stop_reason: str | None = None  # how the loop ended ("done", "max_turns", ...), set before scoring
    done: bool = False  # set by a tool (e.g. a "submit"): the episode ends after this turn's tool calls
    data: dict[str, Any] = field(default_factory=dict)  # env-specific (e.g. the sandbox)


@dataclass(frozen=True, kw_only=True)
class Reward:
    """A named score of an episode. weight 0 makes it a metric: reported, not part of the reward."""

    name: str
    fn: Callable[[EpisodeState], float | Awaitable[float]]
    weight: float = 1.0


@dataclass(frozen=True, kw_only=True)
class Rubric:
    rewards: tuple[Reward, ...]

    async def score(self, state: EpisodeState) -> tuple[float, dict[str, float]]:
        """(weighted reward, {name: value}) for a finished episode."""
        values: dict[str, float] = {}
        for r in self.rewards:
            value = r.fn(state)
            values[r.name] = float(await value if inspect.isawaitable(value) else value)
        return sum(r.weight * values[r.name] for r in self.rewards), values


def task_rng(seed: int, env: str, split: Split, index: int) -> random.Random:
    """A generator private to one task: task content depends only on (seed, env, split, index)."""
    digest = hashlib.sha256(f"{seed}/{env}/{split}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def split_of(key: str) -> Split:
    """The split a task's content belongs to (1 in 8 to eval), so the splits never share a task."""
    return "eval" if hashlib.sha256(key.encode()).digest()[0] % 8 == 0 else "train"


def draw_in_split(
    draw: Callable[[], T], key: Callable[[T], str], split: Split, *, env: str, max_draws: int = 10_000
) -> T:
    """Redraw until the content belongs to `split` (rejection keeps the splits disjoint).

    A task space too small to give both splits content (say one letter from 8) would loop forever;
    after `max_draws` this raises a ValueError that tells the user to widen the env's arguments.
    """
    for _ in range(max_draws):
        value = draw()
        if split_of(key(value)) == split:
            return value
    raise ValueError(
        f"{env}: no task of the '{split}' split in {max_draws} draws; the task space is too small to "
        "split into disjoint train and eval sets: widen the environment's arguments"
    )


class Environment(ABC):
    """Base class of every environment; subclasses set `name`, `rubric` and implement `task`."""

    name: ClassVar[str]
    rubric: Rubric
    max_turns: int = 1

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed

    @abstractmethod
    def task(self, split: Split, index: int) -> Task: ...

    @abstractmethod
    def reference(self, task: Task) -> list[Message]:
        """Messages after `task.prompt` that solve the task (assistant turns, and tool results if any)."""

    def tools(self, state: EpisodeState) -> list[Tool]:
        return []

    async def setup(self, task: Task) -> EpisodeState:
        return EpisodeState(task=task, messages=list(task.prompt))

    async def respond(self, state: EpisodeState, text: str) -> list[Message] | None:
        return None

    async def teardown(self, state: EpisodeState) -> None:
        return None

    def tasks(self, split: Split, num: int, start: int = 0) -> Iterator[Task]:
        for index in range(start, start + num):
            yield self.task(split, index)


@dataclass(frozen=True, kw_only=True)
class ReferenceExample:
    """An SFT example: render `prompt + completion` with the chat template, train on the assistant turns."""

    prompt: list[Message]
    completion: list[Message]
    tools: list[dict[str, Any]]
    task_id: str


def iter_reference_examples(
    env: Environment, split: Split, num: int, start: int = 0
) -> Iterator[ReferenceExample]:
    """(prompt, reference completion) pairs for the trainer's SFT warm-up."""
    for task in env.tasks(split, num, start):
        state = EpisodeState(task=task, messages=list(task.prompt))
        yield ReferenceExample(
            prompt=list(task.prompt),
            completion=env.reference(task),
            tools=[t.schema for t in env.tools(state)],
            task_id=task.id,
        )

"""Single-turn: reverse a word. Reward 1 for the exact reversal, and a length metric."""

import verifiers.v1 as vf

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "maple",
    "tiger",
    "piano",
    "lemon",
    "ocean",
    "brick",
    "candle",
    "forest",
    "silver",
    "garden",
    "planet",
    "window",
]


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 16
    """How many tasks to build."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        return [
            ReverseTask(ReverseData(prompt=f"Reverse the word: {w}", answer=w[::-1]))
            for w in WORDS[: self.config.num_tasks]
        ]


__all__ = ["ReverseTaskset"]

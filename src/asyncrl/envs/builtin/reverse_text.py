"""`reverse-text`: reverse a short lowercase string; reward = LCS ratio. The learnable demo task.

Prompts are kept tiny for ~2M-parameter byte-level models: `reverse: abcde` -> `edcba`.
"""

from __future__ import annotations

import string

from asyncrl.envs.base import Environment, EpisodeState, Reward, Rubric, Split, Task, draw_in_split, task_rng
from asyncrl.envs.builtin.scoring import lcs_ratio

__all__ = ["ReverseTextEnv"]


def _lcs_reward(state: EpisodeState) -> float:
    return lcs_ratio(state.final_text.strip(), state.task.answer)


def _exact(state: EpisodeState) -> float:
    return float(state.final_text.strip() == state.task.answer)


class ReverseTextEnv(Environment):
    name = "reverse-text"
    rubric = Rubric(rewards=(Reward(name="lcs", fn=_lcs_reward), Reward(name="exact", fn=_exact, weight=0.0)))

    def __init__(
        self, *, seed: int = 0, min_len: int = 3, max_len: int = 8, alphabet: str = string.ascii_lowercase
    ) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(
                f"reverse-text: need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}"
            )
        if len(set(alphabet)) < 2:
            raise ValueError(f"reverse-text: alphabet needs at least 2 distinct characters, got {alphabet!r}")
        super().__init__(seed=seed)
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet

    def task(self, split: Split, index: int) -> Task:
        rng = task_rng(self.seed, self.name, split, index)
        text = draw_in_split(
            lambda: "".join(
                rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len))
            ),
            lambda t: f"{self.name}/{t}",
            split,
            env=f"{self.name} (min_len={self.min_len}, max_len={self.max_len}, alphabet={self.alphabet!r})",
        )
        prompt = [{"role": "user", "content": f"reverse: {text}"}]
        return Task(id=f"{self.name}/{split}/{index}", prompt=prompt, answer=text[::-1])

    def reference(self, task: Task) -> list[dict]:
        return [{"role": "assistant", "content": task.answer}]

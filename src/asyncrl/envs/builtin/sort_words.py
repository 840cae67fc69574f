"""`sort-words`: sort a few words alphabetically; exact credit plus partial (LCS over words) credit."""

from __future__ import annotations

from asyncrl.envs.base import Environment, EpisodeState, Reward, Rubric, Split, Task, draw_in_split, task_rng
from asyncrl.envs.builtin.scoring import lcs_ratio

__all__ = ["WORDS", "SortWordsEnv"]

WORDS = [
    "apple",
    "bird",
    "cake",
    "door",
    "egg",
    "fish",
    "goat",
    "hat",
    "ink",
    "jam",
    "kite",
    "lamp",
    "moon",
    "nest",
    "owl",
    "pear",
    "queen",
    "rose",
    "sun",
    "tree",
    "umbrella",
    "vase",
    "wolf",
    "yarn",
    "zebra",
    "bread",
    "cloud",
    "drum",
    "fox",
    "grape",
    "hill",
    "iron",
    "leaf",
    "milk",
    "note",
    "ocean",
    "pig",
    "rain",
    "salt",
    "tiger",
    "wind",
]


def _words(text: str) -> list[str]:
    return text.replace(",", " ").lower().split()


def _exact(state: EpisodeState) -> float:
    return float(_words(state.final_text) == state.task.answer)


def _partial(state: EpisodeState) -> float:
    return lcs_ratio(_words(state.final_text), state.task.answer)


class SortWordsEnv(Environment):
    name = "sort-words"
    rubric = Rubric(
        rewards=(Reward(name="exact", fn=_exact, weight=0.5), Reward(name="partial", fn=_partial, weight=0.5))
    )

    def __init__(self, *, seed: int = 0, min_words: int = 3, max_words: int = 6) -> None:
        if not 2 <= min_words <= max_words <= len(WORDS):
            raise ValueError(
                f"sort-words: need 2 <= min_words <= max_words <= {len(WORDS)}, got {min_words}, {max_words}"
            )
        super().__init__(seed=seed)
        self.min_words, self.max_words = min_words, max_words

    def task(self, split: Split, index: int) -> Task:
        rng = task_rng(self.seed, self.name, split, index)
        words = draw_in_split(
            lambda: rng.sample(WORDS, rng.randint(self.min_words, self.max_words)),
            lambda w: f"{self.name}/{' '.join(sorted(w))}",
            split,
            env=self.name,
        )
        prompt = [{"role": "user", "content": f"sort: {' '.join(words)}"}]
        return Task(id=f"{self.name}/{split}/{index}", prompt=prompt, answer=sorted(words))

    def reference(self, task: Task) -> list[dict]:
        return [{"role": "assistant", "content": " ".join(task.answer)}]

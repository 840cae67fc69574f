"""Reward functions on known answers."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.envs import EpisodeState, ToolError, build_env
from asyncrl.envs.builtin.calculator import calc, safe_eval
from asyncrl.envs.builtin.scoring import last_number, lcs_length, lcs_ratio


def _score(env, task, final_text, messages=None):
    state = EpisodeState(task=task, messages=messages or list(task.prompt), final_text=final_text)
    return asyncio.run(env.rubric.score(state))


def test_lcs():
    assert lcs_length("abcde", "ace") == 3
    assert lcs_length("", "abc") == 0
    assert lcs_ratio("abc", "abc") == 1.0
    assert lcs_ratio("abd", "abc") == pytest.approx(2 / 3)
    assert lcs_ratio("abcxyz", "abc") == pytest.approx(0.5)  # extra output costs too
    assert lcs_ratio("", "") == 1.0
    assert (
        last_number("so 3 + 4 = 7.") == 7.0 and last_number("1,234") == 1234.0 and last_number("none") is None
    )


def test_reverse_text_reward():
    env = build_env("reverse-text")
    task = env.task("train", 0)
    assert task.prompt[0]["content"] == f"reverse: {task.answer[::-1]}"
    assert _score(env, task, f" {task.answer}\n") == (1.0, {"lcs": 1.0, "exact": 1.0})
    total, parts = _score(env, task, task.answer[:-1])
    assert total == pytest.approx((len(task.answer) - 1) / len(task.answer)) and parts["exact"] == 0.0


def test_sort_words_reward():
    env = build_env("sort-words")
    task = env.task("train", 0)
    words = task.answer
    assert _score(env, task, " ".join(words))[0] == 1.0
    swapped = [words[1], words[0], *words[2:]]
    total, parts = _score(env, task, ", ".join(swapped))
    assert parts == {"exact": 0.0, "partial": pytest.approx((len(words) - 1) / len(words))}
    assert total == pytest.approx(0.5 * parts["partial"])
    assert _score(env, task, "")[0] == 0.0


def test_calculator_reward_and_tool():
    env = build_env("calculator")
    task = env.task("train", 3)
    answer = int(task.answer)
    assert answer == eval(task.info["expression"])  # the generator's own answer is right
    used = [*task.prompt, {"role": "tool", "name": "calc", "content": str(answer)}]
    assert _score(env, task, f"It is {answer}.", used) == (1.0, {"correct": 1.0, "used_calc": 1.0})
    assert _score(env, task, str(answer + 1))[0] == 0.0
    assert _score(env, task, f'<tool_call>{{"name": "calc"}}</tool_call> {answer}')[0] == 0.0
    assert calc("3 * (4 + 5)") == "27" and calc("7 / 2") == "3.5" and calc("-2 ** 3") == "-8"
    for bad in ("__import__('os')", "2 ** 1000", "1 / 0", "x + 1", "3 +"):
        with pytest.raises(ToolError):
            safe_eval(bad)

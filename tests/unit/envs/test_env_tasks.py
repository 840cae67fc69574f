"""Task generation is deterministic under a seed, and the train/eval splits never share a task."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.envs import EpisodeState, available_envs, build_env, iter_reference_examples

BUILTINS = ["calculator", "long-context", "reverse-text", "sort-words", "swe-lite"]


def _key(task):
    return (repr(task.prompt), repr(task.answer), repr(task.info))


@pytest.mark.parametrize("name", BUILTINS)
def test_tasks_are_deterministic_and_splits_disjoint(name):
    env_a, env_b, env_c = build_env(name, seed=7), build_env(name, seed=7), build_env(name, seed=8)
    train = [env_a.task("train", i) for i in range(40)]
    assert [_key(t) for t in train] == [_key(env_b.task("train", i)) for i in range(40)]
    assert [t.id for t in train] == [f"{name}/train/{i}" for i in range(40)]
    assert [_key(t) for t in train] != [_key(env_c.task("train", i)) for i in range(40)]
    evals = {_key(env_a.task("eval", i)) for i in range(40)}
    assert not evals & {_key(t) for t in train}
    assert len({_key(t) for t in train}) > (5 if name == "swe-lite" else 30)  # varied tasks


def test_reverse_text_strings_are_short_lowercase():
    env = build_env("reverse-text", seed=0)
    answers = [env.task("train", i).answer for i in range(200)]
    assert all(3 <= len(a) <= 8 and a.isalpha() and a.islower() for a in answers)
    assert {len(a) for a in answers} == set(range(3, 9))


@pytest.mark.parametrize("name", BUILTINS)
def test_reference_examples(name):
    env = build_env(name)
    examples = list(iter_reference_examples(env, "train", 3))
    assert len(examples) == 3 and examples[0].task_id == f"{name}/train/0"
    for ex in examples:
        assert ex.completion[-1]["role"] == "assistant" and ex.prompt[-1]["role"] == "user"
        assert bool(ex.tools) == (name in ("calculator", "long-context", "swe-lite"))
        if name != "swe-lite":  # swe-lite's reference is replayed in tests/integration/envs
            state = EpisodeState(
                task=env.task("train", int(ex.task_id.rsplit("/", 1)[1])), messages=ex.prompt + ex.completion
            )
            state.final_text = ex.completion[-1]["content"]
            assert asyncio.run(env.rubric.score(state))[0] == 1.0


def test_builtins_are_registered():
    assert set(BUILTINS) <= set(available_envs())


def test_a_task_space_too_small_for_both_splits_is_a_clear_error():
    env = build_env("reverse-text", {"min_len": 1, "max_len": 1, "alphabet": "ab"}, seed=0)
    splits = {env.task("train", 0).answer, env.task("train", 1).answer}
    assert splits <= {"a", "b"}
    with pytest.raises(
        ValueError, match=r"reverse-text \(min_len=1, max_len=1, alphabet='ab'\): no task of the 'eval' split"
    ):
        env.task("eval", 0)

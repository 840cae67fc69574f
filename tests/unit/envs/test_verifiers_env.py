"""verifiers environments (tests/vf_envs, written as verifiers' docs show) through asyncrl's rollout loop."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is an optional extra: pip install -e '.[verifiers]'")

from asyncrl.config import EnvConfig
from asyncrl.envs import EnvConfigError, ScriptedClient, TokenPolicy, build_env, run_episode
from asyncrl.wire import SamplingParams


def _run(env, task, tokenizer, replies, episode_id="ep"):
    cfg = EnvConfig(name="verifiers:x", max_turns=4)
    client = ScriptedClient(tokenizer, replies)
    policy = TokenPolicy(client, tokenizer, SamplingParams(max_tokens=256), config=cfg)
    return asyncio.run(run_episode(env, task, policy, config=cfg, episode_id=episode_id)), client


def test_single_turn_taskset_rewards_and_metrics(tokenizer):
    env = build_env("verifiers:vf_envs.vf_reverse", {"num_tasks": 16}, seed=0)
    task = env.task("train", 0)
    word = task.prompt[-1]["content"].split()[-1]
    right, client = _run(env, task, tokenizer, [word[::-1]])
    assert right.error is None and right.reward == 1.0
    assert right.rewards == {"exact": 1.0, "reply_chars": float(len(word))}
    (sample,) = right.samples  # one exact sample: prompt ids + the sampled ids, as the client returned them
    assert sample.token_ids[: len(client.calls[0])].tolist() == client.calls[0]
    assert int(sample.loss_mask.sum()) == len(tokenizer.encode(word[::-1])) + 1
    wrong, _ = _run(env, task, tokenizer, ["nope"])
    assert wrong.reward == 0.0 and wrong.rewards["exact"] == 0.0


def test_splits_are_disjoint_deterministic_and_shuffled_by_seed():
    env = build_env("verifiers:vf_envs.vf_reverse", {"num_tasks": 16}, seed=0)
    again = build_env("verifiers:vf_envs.vf_reverse", {"num_tasks": 16}, seed=0)
    other = build_env("verifiers:vf_envs.vf_reverse", {"num_tasks": 16}, seed=1)
    words = {s: [env.task(s, i).info["key"] for i in range(len(env._splits[s]))] for s in ("train", "eval")}
    assert words["train"] and words["eval"] and not set(words["train"]) & set(words["eval"])
    assert len(words["train"]) + len(words["eval"]) == 16
    assert [again.task("train", i).info["key"] for i in range(len(words["train"]))] == words["train"]
    assert [other.task("train", i).info["key"] for i in range(len(words["train"]))] != words["train"]


def test_multi_turn_tool_episode_is_one_exact_sample(tokenizer):
    env = build_env("verifiers:vf_envs.vf_adder", {"num_tasks": 8}, seed=0)
    task = env.task("train", 1)
    data = task.info["vf_task"].data
    call = f'<tool_call>{{"name": "calc_add", "arguments": {{"a": {data.a}, "b": {data.b}}}}}</tool_call>'
    episode, client = _run(env, task, tokenizer, [call, f"The answer is {data.a + data.b}"])
    assert episode.error is None, episode.error
    assert episode.rewards == {"correct": 1.0, "used_tool": 1.0, "num_tool_results": 1.0}
    assert episode.reward == 1.0 and episode.metrics["num_tool_calls"] == 1.0
    assert episode.messages[2] == {"role": "tool", "name": "calc_add", "content": str(data.a + data.b)}
    (sample,) = episode.samples  # turn 2's prompt extends turn 1's ids: stitched, not re-tokenized
    assert sample.token_ids[: len(client.calls[1])].tolist() == client.calls[1]
    assert episode.metrics["num_resets"] == 0.0
    wrong, _ = _run(env, task, tokenizer, ["I think 1000"])
    assert (
        wrong.rewards == {"correct": 0.0, "used_tool": 0.0, "num_tool_results": 0.0} and wrong.reward == 0.0
    )


def test_partial_credit_uses_the_reward_weights(tokenizer):
    env = build_env("verifiers:vf_envs.vf_adder", {"num_tasks": 8}, seed=0)
    task = env.task("train", 1)
    call = '<tool_call>{"name": "calc_add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    episode, _ = _run(env, task, tokenizer, [call, "The answer is 2"])
    assert episode.rewards["used_tool"] == 1.0 and episode.rewards["correct"] == 0.0
    assert episode.reward == pytest.approx(0.25)


def test_a_raising_environment_fails_its_episode_only(tokenizer):
    env = build_env("verifiers:vf_envs.vf_adder", {"num_tasks": 8, "fail_scoring": True}, seed=0)
    episode, _ = _run(env, env.task("train", 0), tokenizer, ["42"])
    assert episode.failed and episode.reward == 0.0 and episode.stop_reason == "error"
    assert "TypeError" in episode.error and episode.samples  # kept for inspection


def test_bad_names_and_args_are_clear():
    with pytest.raises(EnvConfigError, match="cannot import"):
        build_env("verifiers:vf_envs.no_such_module")
    with pytest.raises(EnvConfigError, match="num_taskz"):
        build_env("verifiers:vf_envs.vf_reverse", {"num_taskz": 3})
    with pytest.raises(EnvConfigError, match="exactly one vf.Taskset"):
        build_env("verifiers:vf_envs")
    with pytest.raises(EnvConfigError, match="needs a module"):
        build_env("verifiers:")


def test_an_empty_split_is_an_error_not_the_other_split():
    env = build_env("verifiers:vf_envs.vf_reverse", {"num_tasks": 2}, seed=0)
    sizes = {s: len(env._splits[s]) for s in ("train", "eval")}
    assert sizes == {"train": 2, "eval": 0}  # 2 words, neither hashed to eval
    assert env.task("train", 3).info["key"] in {t.key for t in env._splits["train"]}
    with pytest.raises(ValueError, match=r"no eval tasks; its 2 tasks are split by Task.key"):
        env.task("eval", 0)

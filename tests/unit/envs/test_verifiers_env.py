"""verifiers environments (tests/vf_envs, written as verifiers' docs show) through asyncrl's rollout loop."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is an optional extra: pip install -e '.[verifiers]'")

from asyncrl.config import EnvConfig
from asyncrl.envs import EnvConfigError, ScriptedClient, TokenPolicy, build_env, run_episode
from asyncrl.envs.verifiers_env import build_trace
from asyncrl.wire import GenerateResponse, SamplingParams


def _run(env, task, tokenizer, replies, episode_id="ep", cfg=None, client_cls=ScriptedClient):
    cfg = cfg or EnvConfig(name="verifiers:x", max_turns=4)
    client = client_cls(tokenizer, replies)
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


def _probe(tokenizer, replies, **cfg):
    from vf_envs import vf_probe

    vf_probe.SCORED.clear()
    env = build_env("verifiers:vf_envs.vf_probe", {}, seed=0)
    config = EnvConfig(name="verifiers:x", **({"max_turns": 4, "max_tokens_per_turn": 512} | cfg))
    episode, client = _run(env, env.task("train", 0), tokenizer, replies, cfg=config)
    assert episode.error is None, episode.error
    (trace,) = vf_probe.SCORED
    return episode, trace, client


def test_every_tool_result_answers_its_own_call_malformed_ones_included(tokenizer):
    bad_json = '{"name": "probe_echo", "arguments": {"text": "a",}}'
    turn = (
        f"Checking. <tool_call>{bad_json}</tool_call> "
        '<tool_call>{"name": "probe_echo", "arguments": {"text": "b"}}</tool_call> '
        '<tool_call>{"name": "probe_echo", "arguments": "oops"}</tool_call> '
        '<tool_call>{"name": "probe_nope", "arguments": {}}</tool_call>'
    )
    episode, trace, _ = _probe(tokenizer, [turn, "done"])
    first, last = trace.assistant_messages
    assert first.content == "Checking." and last.content == "done" and last.tool_calls is None
    calls = first.tool_calls  # one per <tool_call>, in the order written, each with its own id
    assert [(c.name, c.arguments) for c in calls] == [
        ("", bad_json),  # unparseable: the whole call, exactly as written
        ("probe_echo", '{"text": "b"}'),
        ("probe_echo", "oops"),  # arguments as written, not an object
        ("probe_nope", "{}"),
    ]
    assert len({c.id for c in calls}) == 4
    results = trace.tool_messages  # a rubric pairs results with calls by id
    assert [m.tool_call_id for m in results] == [c.id for c in calls]
    by_id = {m.tool_call_id: m.content for m in results}
    assert by_id[calls[1].id] == "b"
    assert by_id[calls[0].id].startswith("error: malformed tool call (invalid JSON")
    assert by_id[calls[2].id] == "error: malformed tool call: 'arguments' must be an object"
    assert by_id[calls[3].id].startswith("error: unknown tool 'probe_nope'")
    assert [m.name for m in results] == [None, "probe_echo", "probe_echo", "probe_nope"]
    assert episode.metrics["num_tool_calls"] == 4 and episode.metrics["num_tool_errors"] == 3


def test_calls_are_text_when_the_env_has_no_tools(tokenizer):
    env = build_env("verifiers:vf_envs.vf_reverse", {"num_tasks": 16}, seed=0)
    task = env.task("train", 0)
    word = task.prompt[-1]["content"].split()[-1]
    reply = f'<tool_call>{{"name": "x", "arguments": {{}}}}</tool_call>{word[::-1]}'
    episode, _ = _run(env, task, tokenizer, [reply])  # no tools: nothing ran, the reply is all text
    assert episode.stop_reason == "done" and episode.metrics["num_tool_calls"] == 0
    assert episode.rewards == {"exact": 0.0, "reply_chars": float(len(reply))}


class _AbortingClient(ScriptedClient):
    async def _answer(self, request):
        response: GenerateResponse = await super()._answer(request)
        return response.model_copy(update={"finish_reason": "abort"})


def test_the_trace_says_how_the_episode_ended(tokenizer):
    echo = '<tool_call>{"name": "probe_echo", "arguments": {"text": "hi"}}</tool_call>'
    wait = '<tool_call>{"name": "probe_wait", "arguments": {}}</tool_call>'

    def seen(trace):
        return (trace.is_completed, trace.stop_condition, trace.is_truncated, trace.is_timeout, trace.ok)

    done, trace, client = _probe(tokenizer, [echo, "done"])
    assert done.stop_reason == "done" and done.rewards["finished"] == 1.0
    assert seen(trace) == (True, "agent_completed", False, False, True)

    cut, trace, _ = _probe(tokenizer, [echo, "done"], max_turns=1)
    assert cut.stop_reason == "max_turns" and cut.rewards["finished"] == 0.0
    assert seen(trace) == (True, "max_turns", True, False, True)

    budget = len(client.calls[1])  # the second prompt no longer fits: stopped before turn 2
    cut, trace, _ = _probe(tokenizer, [echo, "done"], max_total_tokens=budget)
    assert cut.stop_reason == "max_tokens" and cut.rewards["finished"] == 0.0
    assert seen(trace) == (True, "max_total_tokens", True, False, True)

    cut, trace, _ = _probe(tokenizer, [wait, "done"], deadline_s=0.2, tool_timeout_s=60)
    assert cut.stop_reason == "deadline" and cut.rewards["finished"] == 0.0
    assert seen(trace) == (True, "agent_timeout", False, True, True)
    assert trace.assistant_messages[-1].tool_calls[0].name == "probe_wait" and not trace.tool_messages


def test_an_aborted_episode_is_a_failed_model_call_to_verifiers(tokenizer):
    from vf_envs import vf_probe

    vf_probe.SCORED.clear()
    env = build_env("verifiers:vf_envs.vf_probe", {}, seed=0)
    episode, _ = _run(env, env.task("train", 0), tokenizer, ["done"], client_cls=_AbortingClient)
    (trace,) = vf_probe.SCORED
    assert episode.stop_reason == "aborted" and episode.rewards["finished"] == 0.0
    assert trace.stop_condition == "provider_error" and not trace.ok
    assert trace.errors[-1].type == "ProviderError"


def test_a_context_limit_stop_is_an_input_token_limit_to_verifiers(tokenizer):
    env = build_env("verifiers:vf_envs.vf_probe", {}, seed=0)
    vf_task = env.task("train", 0).info["vf_task"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "done"}]
    trace = build_trace(vf_task, messages, stop_reason="context_limit", calls_ran=True)
    assert (trace.is_completed, trace.stop_condition, trace.is_truncated) == (True, "max_input_tokens", True)

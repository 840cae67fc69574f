"""Stitching invariants: exact tokens, mask only on sampled tokens, versions/logprobs/routing carried."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from asyncrl.config import EnvConfig
from asyncrl.envs import (
    NOT_SAMPLED_VERSION,
    ScriptedClient,
    TokenPolicy,
    TrajectoryBuilder,
    build_env,
    run_episode,
)
from asyncrl.envs.scripted import scripted_routing
from asyncrl.wire import GenerateResponse, RoutedExperts, SamplingParams

ROUTING = (3, 2, 8)  # layers, top_k, experts


def _calc_script(expression: str, answer: str):
    replies = [
        "<tool_call>"
        + json.dumps({"name": "calc", "arguments": {"expression": expression}})
        + "</tool_call>",
        "<tool_call>" + json.dumps({"name": "nope", "arguments": {}}) + "</tool_call>",  # a tool error turn
        f"The answer is {answer}",
    ]
    return replies


def _run(env, task, client, tokenizer, cfg, *, routing=False, temperature=0.7):
    sampling = SamplingParams(temperature=temperature, max_tokens=256)
    policy = TokenPolicy(
        client, tokenizer, sampling, config=cfg, cache_salt="3", return_routed_experts=routing
    )
    return asyncio.run(run_episode(env, task, policy, config=cfg, episode_id="ep-0"))


def test_multi_turn_stitching_is_exact(tokenizer):
    env = build_env("calculator", seed=1)
    task = env.task("train", 5)
    replies = _calc_script(task.info["expression"], str(int(task.answer)))

    def script(i: int, prompt: list[int]) -> str:
        client.version = 10 + i  # a weight update lands between every two turns
        return replies[i]

    client = ScriptedClient(tokenizer, script, routing=ROUTING, route_last_token=False)
    cfg = EnvConfig(name="calculator")
    ep = _run(env, task, client, tokenizer, cfg, routing=True)

    assert ep.stop_reason == "done" and ep.reward == 1.0 and ep.error is None
    assert (
        ep.metrics["num_turns"] == 3
        and ep.metrics["num_tool_calls"] == 2
        and ep.metrics["num_tool_errors"] == 1
    )
    assert ep.metrics["num_resets"] == 0
    (sample,) = ep.samples
    ids = sample.token_ids.tolist()
    # The sample is exactly the chat template's rendering of the whole conversation (minus the
    # trailing newline the template adds after the final <|im_end|>).
    full = tokenizer.render(ep.messages, [t.schema for t in env.tools(None)], add_generation_prompt=False)
    assert ids == full[: len(ids)] and full[len(ids) :] == tokenizer.encode("\n")
    expected_mask = np.zeros(len(ids), bool)
    for k, prompt in enumerate(client.calls):
        assert ids[: len(prompt)] == prompt  # each turn's prompt is a prefix: never re-tokenized
        completion = [*tokenizer.encode(replies[k]), tokenizer.eos_token_id]
        end = len(prompt) + len(completion)
        assert ids[len(prompt) : end] == completion
        expected_mask[len(prompt) : end] = True
        assert (sample.policy_versions[len(prompt) : end] == 10 + k).all()
        np.testing.assert_allclose(
            sample.inference_logprobs[len(prompt) : end],
            [-0.01 * (i + 1) for i in range(len(completion))],
            rtol=1e-6,
        )
    np.testing.assert_array_equal(sample.loss_mask, expected_mask)
    assert (sample.policy_versions[~expected_mask] == NOT_SAMPLED_VERSION).all()
    assert (sample.inference_logprobs[~expected_mask] == 0).all()
    assert np.allclose(sample.temperatures, 0.7) and (sample.advantages == 0).all()
    assert sample.reward == 1.0 and sample.env == "calculator" and sample.episode_id == "ep-0"
    # Routing covers every token, [T, layers, top_k]; the final sampled token (never fed forward) is filled.
    assert sample.routed_experts.shape == (len(ids), ROUTING[0], ROUTING[1])
    np.testing.assert_array_equal(sample.routed_experts[:-1], scripted_routing(ids[:-1], 0, *ROUTING))
    assert sample.metrics["routing_filled_tokens"] == 1.0


def test_routing_from_an_engine_that_routes_every_token(tokenizer):
    env = build_env("calculator", seed=1)
    task = env.task("train", 6)
    replies = _calc_script(task.info["expression"], str(int(task.answer)))
    client = ScriptedClient(tokenizer, replies, routing=ROUTING, route_last_token=True)
    ep = _run(env, task, client, tokenizer, EnvConfig(name="calculator"), routing=True)
    (sample,) = ep.samples
    ids = sample.token_ids.tolist()
    np.testing.assert_array_equal(sample.routed_experts, scripted_routing(ids, 0, *ROUTING))
    assert "routing_filled_tokens" not in sample.metrics and "routing_missing_tokens" not in sample.metrics


@pytest.mark.parametrize("forget_turn", [1, 2])
def test_routing_gap_heals_on_the_next_turn_or_drops_routing(tokenizer, forget_turn):
    env = build_env("calculator", seed=1)
    task = env.task("train", 6)
    replies = _calc_script(task.info["expression"], str(int(task.answer)))

    class ForgetfulClient(ScriptedClient):
        async def generate(self, prompt_token_ids, sampling, **kwargs):
            if len(self.calls) == forget_turn:
                kwargs["return_routed_experts"] = False  # this turn comes back without routing
            return await super().generate(prompt_token_ids, sampling, **kwargs)

    client = ForgetfulClient(tokenizer, replies, routing=ROUTING)
    ep = _run(env, task, client, tokenizer, EnvConfig(name="calculator"), routing=True)
    (sample,) = ep.samples
    if forget_turn < len(replies) - 1:  # the next turn asks again from the first unknown token
        ids = sample.token_ids.tolist()
        np.testing.assert_array_equal(sample.routed_experts, scripted_routing(ids, 0, *ROUTING))
    else:
        assert sample.routed_experts is None and sample.metrics["routing_missing_tokens"] > 0


def test_template_mismatch_starts_new_sample_and_keeps_every_sampled_token(tokenizer):
    env = build_env("calculator", seed=0)
    task = env.task("train", 0)
    # A special token inside the text: decoding drops it, so the re-rendered history cannot match.
    replies = [
        '<|im_start|><tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>',
        "42",
    ]
    client = ScriptedClient(tokenizer, replies)
    ep = _run(env, task, client, tokenizer, EnvConfig(name="calculator"))
    assert ep.metrics["num_resets"] == 1
    assert len(ep.samples) == 2
    assert [s.episode_id for s in ep.samples] == ["ep-0/0", "ep-0/1"]
    completions = [[*tokenizer.encode(r), tokenizer.eos_token_id] for r in replies]
    for sample, prompt, completion in zip(ep.samples, client.calls, completions):
        assert sample.token_ids.tolist() == prompt + completion
        assert sample.loss_mask.sum() == len(completion) and sample.loss_mask[len(prompt) :].all()
    assert int(sum(s.loss_mask.sum() for s in ep.samples)) == ep.metrics["num_completion_tokens"]


def test_bridge_stitching_keeps_sampled_ids_when_text_does_not_round_trip(tokenizer):
    env = build_env("calculator", seed=0)
    task = env.task("train", 0)
    replies = [
        '<|im_start|><tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>',
        "42",
    ]
    client = ScriptedClient(tokenizer, replies)
    ep = _run(env, task, client, tokenizer, EnvConfig(name="calculator", stitching="bridge"))
    assert ep.metrics["num_resets"] == 0 and ep.metrics["num_bridged_turns"] == 1
    (sample,) = ep.samples
    first = client.calls[0] + [*tokenizer.encode(replies[0]), tokenizer.eos_token_id]
    second = [*tokenizer.encode(replies[1]), tokenizer.eos_token_id]
    ids = sample.token_ids.tolist()
    assert ids == client.calls[1] + second and client.calls[1][: len(first)] == first
    # After the sampled eos: the rest of the template's end of turn, then the tool turn and the prompt.
    bridge = client.calls[1][len(first) :]
    assert bridge == tokenizer.encode("\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n")
    assert sample.loss_mask.sum() == len(first) - len(client.calls[0]) + len(second)


def test_bridge_stitching_adds_the_end_of_turn_a_truncated_completion_lacks(tokenizer):
    env = build_env("calculator", seed=0)
    task = env.task("train", 1)
    call = '<|pad|><tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
    client = ScriptedClient(tokenizer, [call, "6"])
    cfg = EnvConfig(name="calculator", stitching="bridge", max_tokens_per_turn=len(tokenizer.encode(call)))
    ep = _run(env, task, client, tokenizer, cfg)
    assert ep.metrics["num_bridged_turns"] == 1 and ep.metrics["num_truncated_turns"] == 1
    first = client.calls[0] + tokenizer.encode(call)  # no eos: cut by max_tokens
    assert client.calls[1][len(first) : len(first) + 2] == tokenizer.encode("<|im_end|>\n")


def test_truncated_turn_is_extended_with_unmasked_end_token(tokenizer):
    env = build_env("calculator", seed=0)
    task = env.task("train", 1)
    long_call = '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
    client = ScriptedClient(tokenizer, [long_call, "6"])
    cfg = EnvConfig(name="calculator", max_tokens_per_turn=len(tokenizer.encode(long_call)))  # eos cut off
    ep = _run(env, task, client, tokenizer, cfg)
    assert ep.metrics["num_truncated_turns"] == 1 and ep.metrics["num_resets"] == 0
    (sample,) = ep.samples
    first_end = len(client.calls[0]) + len(tokenizer.encode(long_call))
    eos_pos = first_end  # the template closes the turn; the model did not sample this token
    assert sample.token_ids[eos_pos] == tokenizer.eos_token_id and not sample.loss_mask[eos_pos]


def test_token_budget_stops_episode(tokenizer):
    env = build_env("calculator", seed=0)
    task = env.task("train", 2)
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call>'
    client = ScriptedClient(tokenizer, [call] * 4)
    first_prompt = len(tokenizer.render(task.prompt, [t.schema for t in env.tools(None)]))
    cfg = EnvConfig(name="calculator", max_total_tokens=first_prompt + 80)
    ep = _run(env, task, client, tokenizer, cfg)
    assert ep.stop_reason == "max_tokens" and ep.error is None
    assert len(client.calls) == 1 and ep.samples[0].num_tokens <= cfg.max_total_tokens


def test_single_turn_sample(tokenizer):
    env = build_env("reverse-text", seed=0)
    task = env.task("train", 3)
    client = ScriptedClient(tokenizer, [task.answer])
    ep = _run(env, task, client, tokenizer, EnvConfig(name="reverse-text"), temperature=1.0)
    (sample,) = ep.samples
    assert ep.reward == 1.0 and ep.rewards == {"lcs": 1.0, "exact": 1.0}
    assert sample.token_ids.tolist() == client.calls[0] + [
        *tokenizer.encode(task.answer),
        tokenizer.eos_token_id,
    ]
    assert sample.routed_experts is None  # a dense "model" returns no routing


class _StallingClient(ScriptedClient):
    """Answers the first `answer` turns, then never answers (the episode's deadline fires in the call)."""

    answer: int = 1

    async def generate(self, prompt_token_ids, sampling, **kwargs):
        if len(self.calls) >= self.answer:
            self.calls.append(list(prompt_token_ids))
            await asyncio.Event().wait()
        return await super().generate(prompt_token_ids, sampling, **kwargs)


def test_deadline_during_a_later_turn_keeps_full_routing(tokenizer):
    """The cut turn's new prompt tokens were never sampled against: they leave the sample, routing stays
    whole."""
    env = build_env("calculator", seed=1)
    task = env.task("train", 5)
    replies = _calc_script(task.info["expression"], str(int(task.answer)))
    client = _StallingClient(tokenizer, replies, routing=ROUTING)
    cfg = EnvConfig(name="calculator", deadline_s=0.3)
    ep = _run(env, task, client, tokenizer, cfg, routing=True)
    assert ep.stop_reason == "deadline" and not ep.failed and len(client.calls) == 2
    (sample,) = ep.samples
    ids = sample.token_ids.tolist()
    completion = [*tokenizer.encode(replies[0]), tokenizer.eos_token_id]
    assert ids == client.calls[0] + completion  # ends on the last sampled token
    assert sample.loss_mask[-1] and sample.routed_experts is not None
    np.testing.assert_array_equal(sample.routed_experts, scripted_routing(ids, 0, *ROUTING))


def test_turn_aborted_in_prefill_keeps_full_routing(tokenizer):
    """An abort before the first sampled token (routing only for part of the new prompt) adds nothing."""
    env = build_env("calculator", seed=1)
    task = env.task("train", 5)
    replies = _calc_script(task.info["expression"], str(int(task.answer)))

    class AbortingClient(ScriptedClient):
        async def generate(self, prompt_token_ids, sampling, **kwargs):
            if not self.calls:
                return await super().generate(prompt_token_ids, sampling, **kwargs)
            self.calls.append(list(prompt_token_ids))
            start = kwargs["routed_experts_start"]  # prefill reached 3 tokens past the known routing
            rows = scripted_routing(prompt_token_ids[: start + 3], start, *ROUTING[:2], ROUTING[2])
            return GenerateResponse(
                token_ids=[],
                logprobs=[],
                policy_versions=[],
                finish_reason="abort",
                routed_experts=RoutedExperts.from_array(rows, start=start),
            )

    client = AbortingClient(tokenizer, replies, routing=ROUTING)
    ep = _run(env, task, client, tokenizer, EnvConfig(name="calculator"), routing=True)
    assert ep.stop_reason == "aborted" and len(client.calls) == 2
    (sample,) = ep.samples
    ids = sample.token_ids.tolist()
    assert ids == client.calls[0] + [*tokenizer.encode(replies[0]), tokenizer.eos_token_id]
    np.testing.assert_array_equal(sample.routed_experts, scripted_routing(ids, 0, *ROUTING))


def test_kv_versions_record_each_turns_context_version():
    traj = TrajectoryBuilder()
    traj.extend_prompt([1, 2, 3], temperature=1.0)
    # A server that does not report the context: each token stands for itself.
    traj.add_completion(
        GenerateResponse(
            token_ids=[4, 5], logprobs=[-0.1, -0.2], policy_versions=[2, 3], finish_reason="stop"
        ),
        temperature=1.0,
    )
    traj.extend_prompt([1, 2, 3, 4, 5, 6, 7], temperature=1.0)
    # This turn's prompt was prefilled by v3 (across an update, or a cached prefix); its tokens are v4.
    traj.add_completion(
        GenerateResponse(
            token_ids=[8, 9],
            logprobs=[-0.3, -0.4],
            policy_versions=[4, 4],
            finish_reason="stop",
            context_version=3,
        ),
        temperature=1.0,
    )
    (sample,) = traj.build(reward=1.0, env="e", episode_id="ep", metrics={})
    assert sample.policy_versions.tolist() == [-1, -1, -1, 2, 3, -1, -1, 4, 4]
    assert sample.kv_versions.tolist() == [-1, -1, -1, 2, 3, -1, -1, 3, 3]
    assert sample.kv_versions.dtype == np.int32

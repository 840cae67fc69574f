"""The `long-context` env: its ledger, reward, reference, and how long its episodes grow in tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.config import EnvConfig
from asyncrl.envs import EnvConfigError, EpisodeState, ScriptedClient, TokenPolicy, build_env, run_episode
from asyncrl.envs.builtin.long_context import render_page
from asyncrl.envs.policy import ReplayPolicy
from asyncrl.wire import SamplingParams


def _pages(task) -> list[str]:
    return [render_page(task, p) for p in range(1, task.info["num_pages"] + 1)]


def test_the_key_is_on_one_earlier_page_and_pages_keep_their_size():
    env = build_env("long-context", {"num_pages": 5, "page_chars": 1000}, seed=3)
    for index in range(20):
        task = env.task("train", index)
        pages = _pages(task)
        holders = [i + 1 for i, page in enumerate(pages) if f"\n{task.info['key']} = " in page]
        assert holders == [task.info["answer_page"]] and holders[0] < 5
        assert f"{task.info['key']} = {task.answer}" in pages[holders[0] - 1]
        body_sizes = [len(page.split("\n", 1)[1]) for page in pages]
        assert all(1000 - 25 < size < 1000 for size in body_sizes)  # a line is 22 characters
    assert env.task("train", 7) == build_env(
        "long-context", {"num_pages": 5, "page_chars": 1000}, seed=3
    ).task("train", 7)
    assert _pages(env.task("train", 7)) == _pages(env.task("train", 7))
    keys = {env.task(split, i).info["key"] for split in ("train", "eval") for i in range(20)}
    assert len(keys) == 40


def test_reward_is_an_exact_match_of_the_last_answer():
    env = build_env("long-context")
    task = env.task("train", 0)

    def score(text: str) -> tuple[float, dict[str, float]]:
        state = EpisodeState(task=task, messages=list(task.prompt), final_text=text)
        state.data["pages_seen"] = {1, 2}
        return asyncio.run(env.rubric.score(state))

    assert score(f"ANSWER: {task.answer}") == (1.0, {"exact": 1.0, "pages_seen": 0.25})
    assert score(f"ANSWER: XXXXXXXX then ANSWER:  {task.answer}\n")[0] == 1.0
    assert score(f"ANSWER: {task.answer[:-1]}")[0] == 0.0
    assert score(task.answer)[0] == 0.0
    assert score(f'ANSWER: {task.answer} <tool_call>{{"name": "read_page"}}</tool_call>')[0] == 0.0


def test_reference_solves_every_task_through_the_tool():
    env = build_env("long-context", seed=1)
    config = EnvConfig(name="long-context")  # eval-env's defaults: tool output cut at 4000 characters
    for index in range(4):
        task = env.task("eval", index)
        replies = [m["content"] for m in env.reference(task) if m["role"] == "assistant"]
        episode = asyncio.run(run_episode(env, task, ReplayPolicy(replies), config=config, episode_id="r"))
        assert episode.reward == 1.0 and episode.stop_reason == "done"
        assert episode.metrics["num_tool_calls"] == task.info["answer_page"]
        assert episode.metrics["num_tool_errors"] == 0


def test_a_model_without_tool_calls_is_shown_every_page_and_the_episode_grows_to_the_band(tokenizer):
    num_pages, page_chars = 6, 2000
    env = build_env("long-context", {"num_pages": num_pages, "page_chars": page_chars})
    config = EnvConfig(name="long-context", max_total_tokens=16384)
    client = ScriptedClient(tokenizer, lambda i, ids: "hmm")
    policy = TokenPolicy(client, tokenizer, SamplingParams(max_tokens=64), config=config)
    episode = asyncio.run(run_episode(env, env.task("train", 0), policy, config=config, episode_id="g"))

    assert episode.stop_reason == "done" and episode.reward == 0.0
    assert episode.metrics["num_turns"] == num_pages + 1 and episode.rewards["pages_seen"] == 1.0
    [sample] = episode.samples  # one exact trajectory over every turn
    # byte-level tokens: every page's characters, plus the prompt, the turns and the template
    assert num_pages * page_chars < sample.num_tokens < num_pages * page_chars + 1500
    assert [len(ids) for ids in client.calls] == sorted(len(ids) for ids in client.calls)


def test_a_model_that_reads_pages_gets_them_as_tool_outputs_and_answers_early(tokenizer):
    env = build_env("long-context", {"num_pages": 4, "page_chars": 500})
    task = env.task("train", 2)
    calls = [
        f"<tool_call>{json.dumps({'name': 'read_page', 'arguments': {'page': p}})}</tool_call>"
        for p in (9, 1, 2)
    ]
    config = EnvConfig(name="long-context", max_total_tokens=8192)
    client = ScriptedClient(tokenizer, [*calls, f"ANSWER: {task.answer}"])
    policy = TokenPolicy(client, tokenizer, SamplingParams(max_tokens=128), config=config)
    episode = asyncio.run(run_episode(env, task, policy, config=config, episode_id="t"))

    tool_outputs = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert tool_outputs[0].startswith("error: ") and "pages are 1 to 4" in tool_outputs[0]
    assert tool_outputs[1:] == [render_page(task, 1), render_page(task, 2)]
    # the answer ends the episode with two pages unread; only the answer is graded
    assert episode.stop_reason == "done" and episode.metrics["num_turns"] == 4
    assert episode.rewards == {"exact": 1.0, "pages_seen": 0.5}


def test_the_token_budget_stops_a_long_episode(tokenizer):
    env = build_env("long-context", {"num_pages": 8, "page_chars": 1000})
    config = EnvConfig(name="long-context", max_total_tokens=3000)
    client = ScriptedClient(tokenizer, lambda i, ids: "hmm")
    policy = TokenPolicy(client, tokenizer, SamplingParams(max_tokens=64), config=config)
    episode = asyncio.run(run_episode(env, env.task("train", 0), policy, config=config, episode_id="b"))
    assert episode.stop_reason == "max_tokens" and sum(s.num_tokens for s in episode.samples) <= 3000
    assert 2 <= episode.metrics["num_turns"] < 8


@pytest.mark.parametrize("args", [{"num_pages": 1}, {"page_chars": 10}])
def test_bad_arguments_say_which(args):
    with pytest.raises(EnvConfigError, match=next(iter(args))):
        build_env("long-context", args)

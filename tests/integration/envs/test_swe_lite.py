"""swe-lite end to end: a scripted policy that knows the fix reaches reward 1.0, through the sandbox."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.config import EnvConfig
from asyncrl.envs import ScriptedClient, TokenPolicy, build_env, run_episode
from asyncrl.envs.builtin.swe_lite.templates import TEMPLATES
from asyncrl.wire import SamplingParams

CFG = EnvConfig(name="swe-lite", max_total_tokens=16384, max_tokens_per_turn=2048)


def _episode(env, task, replies, tokenizer):
    policy = TokenPolicy(
        ScriptedClient(tokenizer, replies), tokenizer, SamplingParams(max_tokens=2048), config=CFG
    )
    return asyncio.run(run_episode(env, task, policy, config=CFG, episode_id=task.id))


def _call(name: str, **arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _task_per_template(env):
    found = {}
    for i in range(200):
        task = env.task("train", i)
        found.setdefault(task.info["template"], task)
    assert len(found) == len(TEMPLATES)
    return [found[t] for t in sorted(found)]


def test_scripted_fix_reaches_reward_one_on_every_template(tokenizer):
    env = build_env("swe-lite", seed=0)
    for task in _task_per_template(env):
        reference = env.reference(task)
        replies = [m["content"] for m in reference if m["role"] == "assistant"]
        ep = _episode(env, task, replies, tokenizer)
        assert ep.error is None and ep.stop_reason == "done", task.info
        assert ep.reward == 1.0, task.info
        assert ep.metrics["num_tool_calls"] == 3 and ep.metrics["num_tool_errors"] == 0
        assert ep.messages[len(task.prompt) :] == reference  # the reference transcript is what really happens
        (sample,) = ep.samples
        assert sample.reward == 1.0 and sample.loss_mask.sum() == ep.metrics["num_completion_tokens"]


def test_unfixed_repo_scores_partial_and_tools_report_errors(tokenizer):
    env = build_env("swe-lite", seed=0)
    task = env.task("train", 0)
    module = task.info["module"]
    replies = [
        _call("list_files"),
        _call("read_file", path="../../etc/passwd"),
        _call("read_file", path="missing.py"),
        _call(
            "write_file", path=f"test_{module}.py", content="def test_x():\n    pass\n"
        ),  # editing tests does not count
        _call("run_tests"),
        "I give up.",
    ]
    ep = _episode(env, task, replies, tokenizer)
    assert ep.stop_reason == "done" and ep.error is None
    tool_msgs = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert tool_msgs[0].split("\n") == [f"{module}.py", f"test_{module}.py"]
    assert tool_msgs[1].startswith("error: SandboxPathError: path '../../etc/passwd' leaves the sandbox")
    assert tool_msgs[2] == "error: FileNotFoundError: no file 'missing.py' in the sandbox"
    assert tool_msgs[4].endswith("failed") and "PASS test_x" in tool_msgs[4]  # the model sees its own test
    assert ep.metrics["num_tool_errors"] == 2
    assert 0.0 < ep.reward < 1.0  # measured on the pristine tests


@pytest.mark.parametrize(
    ("code", "summary"),
    [
        ("while True:\n    pass\n", "killed: CPU time limit exceeded"),
        ("import socket\nsocket.socket()\n", "socket.__new__ is not allowed"),
        ("print('x' * 10**7)\n", "killed: output limit exceeded"),
        ("import os\nfor _ in range(64):\n    os.fork()\n", "os.fork is not allowed"),
        ("open('../outside.txt', 'w').write('x')\n", "writing '../outside.txt' is outside the sandbox"),
    ],
)
def test_hostile_code_under_test_ends_with_a_tool_error(tokenizer, code, summary):
    env = build_env("swe-lite", {"cpu_s": 1, "wall_s": 30.0})  # CPU limit fires first, even under load
    task = env.task("train", 1)
    replies = [
        _call("write_file", path=f"{task.info['module']}.py", content=code),
        _call("run_tests"),
        "done",
    ]
    ep = _episode(env, task, replies, tokenizer)
    assert ep.stop_reason == "done" and ep.reward == 0.0 and not ep.failed
    report = [m["content"] for m in ep.messages if m["role"] == "tool"][1]
    assert summary in report and report.endswith("0 passed, " + str(report.count("FAIL")) + " failed")


def test_faked_runner_output_does_not_count(tokenizer):
    env = build_env("swe-lite", seed=0)
    task = env.task("train", 2)
    names = env._repo(task).test_names
    fake = "".join(f"print('PASS {n}')\n" for n in names)
    replies = [_call("write_file", path=f"{task.info['module']}.py", content=fake), "done"]
    ep = _episode(env, task, replies, tokenizer)
    assert ep.reward == 0.0


def test_every_template_fails_some_tests_with_the_bug_and_none_with_the_fix():
    from asyncrl.envs.builtin.swe_lite.env import _RUNNER_NAME, _RUNNER_SOURCE, _run_tests
    from asyncrl.envs.sandbox import Sandbox

    for template in TEMPLATES:
        repo = template.render(template.names[0], template.modules[0])
        counts = []
        for source in (repo.buggy, repo.fixed):
            box = Sandbox()
            box.write_file(f"{repo.module}.py", source)
            box.write_file(f"test_{repo.module}.py", repo.tests)
            box.write_file(_RUNNER_NAME, _RUNNER_SOURCE)
            results = asyncio.run(_run_tests(box, repo.test_names))
            box.close()
            assert [name for name, _, _ in results] == list(repo.test_names)
            counts.append(sum(ok for _, ok, _ in results))
        assert 0 < counts[0] < len(repo.test_names) and counts[1] == len(repo.test_names), template.kind

"""The swe env end to end: scripted agents in pooled bwrap sandboxes, graded by the task's tests."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import EnvConfig
from asyncrl.envs import ScriptedClient, TokenPolicy, build_env, iter_reference_examples, run_episode
from asyncrl.envs.builtin.swe.checkout import git
from asyncrl.envs.builtin.swe.example import write_example
from asyncrl.envs.sandbox_bwrap import probe_isolation
from asyncrl.launcher.cli import main as cli_main
from asyncrl.wire import SamplingParams
from helpers import left_after_kill

pytestmark = pytest.mark.skipif(probe_isolation().mode != "bwrap", reason="the swe env needs bubblewrap")

CFG = EnvConfig(name="swe", max_total_tokens=32768, max_tokens_per_turn=4096, max_tool_output_chars=8000)


def _call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


SUBMIT = _call("submit")


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory) -> Path:
    return write_example(tmp_path_factory.mktemp("example"))


def _env(tasks: Path, tmp_path: Path, **args):
    sandbox = {"root": str(tmp_path / "sandboxes"), "max_sandboxes": 4, "prewarm": 0} | args.pop(
        "sandbox", {}
    )
    return build_env("swe", {"tasks": str(tasks), "eval_tasks": str(tasks), "sandbox": sandbox, **args})


@pytest.fixture
def env(tasks_file, tmp_path):
    env = _env(tasks_file, tmp_path)
    yield env
    env.close()
    assert not env.pool.run_dir.path.exists()


def _task(env, instance_id: str):
    return next(t for t in env.tasks("eval", 2) if t.info["instance_id"] == instance_id)


def _episode(env, task, replies, tokenizer, config: EnvConfig = CFG):
    policy = TokenPolicy(
        ScriptedClient(tokenizer, replies), tokenizer, SamplingParams(max_tokens=4096), config=config
    )
    return asyncio.run(run_episode(env, task, policy, config=config, episode_id=task.id))


def _wait_idle(env) -> None:
    for _ in range(1000):
        if env.pool.counts()["resetting"] == 0:
            return
        asyncio.run(asyncio.sleep(0.01))
    raise AssertionError(env.pool.counts())


@pytest.mark.parametrize("instance_id", ["calclib-clamp", "calclib-mean"])
def test_scripted_reference_fix_scores_one(env, tokenizer, instance_id):
    task = _task(env, instance_id)
    reference = env.reference(task)
    replies = [m["content"] for m in reference if m["role"] == "assistant"]
    ep = _episode(env, task, replies, tokenizer)
    assert ep.error is None and ep.stop_reason == "done"
    assert ep.reward == 1.0 and ep.rewards["resolved"] == 1.0
    assert (
        ep.rewards["fail_to_pass"] == 1.0
        and ep.rewards["pass_to_pass"] == 1.0
        and ep.rewards["submitted"] == 1.0
    )
    assert (
        ep.rewards["grading_error"] == 0.0
        and ep.rewards["test_run_s"] > 0
        and ep.rewards["sandbox_start_s"] > 0
    )
    assert ep.messages[len(task.prompt) :] == reference  # what the tools answered is what the reference says
    assert ep.metrics["num_tool_calls"] == len(replies) and ep.metrics["num_tool_errors"] == 0


def test_unpatched_repo_scores_zero_and_a_reset_sandbox_is_reused(env, tokenizer):
    task = _task(env, "calclib-mean")
    first = _episode(env, task, [SUBMIT], tokenizer)
    assert (
        first.reward == 0.0 and first.rewards["fail_to_pass"] == 0.0 and first.rewards["pass_to_pass"] == 1.0
    )
    assert first.rewards["sandbox_warm"] == 0.0
    _wait_idle(env)
    second = _episode(env, task, ["I cannot fix it."], tokenizer)  # no submit: still graded
    assert second.reward == 0.0 and second.rewards["submitted"] == 0.0 and second.stop_reason == "done"
    assert second.rewards["sandbox_warm"] == 1.0 and env.pool.counts()["created"] == 1


_FAKE_PASS = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


def test_editing_tests_does_not_help(env, tokenizer):
    task = _task(env, "calclib-clamp")
    f2p = env.swe_task(task).fail_to_pass[0]
    replies = [
        _call("create", path="conftest.py", content=_FAKE_PASS),  # every test "passes"
        _call("create", path="tests/test_ops.py", content="def test_clamp_high():\n    pass\n"),
        _call("create", path="sitecustomize.py", content="print('PASSED', flush=True)\n"),
        _call(
            "bash", command=f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider {f2p}"
        ),
        SUBMIT,
    ]
    ep = _episode(env, task, replies, tokenizer)
    agent_run = [m["content"] for m in ep.messages if m["role"] == "tool"][3]
    assert agent_run.startswith("exit code 0") and "1 passed" in agent_run  # the agent's own run looks fine
    assert ep.reward == 0.0 and ep.rewards["fail_to_pass"] == 0.0 and ep.rewards["grading_error"] == 0.0


def test_shell_and_editor_tools_in_the_sandbox(tasks_file, tmp_path, tokenizer):
    env = _env(tasks_file, tmp_path, command_timeout_s=1.0, max_output_chars=500)
    try:
        task = _task(env, "calclib-clamp")
        replies = [
            _call("bash", command="yes | head -c 100000"),
            _call("bash", command="sleep 30 & sleep 30"),
            _call("bash", command="pwd; ls; uname -n; ls -A /tmp; exit 3"),
            _call("view", path="calclib/ops.py", start_line=6, end_line=8),
            _call("str_replace", path="calclib/ops.py", old_str="return a - b", new_str="x"),
            _call("search", pattern=r"hi - 1"),
            SUBMIT,
        ]
        ep = _episode(env, task, replies, tokenizer)
    finally:
        env.close()
    out = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert out[0].startswith("exit code 0\ny\ny\n") and "characters cut ...]" in out[0] and len(out[0]) < 520
    assert out[1].startswith("killed: the command ran past its time limit")
    listing, _, tmp = out[2].partition("sandbox\n")
    assert listing == "exit code 3\n/repo\ncalclib\ntests\n"
    # No host files: /tmp is empty but for an interpreter that lives there (a venv under /tmp),
    # which the sandbox binds for its python shim.
    assert set(tmp.split()) <= _tmp_roots(sys.prefix, sys.base_prefix), tmp
    assert out[3] == (
        '     6\tdef clamp(x, lo, hi):\n     7\t    """x limited to the interval [lo, hi]."""\n'
        "     8\t    return max(lo, min(x, hi - 1))\n"
    )
    assert out[4].startswith("error: old_str was not found in calclib/ops.py")
    assert out[5] == "calclib/ops.py:8: return max(lo, min(x, hi - 1))"
    assert ep.metrics["num_tool_errors"] == 1 and ep.stop_reason == "done"


def test_deadline_kills_the_command_and_returns_the_sandbox(env, tokenizer):
    task = _task(env, "calclib-clamp")
    config = CFG.model_copy(update={"deadline_s": 2.0})
    ep = _episode(env, task, [_call("bash", command="sleep 60 & sleep 60")], tokenizer, config)
    assert ep.stop_reason == "deadline" and ep.error is None and ep.reward == 0.0
    assert not left_after_kill(env.pool.run_dir.path)
    _wait_idle(env)
    assert env.pool.counts()["idle"] == 1 and env.pool.counts()["busy"] == 0


def test_partial_credit_is_gated_by_pass_to_pass(tasks_file, tmp_path, tokenizer):
    row = json.loads(tasks_file.read_text().splitlines()[0])  # clamp: only test_clamp_high fails
    ids = [f"tests/test_ops.py::{n}" for n in ("test_clamp_high", "test_clamp_inside", "test_add")]
    rows = [
        row | {"instance_id": "half", "FAIL_TO_PASS": ids[:2], "PASS_TO_PASS": ids[2:]},
        row | {"instance_id": "gated", "FAIL_TO_PASS": ids[1:2], "PASS_TO_PASS": ids[::2]},
    ]
    tasks = tasks_file.parent / "partial.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = _env(tasks, tmp_path, partial_credit=True)
    try:
        half = _episode(env, _task(env, "half"), [SUBMIT], tokenizer)
        gated = _episode(env, _task(env, "gated"), [SUBMIT], tokenizer)
    finally:
        env.close()
    assert half.reward == 0.5 and half.rewards["partial"] == 0.5 and half.rewards["fail_to_pass"] == 0.5
    assert (
        gated.reward == 0.0 and gated.rewards["fail_to_pass"] == 1.0 and gated.rewards["pass_to_pass"] == 0.5
    )


def test_a_plain_directory_task_with_a_venv(tasks_file, tmp_path, tokenizer):
    row = json.loads(tasks_file.read_text().splitlines()[0])
    plain = tmp_path / "plain"
    plain.mkdir()
    archive = subprocess.run(
        ["git", "archive", row["base_commit"]],
        cwd=tasks_file.parent / "calclib",
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "x", "-C", str(plain)], input=archive, check=True)
    assert not (plain / ".git").exists()
    tasks = tmp_path / "plain.jsonl"
    tasks.write_text(json.dumps(row | {"repo": str(plain), "base_commit": "", "venv": sys.prefix}) + "\n")
    env = _env(tasks, tmp_path)
    try:
        task = env.task("eval", 0)
        replies = [m["content"] for m in env.reference(task) if m["role"] == "assistant"]
        ep = _episode(env, task, replies, tokenizer)
    finally:
        env.close()
    assert ep.reward == 1.0 and ep.error is None
    assert git("status", "--porcelain", cwd=tasks_file.parent / "calclib") == ""  # the source is untouched
    shutil.rmtree(plain)


def test_reference_examples_for_sft(env):
    (example, _) = list(iter_reference_examples(env, "eval", 2))
    assert [t["function"]["name"] for t in example.tools] == [
        "bash",
        "view",
        "str_replace",
        "create",
        "search",
        "submit",
    ]
    assert (
        example.completion == env.reference(env.task("eval", 0))
        and example.completion[-2]["content"] == SUBMIT
    )


@pytest.mark.parametrize(("agent", "reward"), [("reference", 1.0), ("noop", 0.0)])
def test_eval_env_scripted_agents_on_the_example(tasks_file, tmp_path, capsys, agent, reward):
    args = {"tasks": str(tasks_file), "eval_tasks": str(tasks_file), "sandbox": {"root": str(tmp_path)}}
    argv = ["eval-env", "--agent", agent, "--env", "swe", "--env-args", json.dumps(args), "--num", "2"]
    assert cli_main(argv) == 0
    rows = dict(line.split() for line in capsys.readouterr().out.splitlines()[1:])
    assert float(rows["reward"]) == reward and float(rows["reward_min"]) == reward
    assert float(rows["rewards/fail_to_pass"]) == reward and float(rows["rewards/pass_to_pass"]) == 1.0
    assert float(rows["rewards/grading_error"]) == 0.0 and float(rows["metrics/failed"]) == 0.0


def test_python_is_on_path_even_where_the_interpreters_bin_has_only_python3(
    tasks_file, tmp_path, tokenizer, monkeypatch
):
    """Debian's /usr/bin has python3 but no python: test commands still find the interpreter running
    asyncrl."""
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python3").symlink_to(sys.executable)
    monkeypatch.setattr(sys, "prefix", str(prefix))
    env = _env(tasks_file, tmp_path)
    try:
        task = _task(env, "calclib-clamp")
        replies = [m["content"] for m in env.reference(task) if m["role"] == "assistant"]
        probe = _call(
            "bash", command="command -v python; python -c 'import sys, pytest; print(sys.executable)'"
        )
        ep = _episode(env, task, [probe, *replies], tokenizer)
    finally:
        env.close()
    assert (
        ep.messages[len(task.prompt) + 1]["content"]
        == f"exit code 0\n/opt/asyncrl/bin/python\n{sys.executable}\n"
    )
    assert ep.reward == 1.0 and ep.rewards["grading_error"] == 0.0


def _tmp_roots(*paths: str) -> set[str]:
    """The entries of /tmp that hold any of `paths`."""
    return {Path(p).relative_to("/tmp").parts[0] for p in paths if Path(p).is_relative_to("/tmp")}

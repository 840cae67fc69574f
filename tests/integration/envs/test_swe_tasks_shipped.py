"""The shipped SWE task set, examples/swe/tasks.jsonl: its rows always; its repositories, one
verified task per repository, and the `swe` env on those tasks (the reference fix scores 1, the
untouched bug 0, from any working directory), once `bash scripts/setup-swe-tasks.sh` has built them
(skipped, saying so, before that). About 40 s with the repositories on 2 shared cores."""

from __future__ import annotations

import asyncio
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.config import EnvConfig
from asyncrl.envs import ReplayPolicy, build_env, run_episode
from asyncrl.envs.builtin.swe.tasks import DEFAULT_TEST_CMD, read_tasks
from asyncrl.envs.sandbox_bwrap import probe_isolation
from asyncrl.tools.swe_tasks import verify_task
from asyncrl.tools.swe_tasks.statement import leaks_fix

ROOT = Path(__file__).resolve().parents[3]
TASKS = ROOT / "examples" / "swe" / "tasks.jsonl"


def test_the_shipped_rows_are_well_formed_and_hide_their_fixes():
    tasks = read_tasks(TASKS)
    assert Counter(t.instance_id.split("__")[0] for t in tasks) == {"toolz": 24, "inflection": 8}
    for task in tasks:
        assert task.repo == TASKS.parent / "repos" / task.instance_id.split("__")[0] / task.instance_id
        assert task.test_cmd == DEFAULT_TEST_CMD and task.test_patch == ""
        assert task.fail_to_pass and 0 < len(task.pass_to_pass) <= 20
        assert not set(task.fail_to_pass) & set(task.pass_to_pass)
        assert not leaks_fix(task.problem_statement, task.patch)
        assert task.patch.startswith(f"--- a/{task.mutation['file']}\n")


def _head(repo: Path) -> str | None:
    if not (repo / ".git").exists():
        return None
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


@pytest.fixture(scope="module")
def built() -> list:
    tasks = read_tasks(TASKS)
    missing = [t.instance_id for t in tasks if _head(t.repo) != t.base_commit]
    if missing:
        pytest.skip(
            f"{len(missing)} of the shipped tasks' repositories are not built: run bash "
            "scripts/setup-swe-tasks.sh (downloads the toolz and inflection sdists from PyPI)"
        )
    return tasks


def test_each_repository_is_its_buggy_state_and_the_patch_applies(built: list):
    for task in built:
        repo = task.repo
        subprocess.run(["git", "apply", "--check", "-"], cwd=repo, input=task.patch, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True)
        assert status.stdout == "", f"{task.repo} has local changes"


def test_one_task_per_repository_scores_0_buggy_and_1_fixed(built: list):
    first = {}
    for task in built:
        first.setdefault(task.instance_id.split("__")[0], task)
    for task in first.values():
        verdict = verify_task(task)
        assert verdict.ok, verdict.problems
        assert (verdict.f2p_before, verdict.f2p_after, verdict.p2p_after) == (0.0, 1.0, 1.0)


@pytest.mark.skipif(probe_isolation().mode != "bwrap", reason="the swe env needs bubblewrap")
def test_the_env_scores_the_reference_fix_1_and_the_bug_0(built: list, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # rows name their repositories relative to the tasks file, not the cwd
    args = {
        "tasks": str(TASKS),
        "eval_tasks": str(TASKS),
        "sandbox": {"root": str(tmp_path / "sb"), "prewarm": 0},
    }
    env = build_env("swe", args)
    config = EnvConfig(name="swe")
    try:
        tasks = {}
        for task in env.tasks("eval", len(built)):
            tasks.setdefault(task.info["instance_id"].split("__")[0], task)
        for task in tasks.values():
            replies = [m["content"] for m in env.reference(task) if m["role"] == "assistant"]
            for policy, reward in ((ReplayPolicy(replies), 1.0), (ReplayPolicy([]), 0.0)):
                ep = asyncio.run(run_episode(env, task, policy, config=config, episode_id=task.id))
                assert ep.error is None and ep.rewards["grading_error"] == 0.0, ep.error
                assert (ep.reward, ep.rewards["fail_to_pass"], ep.rewards["pass_to_pass"]) == (
                    reward,
                    reward,
                    1.0,
                )
    finally:
        env.close()

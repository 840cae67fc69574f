"""The shipped SWE task set, examples/swe/tasks.jsonl: its rows always; its repositories, and one
verified task per repository, once `bash scripts/setup-swe-tasks.sh` has built them (skipped,
saying so, before that). About 10 s with the repositories."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.envs.swe_tasks import DEFAULT_TEST_CMD, read_tasks, resolve_repo, verify_task
from asyncrl.envs.swe_tasks.statement import leaks_fix

ROOT = Path(__file__).resolve().parents[3]
TASKS = ROOT / "examples" / "swe" / "tasks.jsonl"


def test_the_shipped_rows_are_well_formed_and_hide_their_fixes():
    tasks = read_tasks(TASKS)
    assert Counter(t.instance_id.split("__")[0] for t in tasks) == {"toolz": 24, "inflection": 8}
    for task in tasks:
        assert task.repo == f"examples/swe/repos/{task.instance_id.split('__')[0]}/{task.instance_id}"
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
    missing = [t.instance_id for t in tasks if _head(resolve_repo(t.repo, ROOT)) != t.base_commit]
    if missing:
        pytest.skip(
            f"{len(missing)} of the shipped tasks' repositories are not built: run bash scripts/setup-swe-tasks.sh "
            "(downloads the toolz and inflection sdists from PyPI)"
        )
    return tasks


def test_each_repository_is_its_buggy_state_and_the_patch_applies(built: list):
    for task in built:
        repo = resolve_repo(task.repo, ROOT)
        subprocess.run(["git", "apply", "--check", "-"], cwd=repo, input=task.patch, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True)
        assert status.stdout == "", f"{task.repo} has local changes"


def test_one_task_per_repository_scores_0_buggy_and_1_fixed(built: list):
    first = {}
    for task in built:
        first.setdefault(task.instance_id.split("__")[0], task)
    for task in first.values():
        verdict = verify_task(task, base=ROOT)
        assert verdict.ok, verdict.problems
        assert (verdict.f2p_before, verdict.f2p_after, verdict.p2p_after) == (0.0, 1.0, 1.0)

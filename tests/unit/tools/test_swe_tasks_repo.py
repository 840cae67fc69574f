"""The generator's test runs (outcomes as the `swe` env reads them) and its reproducible task repositories."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.envs.builtin.swe.tasks import SweTask, SweTaskError
from asyncrl.tools.swe_tasks.repo import build_task_repo, rebuild_task_repos, snapshot, unified_diff
from asyncrl.tools.swe_tasks.runner import TestRunner, run_shell


def _task(repo: Path, base_commit: str, patch: str) -> SweTask:
    return SweTask(
        instance_id="demo__1",
        repo=repo,
        base_commit=base_commit,
        problem_statement="test_add fails",
        patch=patch,
        fail_to_pass=("tests/test_m.py::test_add",),
    )


def test_runner_reads_each_outcome_from_the_envs_report_not_the_output(tmp_path: Path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    print('PASSED "
        "test_x.py::test_bad')\n"
        "    assert 1 == 2\n\n@pytest.mark.parametrize('v', ['a b', 'c'])\ndef test_p(v):\n    assert v == "
        "'c'\n\n"
        "@pytest.mark.xfail\ndef test_known():\n    assert False\n"
    )
    runner = TestRunner(
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider {tests}", timeout_s=120
    )
    try:
        run = runner.run(tmp_path, [])
    finally:
        runner.close()
    ids = ["test_ok", "test_bad", "test_p[a b]", "test_p[c]", "test_known"]
    assert run.outcomes == {
        f"test_x.py::{i}": o for i, o in zip(ids, ["passed", "failed", "failed", "passed", "xfailed"])
    }
    assert "PASSED test_x.py::test_bad" in run.run.output  # printed, and not believed


def test_runner_runs_this_interpreter_and_writes_no_bytecode(tmp_path: Path):
    """`python` is the interpreter running asyncrl, and no .pyc can hide an edit of the same size."""
    (tmp_path / "m.py").write_text("X = 1\n")
    runner = TestRunner("python -c 'import sys, m; print(sys.executable, m.X)' {tests}", timeout_s=60)
    try:
        run = runner.run(tmp_path, []).run
    finally:
        runner.close()
    assert run.output.split() == [sys.executable, "1"]
    assert not (tmp_path / "__pycache__").exists()
    venv_python = tmp_path / "venv" / "bin" / "python"  # a task's venv: its interpreter instead
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text('#!/bin/sh\necho venv python "$@"\n')
    venv_python.chmod(0o755)
    runner = TestRunner("python -m pytest {tests}", timeout_s=60, python=venv_python)
    try:
        assert runner.run(tmp_path, ["t.py::a"]).run.output == "venv python -m pytest t.py::a\n"
    finally:
        runner.close()


def test_run_shell_kills_the_whole_group_at_the_deadline(tmp_path: Path):
    pid_file = tmp_path / "pid"
    run = run_shell(
        f"sleep 60 & echo $! > {pid_file}; wait", tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout_s=1
    )
    assert run.timed_out
    pid = int(pid_file.read_text())
    state = subprocess.run(
        ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True
    ).stdout.strip()
    assert state in ("", "Z")  # gone, or a zombie awaiting its reaper


def test_unified_diff_applies_with_git_also_without_a_final_newline(tmp_path: Path):
    old, new = "a = 1\nb = 2", "a = 1\nb = 3"
    (tmp_path / "m.py").write_text(old)
    subprocess.run(
        ["git", "apply", "-"], cwd=tmp_path, input=unified_diff("m.py", old, new), text=True, check=True
    )
    assert (tmp_path / "m.py").read_text() == new


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_text("def f(a, b):\n    return a + b\n")
    (src / ".gitignore").write_text("build/\n")
    (src / "build").mkdir()
    (src / "build" / "junk.txt").write_text("ignored\n")
    return src


def test_task_repo_is_one_reproducible_commit_of_the_buggy_state(tmp_path: Path):
    src = _source(tmp_path)
    patch = unified_diff("pkg/m.py", "def f(a, b):\n    return a - b\n", "def f(a, b):\n    return a + b\n")
    tree = snapshot(src, tmp_path / "store")
    one = build_task_repo(tmp_path / "one", tmp_path / "store", tree, patch)
    other_tree = snapshot(src, tmp_path / "store2")
    two = build_task_repo(tmp_path / "two", tmp_path / "store2", other_tree, patch)
    assert one == two  # the same files give the same commit, in any store, at any time
    assert (tmp_path / "one" / "pkg" / "m.py").read_text() == "def f(a, b):\n    return a - b\n"
    assert not (tmp_path / "one" / "build").exists()  # what .gitignore excludes is not part of a task
    log = subprocess.run(
        ["git", "log", "--format=%H %P %s"], cwd=tmp_path / "one", capture_output=True, text=True
    )
    assert log.stdout.split("\n")[:-1] == [f"{one}  snapshot"]  # one commit, no parent, no hint of the bug
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=tmp_path / "one", capture_output=True, text=True
    )
    assert status.stdout == ""


def test_rebuild_recreates_the_rows_commits_and_rejects_other_sources(tmp_path: Path):
    src = _source(tmp_path)
    patch = unified_diff("pkg/m.py", "def f(a, b):\n    return b + a\n", "def f(a, b):\n    return a + b\n")
    commit = build_task_repo(tmp_path / "made", tmp_path / "store", snapshot(src, tmp_path / "store"), patch)
    task = _task(tmp_path / "repos" / "t", commit, patch)
    assert rebuild_task_repos([task], src, log=lambda _: None) == 1
    assert rebuild_task_repos([task], src, log=lambda _: None) == 0  # already in place
    (src / "pkg" / "extra.py").write_text("Y = 2\n")
    moved = _task(tmp_path / "repos" / "u", commit, patch)
    with pytest.raises(SweTaskError, match="not the files the tasks were made from"):
        rebuild_task_repos([moved], src, log=lambda _: None)
    assert not (tmp_path / "repos" / "u").exists()

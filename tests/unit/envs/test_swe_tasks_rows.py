"""Task rows, test commands, pytest's -rA summary, and the reproducible task repositories."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from asyncrl.envs.swe_tasks.repo import build_task_repo, rebuild_task_repos, snapshot, unified_diff
from asyncrl.envs.swe_tasks.rows import (
    SweTask,
    SweTaskError,
    format_test_cmd,
    parse_test_outcomes,
    read_tasks,
    write_tasks,
)
from asyncrl.envs.swe_tasks.runner import TestRunner, run_shell


def row(**over) -> dict:
    base = {
        "instance_id": "demo__1",
        "repo": "repos/demo__1",
        "base_commit": "a" * 40,
        "problem_statement": "test_add fails",
        "patch": "--- a/m.py\n+++ b/m.py\n",
        "test_patch": "",
        "FAIL_TO_PASS": ["tests/test_m.py::test_add"],
        "PASS_TO_PASS": ["tests/test_m.py::test_sub"],
        "test_cmd": "python -m pytest -rA {tests}",
    }
    return base | over


def test_rows_round_trip_and_accept_hub_style_json_strings(tmp_path: Path):
    path = tmp_path / "tasks.jsonl"
    task = SweTask.from_row(row(FAIL_TO_PASS=json.dumps(["t::a", "t::b"])))
    assert task.fail_to_pass == ("t::a", "t::b")
    write_tasks(path, [task, SweTask.from_row(row(instance_id="demo__2"))])
    back = read_tasks(path)
    assert back[0] == task and back[1].instance_id == "demo__2"
    assert json.loads(path.read_text().splitlines()[0])["FAIL_TO_PASS"] == ["t::a", "t::b"]


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"base_commit": None}, r"no \['base_commit'\]"),
        ({"FAIL_TO_PASS": []}, r"no \['FAIL_TO_PASS'\]"),
        ({"PASS_TO_PASS": "not json"}, "PASS_TO_PASS is a string but not a JSON list"),
        ({"PASS_TO_PASS": [1]}, "PASS_TO_PASS must be a list of test ids"),
        ({"test_cmd": "pytest"}, r"has no \{tests\} placeholder"),
    ],
)
def test_bad_rows_name_the_row_and_the_field(tmp_path: Path, over: dict, message: str):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(row(**over)) + "\n")
    with pytest.raises(SweTaskError, match=message) as e:
        read_tasks(path)
    assert "line 1" in str(e.value)


def test_duplicate_instance_ids_are_an_error(tmp_path: Path):
    path = tmp_path / "tasks.jsonl"
    path.write_text((json.dumps(row()) + "\n") * 2)
    with pytest.raises(SweTaskError, match="'demo__1' appears twice"):
        read_tasks(path)


def test_test_cmd_quotes_ids_for_the_shell():
    cmd = format_test_cmd("python -m pytest {tests} -q", ["t.py::a", "t.py::b[x y]"])
    assert cmd == "python -m pytest t.py::a 't.py::b[x y]' -q"
    assert format_test_cmd("pytest {tests}", []) == "pytest "


def test_parse_test_outcomes_reads_the_ra_summary():
    output = "\n".join(
        [
            "..F",
            "=========================== short test summary info ============================",
            "PASSED t.py::a",
            "PASSED t.py::b[1 - 2]",
            "FAILED t.py::c - AssertionError: assert 1 == 2",
            "FAILED t.py::d[x - y] - ZeroDivisionError",
            "ERROR t.py::e - RuntimeError: fixture",
            "SKIPPED [1] t.py:9: no reason",
            "XFAIL t.py::f - known",
            "PASSED t.py::unasked",
        ]
    )
    ids = ["t.py::a", "t.py::b[1 - 2]", "t.py::c", "t.py::d[x - y]", "t.py::e", "t.py::f", "t.py::g"]
    assert parse_test_outcomes(output, ids) == {
        "t.py::a": "passed",
        "t.py::b[1 - 2]": "passed",
        "t.py::c": "failed",
        "t.py::d[x - y]": "failed",
        "t.py::e": "failed",
        "t.py::f": "skipped",
        "t.py::g": "missing",
    }


def test_parse_test_outcomes_of_a_real_pytest_run(tmp_path: Path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n\n"
        "@pytest.mark.parametrize('v', ['a b', 'c'])\ndef test_p(v):\n    assert v == 'c'\n"
    )
    runner = TestRunner("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider {tests}",
                        timeout_s=120)  # fmt: skip
    try:
        run = runner.run(tmp_path, [])
    finally:
        runner.close()
    ids = ["test_x.py::test_ok", "test_x.py::test_bad", "test_x.py::test_p[a b]", "test_x.py::test_p[c]"]
    assert parse_test_outcomes(run.output, ids) == dict(zip(ids, ["passed", "failed", "failed", "passed"]))


def test_runner_runs_this_interpreter_and_writes_no_bytecode(tmp_path: Path):
    """`python` is the interpreter running asyncrl, and no .pyc can hide an edit of the same size."""
    import sys

    (tmp_path / "m.py").write_text("X = 1\n")
    runner = TestRunner("python -c 'import sys, m; print(sys.executable, m.X)' {tests}", timeout_s=60)
    try:
        run = runner.run(tmp_path, [])
    finally:
        runner.close()
    assert run.output.split() == [sys.executable, "1"]
    assert not (tmp_path / "__pycache__").exists()


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
    task = SweTask.from_row(row(repo=str(tmp_path / "repos" / "t"), base_commit=commit, patch=patch))
    assert rebuild_task_repos([task], src, log=lambda _: None) == 1
    assert rebuild_task_repos([task], src, log=lambda _: None) == 0  # already in place
    (src / "pkg" / "extra.py").write_text("Y = 2\n")
    moved = SweTask.from_row(row(repo=str(tmp_path / "repos" / "u"), base_commit=commit, patch=patch))
    with pytest.raises(SweTaskError, match="not the files the tasks were made from"):
        rebuild_task_repos([moved], src, log=lambda _: None)
    assert not (tmp_path / "repos" / "u").exists()

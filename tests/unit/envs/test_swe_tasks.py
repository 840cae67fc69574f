"""SWE-bench-form rows (the one format of the `swe` env and `asyncrl swe-tasks`): accepted shapes,
paths relative to the tasks file, and errors that name the row and the field."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from asyncrl.envs.builtin.swe.example import write_example
from asyncrl.envs.builtin.swe.tasks import (
    SweTask,
    SweTaskError,
    format_test_cmd,
    read_tasks,
    resolve_commits,
    write_tasks,
)
from asyncrl.envs.task_data import TaskDataError


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    tasks = write_example(tmp_path_factory.mktemp("example"))
    return tasks.parent, [json.loads(line) for line in tasks.read_text().splitlines()]


def _task(base: Path, row: dict) -> SweTask:
    return SweTask.from_row(row, where="t.jsonl line 1", base_dir=base)


def test_a_row_in_swe_bench_form(rows):
    base, (row, _) = rows
    task = _task(base, row | {"FAIL_TO_PASS": json.dumps(row["FAIL_TO_PASS"])})  # SWE-bench keeps JSON text
    assert task.repo == base / "calclib" and task.fail_to_pass == ("tests/test_ops.py::test_clamp_high",)
    assert len(task.pass_to_pass) == 4 and task.venv is None
    ((source, commit),) = resolve_commits({"k": task}, import_dir=base / "imports").values()
    assert commit == row["base_commit"] and source.git_dir == base / "calclib" / ".git"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"FAIL_TO_PASS": []}, "t.jsonl line 1: FAIL_TO_PASS is empty"),
        ({"FAIL_TO_PASS": "not json"}, "field 'FAIL_TO_PASS' is a string but not a JSON list"),
        ({"PASS_TO_PASS": [1]}, "field 'PASS_TO_PASS' must be a list of test ids"),
        (
            {"FAIL_TO_PASS": ["../x.py::t"]},
            "FAIL_TO_PASS test id '../x.py::t': path '../x.py' must be relative",
        ),
        ({"test_cmd": " "}, "field 'test_cmd' is empty"),
        ({"patch": 3}, "field 'patch' must be a string, got int"),
        ({"test_patch": "diff --git a/../x b/../x\n"}, "field 'test_patch': path '../x' must be relative"),
        ({"test_cmd": "pytest -q"}, "field 'test_cmd' has no {tests} placeholder"),
        ({"mutation": "swap"}, "field 'mutation' must be an object, got str"),
    ],
)
def test_bad_rows_are_named(rows, change, message):
    base, (row, _) = rows
    with pytest.raises(TaskDataError, match=re.escape(message)):
        _task(base, row | change)


def test_missing_field(rows):
    base, (row, _) = rows
    with pytest.raises(TaskDataError, match="t.jsonl line 1: no field 'test_cmd'"):
        _task(base, {k: v for k, v in row.items() if k != "test_cmd"})


def test_repository_commit_and_venv_are_checked(rows, tmp_path):
    base, (row, _) = rows
    with pytest.raises(TaskDataError, match="field 'repo' / 'base_commit': .* has no commit 'feedface'"):
        resolve_commits({"k": _task(base, row | {"base_commit": "feedface"})}, import_dir=tmp_path)
    with pytest.raises(
        TaskDataError, match="field 'repo' / 'base_commit': repository .*nowhere does not exist"
    ):
        resolve_commits({"k": _task(base, row | {"repo": "nowhere"})}, import_dir=tmp_path)
    with pytest.raises(TaskDataError, match="field 'venv': .*/bin/python does not exist"):
        resolve_commits({"k": _task(base, row | {"venv": str(tmp_path)})}, import_dir=tmp_path)
    no_pytest = tmp_path / "bare-venv"
    (no_pytest / "bin").mkdir(parents=True)
    (no_pytest / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    (no_pytest / "bin" / "python").chmod(0o755)  # an interpreter without site-packages: no pytest
    with pytest.raises(TaskDataError, match="grading runs pytest, which the venv .*bare-venv cannot import"):
        resolve_commits({"k": _task(base, row | {"venv": str(no_pytest)})}, import_dir=tmp_path)


def test_parquet_rows_read_like_jsonl(rows, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from asyncrl.envs.task_data import TaskTable

    base, data = rows
    path = base / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(data), path)
    config = {
        "path": str(path),
        "prompt_field": "problem_statement",
        "answer_field": "",
        "eval_fraction": 0.0,
    }
    table = TaskTable.load(config)
    rows = (table.row("train", i) for i in range(table.size("train")))
    parsed = sorted(
        (SweTask.from_row(r.row, where=r.where, base_dir=base) for r in rows),
        key=lambda t: t.instance_id,
    )
    assert [t.instance_id for t in parsed] == ["calclib-clamp", "calclib-mean"]
    assert parsed[1].fail_to_pass == ("tests/test_ops.py::test_mean_empty",) and parsed[
        1
    ].test_patch.startswith("diff")


def test_relative_paths_are_taken_from_the_tasks_files_directory(rows, tmp_path, monkeypatch):
    base, (row, _) = rows
    path = base / "sub" / "tasks.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(row | {"repo": "../calclib", "venv": "venvs/a"}) + "\n")
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    (task,) = read_tasks(path)
    assert task.repo == base / "sub" / ".." / "calclib" and task.venv == base / "sub" / "venvs" / "a"
    out = base / "tasks.jsonl"
    write_tasks(out, [task])  # written back relative to the new file's directory when under it
    written = json.loads(out.read_text())
    assert written["repo"] == "sub/../calclib" and written["venv"] == "sub/venvs/a"
    write_tasks(tmp_path / "elsewhere.jsonl", [task])  # elsewhere: absolute
    assert json.loads((tmp_path / "elsewhere.jsonl").read_text())["repo"] == str(
        base / "sub" / ".." / "calclib"
    )
    assert read_tasks(out) == [
        dataclasses.replace(task, repo=base / "sub/../calclib", where="tasks.jsonl line 1")
    ]


def test_rows_round_trip_with_optional_fields_and_json_text_ids(rows, tmp_path):
    _, (row, _) = rows
    short = {k: v for k, v in row.items() if k not in ("test_patch", "PASS_TO_PASS")}
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        json.dumps(short | {"FAIL_TO_PASS": json.dumps(row["FAIL_TO_PASS"]), "mutation": {"line": 3}}) + "\n"
    )
    (task,) = read_tasks(path)
    assert task.test_patch == "" and task.pass_to_pass == () and task.mutation == {"line": 3}
    write_tasks(path, [task])
    assert read_tasks(path) == [task]
    assert json.loads(path.read_text())["FAIL_TO_PASS"] == row["FAIL_TO_PASS"]


def test_duplicate_instance_ids_are_an_error(rows, tmp_path):
    _, (row, _) = rows
    path = tmp_path / "tasks.jsonl"
    path.write_text((json.dumps(row) + "\n") * 2)
    with pytest.raises(SweTaskError, match="line 2: instance_id 'calclib-clamp' appears twice"):
        read_tasks(path)


def test_test_cmd_quotes_ids_for_the_shell():
    cmd = format_test_cmd("python -m pytest {tests} -q", ["t.py::a", "t.py::b[x y]"])
    assert cmd == "python -m pytest t.py::a 't.py::b[x y]' -q"
    assert format_test_cmd("pytest {tests}", []) == "pytest "
    with pytest.raises(SweTaskError, match="has no {tests} placeholder"):
        format_test_cmd("pytest", ["t.py::a"])

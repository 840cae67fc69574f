"""SWE-bench-form rows: accepted shapes, and errors that name the row and the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from asyncrl.envs.builtin.swe.example import write_example
from asyncrl.envs.builtin.swe.tasks import SweTask, resolve_commits
from asyncrl.envs.task_data import TaskDataError, TaskRow


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    tasks = write_example(tmp_path_factory.mktemp("example"))
    return tasks.parent, [json.loads(line) for line in tasks.read_text().splitlines()]


def _task(base: Path, row: dict) -> SweTask:
    return SweTask.from_row(TaskRow(prompt=[], answer=None, row=row, where="t.jsonl line 1"), base_dir=base)


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
    parsed = sorted(
        (SweTask.from_row(table.row("train", i), base_dir=base) for i in range(table.size("train"))),
        key=lambda t: t.instance_id,
    )
    assert [t.instance_id for t in parsed] == ["calclib-clamp", "calclib-mean"]
    assert parsed[1].fail_to_pass == ("tests/test_ops.py::test_mean_empty",) and parsed[
        1
    ].test_patch.startswith("diff")

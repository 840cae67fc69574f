"""SWE-bench-form task rows: reading, checking and resolving them.

One row (JSONL line, JSON item or Parquet row)::

    {"instance_id": "mylib-42", "repo": "repos/mylib", "base_commit": "3f2c1ab",
     "problem_statement": "clamp() returns hi when x is below lo ...",
     "patch": "diff --git a/mylib/ops.py b/mylib/ops.py ...",       # the reference fix
     "test_patch": "diff --git a/tests/test_ops.py ...",             # may be ""
     "FAIL_TO_PASS": ["tests/test_ops.py::test_clamp_low"],          # a list, or its JSON text
     "PASS_TO_PASS": ["tests/test_ops.py::test_add"],
     "test_cmd": "python -m pytest -q -p no:cacheprovider {tests}",
     "venv": "/opt/venvs/mylib"}                                      # optional

`repo` is a git repository (work tree or bare) or a plain directory (then `base_commit` is empty);
a relative path is taken from the directory of the tasks file. Test ids are pytest node ids,
relative to the repository root. `venv` (optional) is the Python environment the tests need,
mounted read-only in the sandbox; without it, the environment asyncrl runs in. Everything is
checked when the env is built: a missing field, a wrong type, a repository or commit that does not
exist raises `TaskDataError` naming the row and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from asyncrl.envs.builtin.swe.checkout import CheckoutError, GitSource, safe_relative
from asyncrl.envs.builtin.swe.patch import PatchError, touched_paths
from asyncrl.envs.task_data import TaskDataError, TaskRow

__all__ = ["REQUIRED_FIELDS", "SweTask", "resolve_commits", "test_file"]

K = TypeVar("K")
REQUIRED_FIELDS = (
    "instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS",
    "PASS_TO_PASS", "test_cmd",
)  # fmt: skip


def test_file(test_id: str) -> str:
    """The file of a pytest node id: `tests/test_a.py::TestX::test_y[1]` -> `tests/test_a.py`."""
    return test_id.split("::", 1)[0]


@dataclass(frozen=True, kw_only=True)
class SweTask:
    """One checked task row (see the module docstring)."""

    instance_id: str
    repo: Path
    base_commit: str  # as given; the full id comes from `resolve_commits`
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_cmd: str
    venv: Path | None
    where: str  # "tasks.jsonl line 3", for messages

    @classmethod
    def from_row(cls, row: TaskRow, *, base_dir: Path) -> SweTask:
        data, where = row.row, row.where
        missing = [f for f in REQUIRED_FIELDS if f not in data]
        if missing:
            raise TaskDataError(f"{where}: no field {missing[0]!r} (the row has {sorted(data)})")
        text = {
            f: _string(where, f, data[f])
            for f in REQUIRED_FIELDS
            if f not in ("FAIL_TO_PASS", "PASS_TO_PASS")
        }
        for f in ("instance_id", "repo", "problem_statement", "test_cmd"):
            if not text[f].strip():
                raise TaskDataError(f"{where}: field {f!r} is empty")
        f2p, p2p = (
            _test_ids(where, "FAIL_TO_PASS", data["FAIL_TO_PASS"]),
            _test_ids(where, "PASS_TO_PASS", data["PASS_TO_PASS"]),
        )
        if not f2p:
            raise TaskDataError(
                f"{where}: FAIL_TO_PASS is empty; a task needs a test that the fix makes pass"
            )
        _check_patch(where, "patch", text["patch"])
        _check_patch(where, "test_patch", text["test_patch"])
        venv = data.get("venv")
        return cls(
            instance_id=text["instance_id"], repo=_path(base_dir, text["repo"]), base_commit=text["base_commit"].strip(),
            problem_statement=text["problem_statement"], patch=text["patch"], test_patch=text["test_patch"],
            fail_to_pass=f2p, pass_to_pass=p2p, test_cmd=text["test_cmd"],
            venv=_path(base_dir, _string(where, "venv", venv)) if venv else None, where=where,
        )  # fmt: skip


def _string(where: str, name: str, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TaskDataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _test_ids(where: str, name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):  # SWE-bench's own files keep these lists as JSON text
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{where}: field {name!r} is a string but not a JSON list: {e}") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise TaskDataError(
            f"{where}: field {name!r} must be a list of test ids (strings), got {value!r:.200}"
        )
    for t in value:
        try:
            safe_relative(test_file(t))
        except CheckoutError as e:
            raise TaskDataError(f"{where}: {name} test id {t!r}: {e}") from None
    return tuple(value)


def _check_patch(where: str, name: str, text: str) -> None:
    try:
        for path in touched_paths(text):
            safe_relative(path)
    except (PatchError, CheckoutError) as e:
        raise TaskDataError(f"{where}: field {name!r}: {e}") from None


def _path(base_dir: Path, value: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else base_dir / path


def resolve_commits(tasks: dict[K, SweTask], *, import_dir: Path) -> dict[K, tuple[GitSource, str]]:
    """{key: (the task's source, its full base commit)}: one git call per repository, every row checked."""
    by_repo: dict[Path, list[tuple[K, SweTask]]] = {}
    for key, task in tasks.items():
        by_repo.setdefault(task.repo.resolve(), []).append((key, task))
    resolved = {}
    for repo, group in by_repo.items():
        try:
            source = GitSource.open(repo, import_dir=import_dir)
            commits = source.resolve([t.base_commit for _, t in group])
        except CheckoutError as e:
            raise TaskDataError(f"{group[0][1].where}: field 'repo' / 'base_commit': {e}") from None
        for key, task in group:
            resolved[key] = (source, commits[task.base_commit])
    for task in tasks.values():
        if task.venv is not None and not (task.venv / "bin" / "python").exists():
            raise TaskDataError(f"{task.where}: field 'venv': {task.venv}/bin/python does not exist")
    return resolved

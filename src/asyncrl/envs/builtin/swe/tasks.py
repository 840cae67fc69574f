"""SWE-bench-form task rows: the one reader and writer of the format (the `swe` env and `asyncrl swe-tasks`).

One row (JSONL line, JSON item or Parquet row)::

    {"instance_id": "mylib-42", "repo": "repos/mylib", "base_commit": "3f2c1ab",
     "problem_statement": "clamp() returns hi when x is below lo ...",
     "patch": "diff --git a/mylib/ops.py b/mylib/ops.py ...",       # the reference fix
     "test_patch": "diff --git a/tests/test_ops.py ...",             # "" or absent: none
     "FAIL_TO_PASS": ["tests/test_ops.py::test_clamp_low"],          # a list, or its JSON text
     "PASS_TO_PASS": ["tests/test_ops.py::test_add"],                # absent: none
     "test_cmd": "python -m pytest -q -p no:cacheprovider {tests}",
     "venv": "/opt/venvs/mylib",                                      # optional
     "mutation": {"file": "mylib/ops.py", ...}}                       # optional, never shown to a model

`repo` is a git repository (work tree or bare) or a plain directory (then `base_commit` is empty).
Relative `repo` and `venv` paths are taken from the directory that holds the tasks file, so a task
file and its repositories move together and work from any working directory; `write_tasks` writes
them that way. Test ids are pytest node ids, relative to the repository root. `test_cmd` is run by
bash from the checkout root; `{tests}` in it becomes the shell-quoted ids (`format_test_cmd`).
`venv` is the Python environment the tests need (with pytest), mounted read-only in the sandbox;
without it, the environment asyncrl runs in. A row that breaks these rules raises `SweTaskError`
naming the row and the field; `resolve_commits` checks repositories, commits and venvs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from asyncrl.envs.builtin.swe.checkout import CheckoutError, GitSource, safe_relative
from asyncrl.envs.builtin.swe.patch import PatchError, touched_paths
from asyncrl.envs.task_data import TaskDataError, read_rows

__all__ = [
    "DEFAULT_TEST_CMD",
    "REQUIRED_FIELDS",
    "TESTS_PLACEHOLDER",
    "SweTask",
    "SweTaskError",
    "format_test_cmd",
    "read_tasks",
    "resolve_commits",
    "test_file",
    "write_tasks",
]

K = TypeVar("K")
REQUIRED_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "patch",
    "FAIL_TO_PASS",
    "test_cmd",
)
TESTS_PLACEHOLDER = "{tests}"
# -rA: a summary line per test for whoever reads the output (grading reads a plugin's report);
# --rootdir=.: test ids are relative to the checkout root whichever tests are named; no cache
# provider: a run leaves no .pytest_cache behind. No plugin autoload: the run does not depend on
# which pytest plugins the environment happens to have, and starts in a fraction of the time.
DEFAULT_TEST_CMD = (
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider --rootdir=. {tests}"
)


class SweTaskError(TaskDataError):
    """A task row or task file that cannot be used: the message names the row and the field."""


def test_file(test_id: str) -> str:
    """The file of a pytest node id: `tests/test_a.py::TestX::test_y[1]` -> `tests/test_a.py`."""
    return test_id.split("::", 1)[0]


def format_test_cmd(test_cmd: str, test_ids: Sequence[str]) -> str:
    """`test_cmd` with `{tests}` replaced by the shell-quoted ids (none: the whole suite)."""
    if TESTS_PLACEHOLDER not in test_cmd:
        raise SweTaskError(f"test_cmd {test_cmd!r} has no {TESTS_PLACEHOLDER} placeholder")
    return test_cmd.replace(TESTS_PLACEHOLDER, shlex.join(test_ids))


@dataclass(frozen=True, kw_only=True)
class SweTask:
    """One checked task (see the module docstring).

    Example::

        SweTask(instance_id="calclib-clamp", repo=Path("/data/swe/calclib"), base_commit="3f2e...",
                problem_statement="clamp(x, lo, hi) returns hi - 1 ...", patch="diff --git a/...",
                fail_to_pass=("tests/test_ops.py::test_clamp_high",),
                pass_to_pass=("tests/test_ops.py::test_add",))
    """

    instance_id: str
    repo: Path  # where the repository is (a relative row path joined to the tasks file's directory)
    base_commit: str  # as given; the full id comes from `resolve_commits`; "" for a plain directory
    problem_statement: str
    patch: str  # the reference fix: a unified diff that turns base_commit into the fixed code
    test_patch: str = ""  # applied before the tests run; empty for mutation tasks
    fail_to_pass: tuple[str, ...]  # test ids that fail at base_commit and pass with the patch
    pass_to_pass: tuple[str, ...] = ()  # test ids that pass in both states
    test_cmd: str = DEFAULT_TEST_CMD
    venv: Path | None = None
    mutation: dict[str, Any] = field(default_factory=dict)  # where a made bug is: the answer key
    where: str = "row"  # "tasks.jsonl line 3", for messages

    @classmethod
    def from_row(cls, data: dict[str, Any], *, where: str, base_dir: Path) -> SweTask:
        missing = [f for f in REQUIRED_FIELDS if f not in data]
        if missing:
            raise SweTaskError(f"{where}: no field {missing[0]!r} (the row has {sorted(data)})")
        strings = [f for f in (*REQUIRED_FIELDS, "test_patch", "venv") if f != "FAIL_TO_PASS"]
        text = {f: _string(where, f, data.get(f)) for f in strings}
        for f in ("instance_id", "repo", "problem_statement", "test_cmd"):
            if not text[f].strip():
                raise SweTaskError(f"{where}: field {f!r} is empty")
        if TESTS_PLACEHOLDER not in text["test_cmd"]:
            raise SweTaskError(f"{where}: field 'test_cmd' has no {TESTS_PLACEHOLDER} placeholder")
        f2p = _test_ids(where, "FAIL_TO_PASS", data["FAIL_TO_PASS"])
        if not f2p:
            raise SweTaskError(f"{where}: FAIL_TO_PASS is empty; a task needs a test that the fix makes pass")
        _check_patch(where, "patch", text["patch"])
        _check_patch(where, "test_patch", text["test_patch"])
        mutation = data.get("mutation") or {}
        if not isinstance(mutation, dict):
            raise SweTaskError(f"{where}: field 'mutation' must be an object, got {type(mutation).__name__}")
        return cls(
            instance_id=text["instance_id"],
            repo=_path(base_dir, text["repo"]),
            base_commit=text["base_commit"].strip(),
            problem_statement=text["problem_statement"],
            patch=text["patch"],
            test_patch=text["test_patch"],
            fail_to_pass=f2p,
            pass_to_pass=_test_ids(where, "PASS_TO_PASS", data.get("PASS_TO_PASS") or []),
            test_cmd=text["test_cmd"],
            venv=_path(base_dir, text["venv"]) if text["venv"] else None,
            mutation=dict(mutation),
            where=where,
        )

    def to_row(self, *, base_dir: Path) -> dict[str, Any]:
        """The row, with `repo` and `venv` relative to `base_dir` when they lie under it."""
        row = {
            "instance_id": self.instance_id,
            "repo": _relative(self.repo, base_dir),
            "base_commit": self.base_commit,
            "problem_statement": self.problem_statement,
            "patch": self.patch,
            "test_patch": self.test_patch,
            "FAIL_TO_PASS": list(self.fail_to_pass),
            "PASS_TO_PASS": list(self.pass_to_pass),
            "test_cmd": self.test_cmd,
        }
        if self.venv is not None:
            row["venv"] = _relative(self.venv, base_dir)
        return row | ({"mutation": self.mutation} if self.mutation else {})


def read_tasks(path: str | Path) -> list[SweTask]:
    """The checked rows of a JSONL/JSON/Parquet file (or save_to_disk directory); ids must be unique."""
    base_dir = Path(path).expanduser().absolute().parent
    tasks = [SweTask.from_row(row, where=where, base_dir=base_dir) for where, row in read_rows(path)]
    seen: set[str] = set()
    for task in tasks:
        if task.instance_id in seen:
            raise SweTaskError(f"{task.where}: instance_id {task.instance_id!r} appears twice in {path}")
        seen.add(task.instance_id)
    return tasks


def write_tasks(path: str | Path, tasks: Iterable[SweTask]) -> None:
    """JSONL, one row a line, paths relative to the file's directory; written to a temporary name,
    then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    base_dir = path.absolute().parent
    tmp = path.with_name(path.name + ".tmp")
    lines = (json.dumps(t.to_row(base_dir=base_dir), ensure_ascii=False) + "\n" for t in tasks)
    tmp.write_text("".join(lines), encoding="utf-8")
    tmp.replace(path)


def _string(where: str, name: str, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise SweTaskError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _test_ids(where: str, name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):  # SWE-bench's own files keep these lists as JSON text
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise SweTaskError(f"{where}: field {name!r} is a string but not a JSON list: {e}") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise SweTaskError(
            f"{where}: field {name!r} must be a list of test ids (strings), got {value!r:.200}"
        )
    for t in value:
        try:
            safe_relative(test_file(t))
        except CheckoutError as e:
            raise SweTaskError(f"{where}: {name} test id {t!r}: {e}") from None
    return tuple(value)


def _check_patch(where: str, name: str, text: str) -> None:
    try:
        for path in touched_paths(text):
            safe_relative(path)
    except (PatchError, CheckoutError) as e:
        raise SweTaskError(f"{where}: field {name!r}: {e}") from None


def _path(base_dir: Path, value: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else base_dir / path


def _relative(path: Path, base_dir: Path) -> str:
    absolute = path.absolute()
    return str(absolute.relative_to(base_dir)) if absolute.is_relative_to(base_dir) else str(absolute)


def resolve_commits(tasks: dict[K, SweTask], *, import_dir: Path) -> dict[K, tuple[GitSource, str]]:
    """{key: (the task's source, its full base commit)}: one git call per repository, every row checked,
    and each venv (or asyncrl's own environment) able to import pytest, which grading runs."""
    by_repo: dict[Path, list[tuple[K, SweTask]]] = {}
    for key, task in tasks.items():
        by_repo.setdefault(task.repo.resolve(), []).append((key, task))
    resolved = {}
    for repo, group in by_repo.items():
        try:
            source = GitSource.open(repo, import_dir=import_dir)
            commits = source.resolve([t.base_commit for _, t in group])
        except CheckoutError as e:
            raise SweTaskError(f"{group[0][1].where}: field 'repo' / 'base_commit': {e}") from None
        for key, task in group:
            resolved[key] = (source, commits[task.base_commit])
    for venv, task in {t.venv: t for t in tasks.values()}.items():
        _check_pytest(venv, task.where)
    return resolved


def _check_pytest(venv: Path | None, where: str) -> None:
    if venv is None:
        found = importlib.util.find_spec("pytest") is not None
    else:
        python = venv / "bin" / "python"
        if not python.exists():
            raise SweTaskError(f"{where}: field 'venv': {python} does not exist")
        probe = subprocess.run([str(python), "-c", "import pytest"], capture_output=True, check=False)
        found = probe.returncode == 0
    if not found:
        owner = f"the venv {venv}" if venv is not None else f"asyncrl's environment ({sys.prefix})"
        raise SweTaskError(
            f"{where}: grading runs pytest, which {owner} cannot import: install it there "
            '(pip install pytest, or pip install -e ".[swe]"), or name a venv that has it in the row\'s '
            '"venv"'
        )

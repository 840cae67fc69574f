"""SWE-bench-form task rows: the fields, how `test_cmd` takes test ids, and how pytest's report is read.

A row (one JSON object a line, or a Parquet row)::

    {"instance_id": "toolz__toolz.itertoolz.get__off-by-one__0c74ba",
     "repo": "examples/swe/repos/toolz/toolz__toolz.itertoolz.get__off-by-one__0c74ba",
     "base_commit": "<40 hex digits: the buggy state>",
     "problem_statement": "...", "patch": "<unified diff: buggy -> fixed>", "test_patch": "",
     "FAIL_TO_PASS": ["toolz/tests/test_itertoolz.py::test_get"],
     "PASS_TO_PASS": ["toolz/tests/test_itertoolz.py::test_take", ...],
     "test_cmd": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider --rootdir=. {tests}"}

`test_cmd` is run by a POSIX shell from the root of a checkout of `base_commit`; `{tests}` is
replaced by the test ids to run, shell-quoted and space-separated (`format_test_cmd`). Its output
must carry pytest's `-rA` summary lines (`PASSED <id>`, `FAILED <id> - ...`), which
`parse_test_outcomes` reads: a test passed iff a `PASSED <id>` line names it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.envs.task_data import TaskDataError, read_rows

__all__ = [
    "DEFAULT_TEST_CMD",
    "SweTask",
    "SweTaskError",
    "format_test_cmd",
    "parse_test_outcomes",
    "read_tasks",
    "resolve_repo",
    "write_tasks",
]

TESTS_PLACEHOLDER = "{tests}"
# -rA: a summary line per test, whatever its outcome; --rootdir=.: test ids are relative to the
# checkout root whichever tests are named; no cache provider: a run leaves no .pytest_cache behind.
# No plugin autoload: the run does not depend on which pytest plugins the environment happens to
# have installed, and starts in a fraction of the time (hypothesis' plugin alone takes seconds).
DEFAULT_TEST_CMD = (
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider --rootdir=. {tests}"
)
_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "FAIL_TO_PASS", "test_cmd")
_OUTCOME_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (.+)$")


class SweTaskError(TaskDataError):
    """A task row or a task file that cannot be used: the message says which row and field."""


@dataclass(frozen=True, kw_only=True)
class SweTask:
    """One task. `repo` is a local git repository (or a directory) holding `base_commit`.

    Example::

        SweTask(instance_id="demo__calc.add__swap-operator__0a1b2c", repo="tasks-repos/demo__...",
                base_commit="3f2e...", problem_statement="Running the tests ... fails", patch="--- a/...",
                fail_to_pass=("tests/test_calc.py::test_add",), pass_to_pass=("tests/test_calc.py::test_sub",))
    """

    instance_id: str
    repo: str  # relative paths are taken from the working directory (resolve_repo)
    base_commit: str
    problem_statement: str
    patch: str  # the reference fix: a unified diff (git apply) that turns base_commit into the fixed code
    test_patch: str = ""  # applied before the tests run, in both states; empty for mutation tasks
    fail_to_pass: tuple[str, ...]  # test ids that fail at base_commit and pass with the patch
    pass_to_pass: tuple[str, ...] = ()  # test ids that pass in both states
    test_cmd: str = DEFAULT_TEST_CMD
    # Where the bug was made (file, function, operator, line): the answer key, never shown to a model.
    mutation: dict[str, Any] = field(default_factory=dict)

    def to_row(self) -> dict[str, Any]:
        row = {
            "instance_id": self.instance_id,
            "repo": self.repo,
            "base_commit": self.base_commit,
            "problem_statement": self.problem_statement,
            "patch": self.patch,
            "test_patch": self.test_patch,
            "FAIL_TO_PASS": list(self.fail_to_pass),
            "PASS_TO_PASS": list(self.pass_to_pass),
            "test_cmd": self.test_cmd,
        }
        return row | ({"mutation": self.mutation} if self.mutation else {})

    @classmethod
    def from_row(cls, row: dict[str, Any], where: str = "row") -> SweTask:
        missing = [k for k in _REQUIRED if row.get(k) in (None, "", [], "[]")]
        if missing:
            raise SweTaskError(f"{where}: no {missing} (the row has {sorted(row)})")
        if TESTS_PLACEHOLDER not in row["test_cmd"]:
            raise SweTaskError(
                f"{where}: test_cmd {row['test_cmd']!r} has no {TESTS_PLACEHOLDER} placeholder"
            )
        return cls(
            instance_id=str(row["instance_id"]),
            repo=str(row["repo"]),
            base_commit=str(row["base_commit"]),
            problem_statement=str(row["problem_statement"]),
            patch=str(row["patch"]),
            test_patch=str(row.get("test_patch") or ""),
            fail_to_pass=_test_ids(row, "FAIL_TO_PASS", where),
            pass_to_pass=_test_ids(row, "PASS_TO_PASS", where),
            test_cmd=str(row["test_cmd"]),
            mutation=dict(row.get("mutation") or {}),
        )


def _test_ids(row: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    """A list of ids, or (as SWE-bench's Hub datasets store them) a JSON string of one."""
    value = row.get(key) or []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise SweTaskError(f"{where}: {key} is a string but not a JSON list: {value[:80]!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SweTaskError(f"{where}: {key} must be a list of test ids, got {value!r:.80}")
    return tuple(value)


def read_tasks(path: str | Path) -> list[SweTask]:
    """The rows of a JSONL/JSON/Parquet task file, checked; instance ids must be unique."""
    tasks = [SweTask.from_row(row, where) for where, row in read_rows(path)]
    seen: set[str] = set()
    for task in tasks:
        if task.instance_id in seen:
            raise SweTaskError(f"{path}: instance_id {task.instance_id!r} appears twice")
        seen.add(task.instance_id)
    return tasks


def write_tasks(path: str | Path, tasks: Iterable[SweTask]) -> None:
    """JSONL, one row a line, written to a temporary name and then renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(
        "".join(json.dumps(t.to_row(), ensure_ascii=False) + "\n" for t in tasks), encoding="utf-8"
    )
    tmp.replace(path)


def resolve_repo(repo: str, base: Path | None = None) -> Path:
    """Where a row's `repo` is: absolute as written, relative ones from `base` (the working directory)."""
    p = Path(repo).expanduser()
    return p if p.is_absolute() else (base or Path.cwd()) / p


def format_test_cmd(test_cmd: str, test_ids: Sequence[str]) -> str:
    """`test_cmd` with `{tests}` replaced by the shell-quoted ids (nothing: the whole suite)."""
    if TESTS_PLACEHOLDER not in test_cmd:
        raise SweTaskError(f"test_cmd {test_cmd!r} has no {TESTS_PLACEHOLDER} placeholder")
    return test_cmd.replace(TESTS_PLACEHOLDER, shlex.join(test_ids))


def _named_id(rest: str, wanted: set[str]) -> str | None:
    """The id a summary line names: FAILED/ERROR lines append " - <message>", and an id (a
    parametrized one) may itself hold " - ", so every split point is tried against the known ids."""
    if rest in wanted:
        return rest
    i = rest.find(" - ")
    while i >= 0:
        if rest[:i] in wanted:
            return rest[:i]
        i = rest.find(" - ", i + 1)
    return None


def parse_test_outcomes(output: str, test_ids: Iterable[str]) -> dict[str, str]:
    """The outcome of each of `test_ids` in pytest `-rA` output: "passed", "failed" (FAILED, ERROR,
    XPASS), "skipped" (SKIPPED, XFAIL) or "missing" (no summary line names it: not collected, or
    the run died)."""
    wanted = set(test_ids)
    outcomes = dict.fromkeys(wanted, "missing")
    for line in output.splitlines():
        m = _OUTCOME_LINE.match(line.rstrip())
        if m is None:
            continue
        status, rest = m.groups()
        test_id = _named_id(rest, wanted)
        if test_id is None:
            continue
        if status == "PASSED":
            outcomes[test_id] = "passed"
        elif status in ("SKIPPED", "XFAIL"):
            outcomes[test_id] = "skipped"
        else:
            outcomes[test_id] = "failed"
    return outcomes

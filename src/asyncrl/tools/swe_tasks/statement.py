"""Problem statements: the symptom, as a user would report it from a failing test run, never the fix.

A statement names the failing tests, the command that shows the failure, and for the first few
tests the error and the traceback's frames inside the repository (file, line, function: no source
lines). It never holds the diff or any line the reference fix adds (`leaks_fix`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from asyncrl.envs.builtin.swe.tasks import format_test_cmd
from asyncrl.tools.swe_tasks.runner import Failure

__all__ = ["fix_lines", "leaks_fix", "problem_statement"]

_MAX_SHOWN = 3  # tests whose error and traceback are shown
_MAX_ERROR_LINES = 12
_MAX_ERROR_CHARS = 1200
_MAX_FRAMES = 6
_ADDRESS = re.compile(r"at 0x[0-9a-fA-F]+")
_MIN_LEAK_CHARS = 8  # shorter fix lines (`else:`, `)`) are too common to give a fix away


def _error_text(error: str) -> list[str]:
    # Object addresses differ from run to run; without them a statement is reproducible.
    lines = _ADDRESS.sub("at 0x...", error).strip().splitlines() or ["(no message)"]
    text = "\n".join(lines[:_MAX_ERROR_LINES])[:_MAX_ERROR_CHARS]
    out = text.splitlines()
    if len(lines) > _MAX_ERROR_LINES or len(text) == _MAX_ERROR_CHARS:
        out.append("...")
    return out


def _describe(test_id: str, failure: Failure | None) -> list[str]:
    if failure is None:
        return [test_id, "    did not run (it could not be collected, or the test run died first)"]
    where = "" if failure.when == "call" else f" (in {failure.when})"
    lines = [f"{test_id}{where}", *("    " + line for line in _error_text(failure.error))]
    if failure.frames:
        lines.append("    traceback, most recent call last:")
        lines += [f"      {path}:{line} in {name}" for path, line, name in failure.frames[-_MAX_FRAMES:]]
    return lines


def problem_statement(failing: Sequence[str], failures: Mapping[str, Failure], test_cmd: str) -> str:
    """The report of a run in which the tests `failing` fail (each with its `failures` entry)."""
    assert failing, "a statement needs a failing test"
    shown = list(failing[:_MAX_SHOWN])
    noun = "a test fails" if len(failing) == 1 else f"{len(failing)} tests fail"
    parts = [
        f"After the latest change, {noun} in this repository. Running",
        "",
        "    " + format_test_cmd(test_cmd, shown).strip(),
        "",
        "shows:",
        "",
    ]
    for test_id in shown:
        parts += [*_describe(test_id, failures.get(test_id)), ""]
    rest = failing[_MAX_SHOWN:]
    if rest:
        parts += [f"These fail too ({len(rest)}):", *(f"    {t}" for t in rest[:20])]
        parts += ([f"    ... and {len(rest) - 20} more"] if len(rest) > 20 else []) + [""]
    parts.append("The tests are correct. Fix the code so that they pass and the other tests keep passing.")
    return "\n".join(parts)


def fix_lines(patch: str) -> list[str]:
    """The lines a patch adds (its fix), stripped; short ones left out (see _MIN_LEAK_CHARS)."""
    added = (
        line[1:].strip() for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")
    )
    return [line for line in added if len(line) >= _MIN_LEAK_CHARS]


def leaks_fix(statement: str, patch: str) -> bool:
    """Whether the statement gives the fix away: the diff, or a line the fix adds."""
    return patch.strip() in statement or any(line in statement for line in fix_lines(patch))

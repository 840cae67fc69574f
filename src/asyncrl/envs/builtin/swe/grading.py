"""Grading a `swe` episode: the task's tests, run on pristine test files after the test patch.

    grade = await grade_episode(sandbox, checkout, task, env=sandbox_env, timeout_s=300)
    grade.fail_to_pass, grade.pass_to_pass, grade.resolved   # 0.5, 1.0, False

In the episode's own sandbox, once the agent is done (nothing of it runs any more):
1. every protected path goes back to the base commit (`protected_paths`: the files of the test ids
   and of the test patch, test files by name and directory, pytest configuration, conftest.py,
   sitecustomize.py); those the commit lacks are removed, so an added conftest.py does not count;
2. the test patch is applied;
3. `test_cmd` runs (`{tests}` in it becomes the test ids) with the pytest plugin of
   `pytest_plugin.py`, which writes each test's outcome with a per-run nonce to a report file.
A test counts as passing when it passed or xfailed. The code under test runs in the same process as
pytest, so determined code can still reach the plugin's state; the nonce defeats printed results.
`write_python_shim`, `report_env`, `read_report` and `fraction_passing` are also how `asyncrl
swe-tasks --verify` runs and reads a test command, so a verified row scores as the env grades it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import secrets
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from asyncrl.envs.builtin.swe.checkout import CheckoutError, GitCheckout
from asyncrl.envs.builtin.swe.patch import touched_paths
from asyncrl.envs.builtin.swe.tasks import SweTask, format_test_cmd, test_file
from asyncrl.envs.sandbox_pool import PooledSandbox

__all__ = [
    "PASSING",
    "PLUGIN",
    "PLUGIN_MODULE",
    "Grade",
    "fraction_passing",
    "grade_episode",
    "is_protected",
    "protected_paths",
    "read_report",
    "report_env",
    "write_python_shim",
]

PLUGIN = Path(__file__).with_name("pytest_plugin.py")
PLUGIN_MODULE = "asyncrl_swe_report"  # the name it is loaded under (`-p`)
_PLUGIN_DIR = "/opt/asyncrl"
PASSING = ("passed", "xfailed")
# Test files and what configures or hooks into pytest or the interpreter.
TEST_DIRS = ("tests", "test", "testing")
TEST_NAMES = (
    "test_*.py",
    "*_test.py",
    "conftest.py",
    "pytest.ini",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
    "sitecustomize.py",
    "usercustomize.py",
    "*.pth",
)


@dataclass(frozen=True, kw_only=True)
class Grade:
    """The outcome of the task's tests at the end of an episode."""

    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed / failed / skipped / ...
    fail_to_pass: float = 0.0  # fraction of FAIL_TO_PASS passing
    pass_to_pass: float = 0.0  # fraction of PASS_TO_PASS passing (1.0 when there are none)
    test_run_s: float = 0.0
    error: str | None = None  # why the tests could not run or report (then everything counts as failing)

    @property
    def resolved(self) -> bool:
        return self.fail_to_pass == 1.0 and self.pass_to_pass == 1.0


def is_protected(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return any(d in TEST_DIRS for d in parts[:-1]) or any(fnmatch.fnmatch(parts[-1], n) for n in TEST_NAMES)


def protected_paths(task: SweTask, checkout: GitCheckout, work: Path) -> list[str]:
    """Paths that grading puts back as the base commit has them (see the module docstring)."""
    named = {test_file(t) for t in (*task.fail_to_pass, *task.pass_to_pass)} | touched_paths(task.test_patch)
    in_commit = {p for p in checkout.source.files(checkout.commit) if is_protected(p)}
    in_work = {
        str(p.relative_to(work))
        for p in work.rglob("*")
        if (p.is_file() or p.is_symlink()) and is_protected(str(p.relative_to(work)))
    }
    return sorted(named | in_commit | in_work)


async def grade_episode(
    sandbox: PooledSandbox,
    checkout: GitCheckout,
    task: SweTask,
    *,
    env: dict[str, str],
    timeout_s: float,
    read_only: tuple[tuple[str, str], ...] = (),
) -> Grade:
    """Steps 1-3 of the module docstring, then the fractions. Never raises for what the tests do.

    `env` and `read_only` (e.g. the task's venv) are those of the agent's commands."""
    sandbox.kill()
    work, private = sandbox.work, sandbox.private
    try:
        await asyncio.to_thread(checkout.restore, work, private, protected_paths(task, checkout, work))
        await asyncio.to_thread(checkout.apply, work, private, task.test_patch)
    except CheckoutError as e:
        return _score(task, {}, 0.0, f"restoring the tests failed: {e}")
    nonce = secrets.token_hex(16)
    report = f".asyncrl-swe-report-{nonce[:8]}"
    run_env = env | report_env(
        nonce, f"{sandbox.mount_point}/{report}", _PLUGIN_DIR, env.get("PYTHONPATH", "")
    )
    ids = (*task.fail_to_pass, *task.pass_to_pass)
    result = await sandbox.run(
        ["bash", "-c", format_test_cmd(task.test_cmd, ids)],
        env=run_env,
        timeout_s=timeout_s,
        read_only=(*read_only, (str(PLUGIN), f"{_PLUGIN_DIR}/{PLUGIN_MODULE}.py")),
    )
    outcomes = read_report(work / report, nonce)
    error = None
    if result.timed_out:
        error = f"the test command timed out after {timeout_s:g} s"
    elif not outcomes:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        error = (
            "the test command reported no outcome (it must run pytest); "
            f"exit code {result.returncode}: {tail[0]}"
        )
    return _score(task, outcomes, result.wall_s, error)


def report_env(nonce: str, report: str, plugin_dir: str, pythonpath: str) -> dict[str, str]:
    """The variables that load the report plugin (a copy named `PLUGIN_MODULE`.py in `plugin_dir`)
    into `test_cmd`'s pytest and have it write each outcome to the file `report`."""
    return {
        "ASYNCRL_SWE_NONCE": nonce,
        "ASYNCRL_SWE_REPORT": report,
        "PYTEST_ADDOPTS": f"-p {PLUGIN_MODULE}",
        "PYTHONPATH": f"{pythonpath}:{plugin_dir}" if pythonpath else plugin_dir,
    }


def write_python_shim(directory: Path, python: str) -> Path:
    """`directory` (made) with `python` and `python3` scripts that start `python`: put first on a test
    command's PATH, they give it the task's interpreter even where that interpreter's own bin has
    only python3 (Debian's /usr/bin). Scripts, not symlinks: a venv's interpreter finds its venv only
    when started by its own path."""
    directory.mkdir(parents=True)
    for name in ("python", "python3"):
        (directory / name).write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
        (directory / name).chmod(0o755)
    return directory


def read_report(path: Path, nonce: str) -> dict[str, str]:
    """{test id: outcome} from the lines of `path` that carry `nonce`; the file is removed."""
    outcomes = {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    finally:
        path.unlink(missing_ok=True)
    for line in lines:
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == nonce:
            outcomes[parts[2]] = parts[1]
    return outcomes


def fraction_passing(ids: tuple[str, ...], outcomes: dict[str, str]) -> float:
    """The share of `ids` that passed or xfailed (1.0 for none)."""
    return sum(outcomes.get(t) in PASSING for t in ids) / len(ids) if ids else 1.0


def _score(task: SweTask, outcomes: dict[str, str], run_s: float, error: str | None) -> Grade:
    return Grade(
        outcomes=outcomes,
        fail_to_pass=fraction_passing(task.fail_to_pass, outcomes),
        pass_to_pass=fraction_passing(task.pass_to_pass, outcomes),
        test_run_s=run_s,
        error=error,
    )

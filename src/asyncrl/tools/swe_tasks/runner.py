"""Running a repository's tests in a checkout: a row's `test_cmd` as the `swe` env grades it (its
report plugin gives each test's outcome), or with the probe plugin the generator reads (outcomes,
failures, and which functions each test ran).

Every run gets `python` = the task's venv's interpreter, or the one running asyncrl (a shim first
on PATH), and PYTHONDONTWRITEBYTECODE=1: a mutant and its fix can have the same size and
modification second, and a cached .pyc keyed by those would hide the change.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl.envs.builtin.swe.grading import PLUGIN, PLUGIN_MODULE, read_report, report_env, write_python_shim
from asyncrl.envs.builtin.swe.tasks import format_test_cmd

__all__ = ["CommandRun", "Failure", "ProbeRun", "TestRun", "TestRunner"]

_PROBE_MODULE = "asyncrl_swe_probe"
_PROBE_SOURCE = Path(__file__).with_name("probe_plugin.py")
_OUTPUT_CHARS = 200_000  # output kept per run (the tail): -rA summaries of thousands of tests fit


@dataclass(frozen=True, kw_only=True)
class CommandRun:
    output: str  # stdout and stderr, interleaved (the tail)
    returncode: int
    wall_s: float
    timed_out: bool


@dataclass(frozen=True, kw_only=True)
class Failure:
    """Why a test failed: the exception line(s) and the frames (path, line, function), innermost
    last; paths inside the checkout are relative to it."""

    when: str  # "setup", "call" or "teardown"
    error: str
    frames: tuple[tuple[str, int, str], ...]


@dataclass(frozen=True, kw_only=True)
class TestRun:
    __test__ = False  # not a pytest test class

    outcomes: dict[str, str]  # test id -> passed, failed, skipped, xfailed or xpassed (the env's report)
    run: CommandRun


@dataclass(frozen=True, kw_only=True)
class ProbeRun:
    outcomes: dict[str, str]  # test id -> "passed" | "failed" | "skipped"
    failures: dict[str, Failure]
    called: dict[str, frozenset[tuple[str, int]]]  # test id -> {(path, first line) of functions run}
    run: CommandRun

    @property
    def passed(self) -> set[str]:
        return {t for t, outcome in self.outcomes.items() if outcome == "passed"}


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_shell(cmd: str, cwd: Path, *, env: dict[str, str], timeout_s: float) -> CommandRun:
    """`cmd` in a POSIX shell in its own process group, killed as a group at the deadline."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        shell=True,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        out, _ = proc.communicate()
    finally:
        _kill_group(proc)  # descendants that outlived the shell
    text = out.decode(errors="replace")[-_OUTPUT_CHARS:]
    return CommandRun(
        output=text, returncode=proc.returncode, wall_s=time.monotonic() - t0, timed_out=timed_out
    )


class TestRunner:
    """Runs a `test_cmd` template in checkouts with `python` (default: this interpreter). Owns a
    scratch directory (both plugins, the `python` shim, the reports); `close()` removes it."""

    __test__ = False  # not a pytest test class

    def __init__(self, test_cmd: str, *, timeout_s: float, python: Path | None = None) -> None:
        self.test_cmd = test_cmd
        self.timeout_s = timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="asyncrl-swe-runner-"))
        write_python_shim(self._dir / "bin", str(python or sys.executable))
        shutil.copyfile(_PROBE_SOURCE, self._dir / f"{_PROBE_MODULE}.py")
        (self._dir / "report").mkdir()
        shutil.copyfile(PLUGIN, self._dir / "report" / f"{PLUGIN_MODULE}.py")

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(self._dir / "bin"), env.get("PATH", "")])
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        for key in ("ASYNCRL_SWE_PROBE_OUT", "ASYNCRL_SWE_TRACE_ROOT"):
            env.pop(key, None)
        return env | extra

    def run(self, checkout: Path, test_ids: Sequence[str], *, timeout_s: float | None = None) -> TestRun:
        """`test_cmd` with `test_ids` (none: the whole suite), each outcome read as the `swe` env reads it."""
        nonce = secrets.token_hex(16)
        report = self._dir / f"report-{nonce[:8]}.txt"  # a name of its own per run, from any thread
        env = self._env()
        env |= report_env(nonce, str(report), str(self._dir / "report"), env.get("PYTHONPATH", ""))
        cmd = format_test_cmd(self.test_cmd, test_ids)
        run = run_shell(cmd, checkout, env=env, timeout_s=timeout_s or self.timeout_s)
        return TestRun(outcomes=read_report(report, nonce), run=run)

    def probe(
        self, checkout: Path, test_ids: Sequence[str], *, trace: bool = False, timeout_s: float | None = None
    ) -> ProbeRun:
        """The run with the probe plugin; `trace` also records the functions each test calls."""
        fd, name = tempfile.mkstemp(prefix="probe-", suffix=".json", dir=self._dir)  # one per run, any thread
        os.close(fd)
        report = Path(name)
        report.unlink()  # the plugin writes it at the end of a session that finished
        extra = {"ASYNCRL_SWE_PROBE_OUT": str(report)}
        if trace:
            extra["ASYNCRL_SWE_TRACE_ROOT"] = str(checkout.resolve())
        env = self._env(**extra)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self._dir), env.get("PYTHONPATH")) if p)
        cmd = format_test_cmd(self.test_cmd, ["-p", _PROBE_MODULE, *test_ids])
        run = run_shell(cmd, checkout, env=env, timeout_s=timeout_s or self.timeout_s)
        data = json.loads(report.read_text()) if report.exists() else {}
        report.unlink(missing_ok=True)
        root = checkout.resolve()
        return ProbeRun(
            outcomes=data.get("outcomes", {}),
            failures={t: _failure(f, root) for t, f in data.get("failures", {}).items()},
            called={t: frozenset((p, n) for p, n in v) for t, v in data.get("called", {}).items()},
            run=run,
        )


def _failure(raw: dict, root: Path) -> Failure:
    frames = []
    for path, line, name in raw["frames"]:
        p = Path(path)
        if p.is_absolute() and p.resolve().is_relative_to(root):
            frames.append((str(p.resolve().relative_to(root)), int(line), str(name)))
    return Failure(when=raw["when"], error=raw["error"], frames=tuple(frames))

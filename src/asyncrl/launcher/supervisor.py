"""Start child processes, stream their logs, and stop them all together.

Each child runs in its own process group (so a stop reaches its grandchildren, e.g. torchrun's
workers) and, on Linux, gets SIGTERM if the launcher itself dies, so no orphans are left behind.
Output goes to `RUN/logs/<name>.log`; every line is also handed to a `Console`
(asyncrl.launcher.console), which decides what the terminal shows: by default the lines matching
a child's `echo` prefixes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.launcher.console import Console, PlainConsole

__all__ = ["ChildSpec", "Supervisor"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):  # not Linux: the launcher's own signal handlers still stop children
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True, kw_only=True)
class ChildSpec:
    """One process to supervise. `done_ok`: the run succeeded once every such child exited 0."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    echo_prefixes: tuple[str, ...] = ()
    done_ok: bool = False
    may_exit_ok: bool = False  # exiting 0 before the run ends is normal (e.g. the orchestrator)
    max_restarts: int = 0  # restart after a failure this many times (inference servers) before giving up


class _Child:
    def __init__(self, spec: ChildSpec, console: Console) -> None:
        self.spec, self.console = spec, console
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        self.tail: deque[str] = deque(maxlen=40)
        self.num_restarts = 0
        self.start()

    def start(self) -> None:
        spec = self.spec
        self.proc = subprocess.Popen(
            spec.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=os.environ | spec.env | {"PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            text=True,
            bufsize=1,
        )
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.spec.log.open("a") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.tail.append(line.rstrip("\n"))
                self.console.child_line(self.spec.name, self.spec.echo_prefixes, line)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


class Supervisor:
    """Runs children until every `done_ok` one exited 0 (success), any child fails, or a signal arrives."""

    def __init__(
        self,
        specs: list[ChildSpec],
        *,
        stop_timeout_s: float = 15.0,
        poll_s: float = 0.2,
        console: Console | None = None,
    ) -> None:
        self.specs, self.stop_timeout_s, self.poll_s = specs, stop_timeout_s, poll_s
        self.console = console or PlainConsole()
        self.children: list[_Child] = []
        self._signalled: int | None = None
        self.failed: str | None = None

    def _on_signal(self, signum, _frame) -> None:
        self._signalled = signum

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for spec in self.specs:
                self.children.append(_Child(spec, self.console))
            return self._watch()
        finally:
            self.stop_all()
            self.console.close()
            for s, handler in old.items():
                signal.signal(s, handler)

    def _watch(self) -> int:
        done: set[str] = set()
        while True:
            if self._signalled is not None:
                self.console.message(
                    f"asyncrl: received {signal.Signals(self._signalled).name}, stopping all processes"
                )
                return 130
            for child in self.children:
                code = child.proc.poll()
                if code is None or child.spec.name in done:
                    continue
                if code == 0 and child.spec.done_ok:
                    done.add(child.spec.name)
                    if all(c.spec.name in done for c in self.children if c.spec.done_ok):
                        return 0
                    continue
                if code == 0 and child.spec.may_exit_ok:
                    continue
                if child.num_restarts < child.spec.max_restarts:
                    self._restart(child, code)
                    continue
                self._report_failure(child, code)
                return 1
            self.console.tick()
            time.sleep(self.poll_s)

    def _restart(self, child: _Child, code: int) -> None:
        child.reader.join(timeout=2)
        child.signal(signal.SIGKILL)  # leftovers of its process group
        child.num_restarts += 1
        self.console.message(
            f"asyncrl: process '{child.spec.name}' {_how(code)}; restarting "
            f"({child.num_restarts}/{child.spec.max_restarts}), log: {child.spec.log}"
        )
        child.start()

    def _report_failure(self, child: _Child, code: int) -> None:
        self.failed = child.spec.name
        child.reader.join(timeout=2)
        tail = "\n".join(f"    {line}" for line in list(child.tail)[-15:])
        self.console.message(
            f"asyncrl: process '{child.spec.name}' {_how(code)}; stopping the others.\n"
            f"  log: {child.spec.log}\n  last lines:\n{tail}"
        )

    def stop_all(self) -> None:
        alive = [c for c in self.children if c.proc.poll() is None]
        for c in alive:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for c in alive:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.signal(signal.SIGKILL)
                c.proc.wait()
        for c in self.children:  # grandchildren left in a group whose leader already exited
            c.signal(signal.SIGKILL)
            c.reader.join(timeout=2)


def _how(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"

"""Run model-written Python in a subprocess confined to its own temporary directory.

    sandbox = Sandbox(limits=SandboxLimits(cpu_s=2, wall_s=5))
    sandbox.write_file("main.py", "print(1 + 1)")
    result = await sandbox.run_python("main.py")   # SandboxResult(returncode=0, stdout="2\\n", ...)
    sandbox.close()

Layers (each reported in `SandboxResult.isolation`):
- the boundary: bubblewrap (`asyncrl.envs.sandbox_bwrap`): mount, PID, network, IPC, UTS and user
  namespaces; only the working directory is writable, nothing of the host outside the interpreter
  and system libraries is visible; uid 65534 without capabilities; every descendant dies with the
  call. Where bwrap cannot run, `Sandbox` refuses to start (`SandboxIsolationError`) unless it is
  built with `allow_weak_isolation=True`; every result then says "WEAK" in `isolation["boundary"]`;
- limits: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC (not enforced by Linux for uid 0 on the host, which
  is what a root caller's sandbox maps to), RLIMIT_FSIZE, RLIMIT_NOFILE, no core files; an output
  cap that kills the call once stdout + stderr exceed it; one wall-clock deadline for the whole call
  (stdin, the process and the collection of its output), after which everything is killed;
- host-side file tools: every path is resolved against the directory; `..`, absolute paths and
  symlinks leaving it raise `SandboxPathError`;
- a second layer inside the child: the audit-hook guard of `asyncrl.envs.sandbox_guard` (best
  effort; read its docstring for the limits). In weak mode it and `unshare --net` (when permitted)
  are all there is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.envs.sandbox_bwrap import Isolation, bwrap_argv, probe_isolation

__all__ = [
    "Isolation",
    "Sandbox",
    "SandboxIsolationError",
    "SandboxLimits",
    "SandboxPathError",
    "SandboxResult",
    "from_bwrap_returncode",
    "network_isolation_prefix",
    "probe_isolation",
    "run_process",
]

_GUARD = str(Path(__file__).with_name("sandbox_guard.py"))
# After the deadline kills the call, its output pipes get this long to reach EOF. Under bwrap every
# holder is dead by then; in weak mode an escaped descendant may keep them open, and is abandoned.
_DRAIN_GRACE_S = 0.5


class SandboxPathError(ValueError):
    """A path given to the sandbox's file tools points outside the sandbox directory."""


class SandboxIsolationError(RuntimeError):
    """The OS-level isolation is unavailable here and weak mode was not explicitly allowed."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    cpu_s: int = 5
    memory_bytes: int = 1 << 30  # address space; Python needs ~100 MiB just to start comfortably
    max_processes: int = 64
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64
    max_output_bytes: int = 64 << 10  # stdout + stderr; the process is killed once it writes more
    wall_s: float = 10.0


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    returncode: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool = False
    output_truncated: bool = False
    wall_s: float = 0.0
    isolation: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_truncated

    def error_summary(self) -> str | None:
        """One line for a tool error message, or None if the run ended normally."""
        if self.timed_out:
            return f"killed: wall-clock timeout after {self.wall_s:.1f}s"
        if self.output_truncated:
            return "killed: output limit exceeded"
        if self.returncode == -signal.SIGXCPU or self.returncode == -signal.SIGKILL:
            return (
                "killed: CPU time limit exceeded"
                if self.returncode == -signal.SIGXCPU
                else "killed (SIGKILL)"
            )
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        if self.returncode:
            last = self.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
            return f"exit code {self.returncode}: {last[0]}"
        return None


@functools.cache
def network_isolation_prefix() -> tuple[tuple[str, ...], str]:
    """(command prefix, description): the first `unshare` variant that works here, probed once."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return (), "guard-only (no unshare binary)"
    for prefix, name in (
        ((unshare, "--net"), "netns"),
        ((unshare, "--net", "--map-root-user"), "userns+netns"),
    ):
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        if probe.returncode == 0:
            return prefix, name
    return (), f"guard-only (unshare failed: {probe.stderr.decode(errors='replace').strip()[:200]})"


@functools.cache
def _read_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"], os.path.dirname(os.__file__), "/dev/null", "/dev/urandom"}
    return tuple(sorted(os.path.realpath(p) for p in roots))


class Sandbox:
    """A temporary directory plus a way to run Python in it under limits. Not thread-safe; one per episode."""

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        parent_dir: str | None = None,
        network: bool = False,
        allow_weak_isolation: bool = False,
        isolation: Isolation | None = None,
    ) -> None:
        """`isolation`: what to use (default: `probe_isolation()`, probed once per process).

        Raises SandboxIsolationError when it is "weak" and `allow_weak_isolation` is False.
        """
        self.isolation_mode = isolation or probe_isolation()
        if self.isolation_mode.mode != "bwrap" and not allow_weak_isolation:
            raise SandboxIsolationError(
                f"the sandbox has no OS-level isolation here ({self.isolation_mode.detail}); refusing to "
                "run untrusted code. Fix that, or pass allow_weak_isolation=True (env arg "
                "`allow_weak_isolation = true`) to accept the in-process guard alone"
            )
        self.limits = limits or SandboxLimits()
        self.dir = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-", dir=parent_dir)).resolve()
        self.network = network

    def path(self, relative: str) -> Path:
        """`relative` resolved inside the sandbox; anything that would leave it raises SandboxPathError."""
        if not relative or os.path.isabs(relative):
            raise SandboxPathError(f"path {relative!r} must be relative to the sandbox directory")
        full = (self.dir / relative).resolve()
        if full != self.dir and self.dir not in full.parents:
            raise SandboxPathError(f"path {relative!r} leaves the sandbox directory")
        return full

    def write_file(self, relative: str, content: str) -> int:
        data = content.encode()
        if len(data) > self.limits.max_file_bytes:
            raise SandboxPathError(
                f"{relative!r}: {len(data)} bytes exceeds max_file_bytes={self.limits.max_file_bytes}"
            )
        target = self.path(relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return len(data)

    def read_file(self, relative: str) -> str:
        target = self.path(relative)
        if not target.is_file():
            raise FileNotFoundError(f"no file {relative!r} in the sandbox")
        return target.read_bytes()[: self.limits.max_output_bytes].decode(errors="replace")

    def list_files(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.dir))
            for p in self.dir.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _command(self, script: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
        lim = self.limits
        config = {
            "root": str(self.dir),
            "read_roots": list(_read_roots()),
            "sys_path": [p for p in sys.path if p and os.path.realpath(p).startswith(_read_roots())],
            "limits": {
                "RLIMIT_CPU": lim.cpu_s,
                "RLIMIT_AS": lim.memory_bytes,
                "RLIMIT_NPROC": lim.max_processes,
                "RLIMIT_FSIZE": lim.max_file_bytes,
                "RLIMIT_NOFILE": lim.max_open_files,
                "RLIMIT_CORE": 0,
            },
        }
        argv = [sys.executable, "-I", "-S", _GUARD, json.dumps(config), script, *args]
        if self.isolation_mode.mode == "bwrap":
            assert self.isolation_mode.bwrap is not None
            cmd = bwrap_argv(
                self.isolation_mode.bwrap, self.dir, argv, network=self.network, read_only_files=(_GUARD,)
            )
        else:
            prefix, _ = ((), "") if self.network else network_isolation_prefix()
            cmd = [*prefix, *argv]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.dir),
            "TMPDIR": str(self.dir),
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
        }
        return cmd, env

    def isolation(self) -> dict[str, str]:
        """How this sandbox's calls are confined, one line per concern (copied into every result)."""
        nproc = "not enforced for root" if os.geteuid() == 0 else "enforced"
        limits = (
            "RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, output cap, wall-clock deadline on the "
            "whole call"
        )
        if self.isolation_mode.mode == "bwrap":
            return {
                "boundary": f"bwrap ({self.isolation_mode.detail})",
                "network": "on (network=True)" if self.network else "netns (bwrap; loopback only)",
                "files": "mount namespace: only the working directory is writable; interpreter and "
                "system libraries read-only; nothing else visible. Plus the audit-hook guard",
                "processes": f"PID namespace: descendants die with the call; RLIMIT_NPROC {nproc}. "
                "Plus the guard (fork/exec refused)",
                "limits": limits,
            }
        network = "on (network=True)" if self.network else network_isolation_prefix()[1]
        return {
            "boundary": "WEAK, no OS isolation (allowed by allow_weak_isolation): "
            f"{self.isolation_mode.detail}",
            "network": network,
            "files": "audit-hook guard only (bypassable) + host path checks",
            "processes": "guard only (bypassable); escaped descendants may outlive the call; "
            f"RLIMIT_NPROC {nproc}",
            "limits": limits,
        }

    async def run_python(
        self, script: str, args: list[str] | None = None, *, stdin: str = ""
    ) -> SandboxResult:
        """Run `script` (a file inside the sandbox) with the limits; never raises for what the script does.

        Returns within `limits.wall_s` plus a fraction of a second, whatever the script does.
        """
        self.path(script)
        cmd, env = self._command(script, list(args or []))
        result = await run_process(
            cmd,
            cwd=self.dir,
            env=env,
            stdin=stdin,
            wall_s=self.limits.wall_s,
            max_output_bytes=self.limits.max_output_bytes,
            isolation=self.isolation(),
        )
        if self.isolation_mode.mode == "bwrap":
            return dataclasses.replace(result, returncode=from_bwrap_returncode(result.returncode))
        return result


def from_bwrap_returncode(returncode: int | None) -> int | None:
    """bwrap reports a child killed by signal N as exit code 128 + N; give it back as -N."""
    if returncode is not None and 128 < returncode < 128 + 65:
        return 128 - returncode
    return returncode


async def run_process(
    cmd: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    wall_s: float,
    max_output_bytes: int,
    stdin: str = "",
    isolation: dict[str, str] | None = None,
    on_spawn: Callable[[int], None] | None = None,
    on_exit: Callable[[int], None] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> SandboxResult:
    """Run `cmd` in a session of its own under one deadline and a shared stdout + stderr cap.

    Its process group is killed in every case: normal exit, deadline, output cap, cancellation.
    `on_spawn(pid)` runs once the process exists; `on_exit(pid)` right after the group is killed (to
    kill what else belongs to the call, e.g. a cgroup). `pass_fds` stay open in the child. The
    returncode is the process's own.
    """
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        cwd=cwd,
        env=env,
        start_new_session=True,
        pass_fds=pass_fds,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    if on_spawn is not None:
        on_spawn(proc.pid)
    budget = _OutputBudget(max_output_bytes, proc.pid)
    readers = [asyncio.create_task(budget.drain(s, i)) for i, s in enumerate((proc.stdout, proc.stderr))]
    timed_out = False
    try:
        await asyncio.wait_for(_feed_and_wait(proc, stdin), wall_s)
    except TimeoutError:
        timed_out = True
    finally:
        _kill_group(proc.pid)  # under bwrap this takes its PID namespace, so every descendant, along
        if on_exit is not None:
            on_exit(proc.pid)
        await _exited(proc)
        abandoned = await _finish_readers(proc, readers)
        await proc.wait()  # returns now: the pipes are at EOF or closed
    stderr = budget.text(1)
    if abandoned:
        stderr += "\nsandbox: a descendant process outlived the call holding its output; abandoned\n"
    return SandboxResult(
        returncode=proc.returncode,
        stdout=budget.text(0),
        stderr=stderr,
        timed_out=timed_out,
        output_truncated=budget.exceeded,
        wall_s=time.monotonic() - t0,
        isolation=isolation or {},
    )


async def _feed_and_wait(proc: asyncio.subprocess.Process, stdin: str) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(stdin.encode())  # type: ignore[union-attr]
        await proc.stdin.drain()  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]
    await _exited(proc)


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Wait for the process itself to exit. `proc.wait()` also waits for its pipes to close, which a
    descendant holding stdout can put off forever, so poll the exit status instead."""
    delay = 0.001
    while proc.returncode is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)


async def _finish_readers(proc: asyncio.subprocess.Process, readers: list[asyncio.Task[None]]) -> bool:
    """Let the readers reach EOF for a short grace; True if one had to be abandoned (pipe still held)."""
    _, pending = await asyncio.wait(readers, timeout=_DRAIN_GRACE_S)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
        # asyncio.subprocess.Process exposes no public way to close its pipes; closing the transport
        # releases our ends, so the abandoned holder gets SIGPIPE instead of our fds leaking.
        proc._transport.close()  # type: ignore[attr-defined]
    return bool(pending)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class _OutputBudget:
    """Collects stdout/stderr up to a shared byte budget; kills the process group when it is exceeded."""

    def __init__(self, max_bytes: int, pgid: int) -> None:
        self.max_bytes, self.pgid = max_bytes, pgid
        self.chunks: tuple[bytearray, bytearray] = (bytearray(), bytearray())
        self.exceeded = False

    async def drain(self, stream: asyncio.StreamReader | None, index: int) -> None:
        assert stream is not None
        while chunk := await stream.read(1 << 16):
            room = self.max_bytes - len(self.chunks[0]) - len(self.chunks[1])
            self.chunks[index].extend(chunk[: max(room, 0)])
            if len(chunk) > room and not self.exceeded:
                self.exceeded = True
                _kill_group(self.pgid)

    def text(self, index: int) -> str:
        return self.chunks[index].decode(errors="replace")

"""Run model-written Python in a subprocess confined to its own temporary directory.

    sandbox = Sandbox(limits=SandboxLimits(cpu_s=2, wall_s=5))
    sandbox.write_file("main.py", "print(1 + 1)")
    result = await sandbox.run_python("main.py")   # SandboxResult(returncode=0, stdout="2\\n", ...)
    sandbox.close()

Mechanisms (each reported in `SandboxResult.isolation`):
- own working directory: a fresh `tempfile.mkdtemp`; host-side file tools resolve every path
  against it and refuse `..`, absolute paths and symlinks leaving it (`SandboxPathError`);
- limits: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC (not enforced by Linux for root; fork is also refused
  by the guard), RLIMIT_FSIZE, RLIMIT_NOFILE, no core files; an output cap that kills the process
  once stdout + stderr exceed it; a wall-clock timeout that SIGKILLs the whole process group;
- network: the child runs under `unshare --net` (a fresh network namespace with no interfaces)
  when the platform allows it, else with `--map-root-user` in a user namespace, else not at all
  (`isolation["network"]` then says "guard-only"); socket creation is refused by the guard too;
- file and process access: the in-child audit-hook guard of `asyncrl.envs.sandbox_guard`, best
  effort (read its docstring for the limits).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Sandbox", "SandboxLimits", "SandboxPathError", "SandboxResult", "network_isolation_prefix"]

_GUARD = str(Path(__file__).with_name("sandbox_guard.py"))


class SandboxPathError(ValueError):
    """A path given to the sandbox's file tools points outside the sandbox directory."""


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
        self, *, limits: SandboxLimits | None = None, parent_dir: str | None = None, network: bool = False
    ) -> None:
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
                "RLIMIT_CPU": lim.cpu_s, "RLIMIT_AS": lim.memory_bytes, "RLIMIT_NPROC": lim.max_processes,
                "RLIMIT_FSIZE": lim.max_file_bytes, "RLIMIT_NOFILE": lim.max_open_files, "RLIMIT_CORE": 0,
            },
        }  # fmt: skip
        prefix, _ = ((), "") if self.network else network_isolation_prefix()
        cmd = [*prefix, sys.executable, "-I", "-S", _GUARD, json.dumps(config), script, *args]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.dir), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        return cmd, env

    def isolation(self) -> dict[str, str]:
        network = "on (network=True)" if self.network else network_isolation_prefix()[1]
        nproc = "not enforced for root" if os.geteuid() == 0 else "enforced"
        return {
            "network": network,
            "files": "audit-hook guard (best effort) + host path checks",
            "processes": f"fork/exec refused by the guard; RLIMIT_NPROC {nproc}",
            "limits": "RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, output cap, wall-clock kill of the process group",
        }

    async def run_python(
        self, script: str, args: list[str] | None = None, *, stdin: str = ""
    ) -> SandboxResult:
        """Run `script` (a file inside the sandbox) with the limits; never raises for what the script does."""
        self.path(script)
        cmd, env = self._command(script, list(args or []))
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=self.dir, env=env, start_new_session=True,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        budget = _OutputBudget(self.limits.max_output_bytes, proc.pid)
        readers = [asyncio.create_task(budget.drain(s, i)) for i, s in enumerate((proc.stdout, proc.stderr))]
        timed_out = False
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(stdin.encode())  # type: ignore[union-attr]
                await proc.stdin.drain()  # type: ignore[union-attr]
                proc.stdin.close()  # type: ignore[union-attr]
            await asyncio.wait_for(proc.wait(), self.limits.wall_s)
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            await proc.wait()
            await asyncio.gather(*readers)
        return SandboxResult(
            returncode=proc.returncode, stdout=budget.text(0), stderr=budget.text(1), timed_out=timed_out,
            output_truncated=budget.exceeded, wall_s=time.monotonic() - t0, isolation=self.isolation(),
        )  # fmt: skip


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

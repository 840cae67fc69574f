"""A pool of long-lived sandboxes: created ahead, reset to pristine between episodes, never leaked.

    pool = SandboxPool(max_sandboxes=64, limits=PoolLimits(memory_bytes=1 << 30))
    pool.prewarm(workspace, 4)                 # create up to 4 sandboxes for this workspace ahead
    box = await pool.acquire(workspace)        # a pristine sandbox: workspace.key's state at /repo
    result = await box.run(["bash", "-c", "ls"], env={...}, timeout_s=30)   # a SandboxResult
    pool.release(box)                          # kills what runs in it; resets it in the background
    pool.close()                               # kills everything, removes mounts, cgroups, directories

A sandbox is a directory of a run directory (`asyncrl.envs.sandbox_reaper.RunDir`) with `work/`
(what the commands see, bound at `mount_point`) and `private/` (the workspace's own state, never
visible inside). What fills `work/` and how it goes back to pristine is the `Workspace`'s business
(the swe env's is a git checkout). Every command is a bubblewrap call (`sandbox_bwrap`): its own
PID, mount, network and user namespaces, so nothing it starts outlives it.

Lifecycle:
- `acquire` takes an idle sandbox already pristine at the workspace's key, or creates one while
  fewer than `max_sandboxes` exist, or replaces an idle sandbox of another key, or waits;
- `release` kills the sandbox's processes at once, then resets it in a worker thread; only after a
  successful reset is it idle again (a failed reset destroys it);
- a command is killed with its whole tree at its deadline, on cancellation (the episode's
  deadline or a tool timeout cancel it), and when the sandbox is released;
- at start the pool reaps what dead runs under its root left (`sandbox_reaper.reap`); at exit
  (`close`, also registered with `atexit`) it removes its own run. A SIGKILLed process cannot clean
  up: bwrap's `--die-with-parent` kills its sandboxes, and the next pool's reaper removes the rest.

Limits (`PoolLimits`), and what enforces each (`SandboxPool.isolation()` reports it):
- processes and memory of a sandbox's whole tree: a cgroup per sandbox (`sandbox_cgroup`) where
  cgroups can be made; else per-process RLIMIT_AS only (RLIMIT_NPROC is not enforced for root);
- disk: a size-limited tmpfs mounted at the sandbox directory where this process may mount (root),
  so writes fail with ENOSPC; else the usage is measured after each command and a sandbox over its
  limit runs no more commands; RLIMIT_FSIZE bounds each file; /tmp inside is a fresh sized tmpfs
  per command;
- CPU: RLIMIT_CPU per process; wall time: each command's deadline, and the episode's.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from asyncrl.envs.sandbox import SandboxIsolationError, SandboxResult, from_bwrap_returncode, run_process
from asyncrl.envs.sandbox_bwrap import Isolation, bwrap_argv, probe_isolation
from asyncrl.envs.sandbox_cgroup import Cgroup, cgroup_problem, probe_cgroups
from asyncrl.envs.sandbox_reaper import ReapReport, RunDir, reap, reap_run

__all__ = ["DEFAULT_ROOT", "PoolLimits", "PooledSandbox", "SandboxLimitError", "SandboxPool", "Workspace"]

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path(tempfile.gettempdir()) / "asyncrl-sandboxes"
T = TypeVar("T")


class SandboxLimitError(RuntimeError):
    """The sandbox went over a limit that makes it refuse further commands (its disk, in check mode)."""


class Workspace(Protocol):
    """What a sandbox holds. Sandboxes at the same `key` are interchangeable once reset.

    `create` fills the empty `work` directory; `reset` brings it back to that state after use. Both
    block (they run in the pool's worker threads) and may keep their own state in `private`.
    """

    key: str

    def create(self, work: Path, private: Path) -> None: ...

    def reset(self, work: Path, private: Path) -> None: ...


@dataclass(frozen=True, kw_only=True)
class PoolLimits:
    """Per-sandbox limits (see the module docstring for what enforces each)."""

    command_wall_s: float = 60.0  # default deadline of one command
    cpu_s: int = 60  # RLIMIT_CPU of each process
    memory_bytes: int = 2 << 30  # the sandbox's tree (cgroup), or each process (RLIMIT_AS) without cgroups
    max_processes: int = 256  # the sandbox's tree (cgroup pids.max)
    disk_bytes: int = 1 << 30  # the sandbox directory (tmpfs size, or checked after each command)
    max_file_bytes: int = 256 << 20  # RLIMIT_FSIZE
    max_open_files: int = 1024  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # stdout + stderr of one command; it is killed past this
    tmp_bytes: int = 64 << 20  # /tmp inside, per command


@dataclass(eq=False)
class _Slot:
    name: str
    dir: Path
    key: str
    workspace: Workspace
    cgroup: Cgroup | None = None
    state: str = "creating"  # creating -> busy (acquired) or idle (prewarmed); busy -> resetting -> idle
    after_create: str = "busy"  # the state `_build` leaves it in
    last_used: float = field(default_factory=time.monotonic)
    over_disk_limit: bool = False

    @property
    def work(self) -> Path:
        return self.dir / "work"

    @property
    def private(self) -> Path:
        return self.dir / "private"


class PooledSandbox:
    """A sandbox lent by the pool until `SandboxPool.release`: `work` on the host is `mount_point` inside."""

    def __init__(self, pool: SandboxPool, slot: _Slot, *, start_latency_s: float, warm: bool) -> None:
        self._pool, self._slot = pool, slot
        self.start_latency_s = start_latency_s  # how long `acquire` took
        self.warm = warm  # it was ready (created ahead, or reset after an earlier episode)
        self.mount_point = pool.mount_point

    @property
    def work(self) -> Path:
        return self._slot.work

    @property
    def private(self) -> Path:
        return self._slot.private

    async def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        timeout_s: float | None = None,
        stdin: str = "",
        read_only: tuple[tuple[str, str], ...] = (),
    ) -> SandboxResult:
        """Run `argv` in `mount_point` under the pool's limits; never raises for what the command does.

        `read_only`: (host path, path inside) pairs, files or directories, bound read-only for this call.
        Raises SandboxLimitError when the sandbox is over its disk limit (check mode).
        """
        return await self._pool._run(self._slot, argv, env, timeout_s, stdin, read_only)

    def kill(self) -> None:
        """Kill every process of this sandbox now."""
        self._pool._kill(self._slot)


class SandboxPool:
    """Sandboxes for one process; see the module docstring. Thread-safe bookkeeping, any event loop."""

    def __init__(
        self,
        *,
        root: Path | str | None = None,
        max_sandboxes: int = 16,
        limits: PoolLimits | None = None,
        mount_point: str = "/repo",
        read_only_dirs: tuple[str, ...] = (),
        use_cgroups: bool | None = None,
        use_tmpfs: bool | None = None,
        isolation: Isolation | None = None,
    ) -> None:
        """`use_cgroups` / `use_tmpfs`: None = wherever this process can; False = never; True = required.

        Raises SandboxIsolationError without bwrap (the pool has no weak mode).
        """
        if max_sandboxes < 1:
            raise ValueError(f"max_sandboxes must be >= 1, got {max_sandboxes}")
        self.isolation_mode = isolation or probe_isolation()
        if self.isolation_mode.mode != "bwrap":
            raise SandboxIsolationError(
                f"the sandbox pool needs bubblewrap, which cannot run here ({self.isolation_mode.detail})"
            )
        self.root = Path(root or DEFAULT_ROOT).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.reaped: ReapReport = reap(self.root)
        if self.reaped.runs:
            log.warning(
                "sandbox pool: removed what %d dead run(s) left under %s: %s",
                self.reaped.runs,
                self.root,
                self.reaped,
            )
        self.run_dir = RunDir.create(self.root)
        self.limits, self.max_sandboxes = limits or PoolLimits(), max_sandboxes
        self.mount_point, self.read_only_dirs = mount_point, read_only_dirs
        self.cgroups = _choose(use_cgroups, probe_cgroups, "cgroups", cgroup_problem)
        self.tmpfs = _choose(
            use_tmpfs,
            lambda: _can_mount(self.run_dir.path),
            "a tmpfs per sandbox",
            lambda: "mounting a tmpfs needs root (CAP_SYS_ADMIN)",
        )
        for base in self.cgroups.dirs if self.cgroups else ():
            self.run_dir.add_cgroup(base / self.run_dir.path.name)  # made with the first sandbox
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._counter = 0
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sandbox-pool")
        self.stats = {"created": 0, "warm": 0, "reset": 0, "destroyed": 0, "reset_failed": 0}
        atexit.register(self.close)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def acquire(self, workspace: Workspace) -> PooledSandbox:
        """A pristine sandbox for `workspace`; waits while `max_sandboxes` are busy."""
        t0 = time.monotonic()
        delay = 0.005
        while True:
            slot, fresh, victim = self._take(workspace)
            if slot is not None:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        if fresh:
            future = self._executor.submit(self._build, slot, victim)
            try:  # shielded: a cancelled acquire lets the creation finish and leaves the sandbox idle
                await asyncio.shield(asyncio.wrap_future(future))
            except asyncio.CancelledError:
                with self._lock:
                    slot.after_create = "idle"
                    slot.state = "idle" if slot.state == "busy" else slot.state
                raise
        return PooledSandbox(self, slot, start_latency_s=time.monotonic() - t0, warm=not fresh)

    def release(self, sandbox: PooledSandbox) -> None:
        """Kill what runs in the sandbox now; it becomes idle again after a reset in the background."""
        slot = sandbox._slot
        self._kill(slot)
        with self._lock:
            if slot.state != "busy":
                return
            slot.state = "resetting"
            closed = self._closed
        if closed:
            self._destroy(slot)
        else:
            self._executor.submit(self._reset, slot)

    def prewarm(self, workspace: Workspace, num: int) -> int:
        """Create sandboxes for `workspace` in the background until `num` are idle or being made (within
        `max_sandboxes`); the number started."""
        started = []
        with self._lock:
            ready = sum(s.key == workspace.key and s.state in ("idle", "creating") for s in self._slots)
            while ready < num and not self._closed and len(self._slots) < self.max_sandboxes:
                started.append(self._new_slot(workspace, after_create="idle"))
                ready += 1
        for slot in started:
            self._executor.submit(self._build, slot)
        return len(started)

    def close(self) -> None:
        """Kill every sandbox process and remove the run's cgroups, mounts and directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        reap_run(self.run_dir.path)
        atexit.unregister(self.close)

    def counts(self) -> dict[str, int]:
        """Sandboxes by state, and the lifetime counters in `stats`."""
        with self._lock:
            states = [s.state for s in self._slots]
        return {
            state: states.count(state) for state in ("idle", "busy", "creating", "resetting")
        } | self.stats

    def isolation(self) -> dict[str, str]:
        """What confines the sandboxes, one line per concern."""
        lim = self.limits
        tree = self.cgroups.describe() if self.cgroups else f"none ({cgroup_problem()})"
        disk = (
            f"tmpfs of {lim.disk_bytes} bytes mounted at each sandbox (ENOSPC past it)"
            if self.tmpfs
            else f"usage checked after each command; over {lim.disk_bytes} bytes the sandbox refuses commands"
        )
        return {
            "runtime": f"bwrap ({self.isolation_mode.detail})",
            "network": "none (network namespace with loopback only)",
            "files": f"the sandbox directory at {self.mount_point} (read-write) and /tmp "
            f"(a {lim.tmp_bytes}-byte tmpfs per command); system, interpreter and read-only dirs; nothing "
            "else of the host",
            "processes": f"PID namespace per command, nothing outlives it; tree bound: {tree}",
            "memory": f"{lim.memory_bytes} bytes per sandbox (cgroup)"
            if self.cgroups
            else f"{lim.memory_bytes} bytes per process (RLIMIT_AS)",
            "disk": f"{disk}; RLIMIT_FSIZE {lim.max_file_bytes}",
            "time": f"RLIMIT_CPU {lim.cpu_s} s per process; a deadline per command "
            f"(default {lim.command_wall_s} s)",
        }

    # -- slots -------------------------------------------------------------------------------------

    def _new_slot(self, workspace: Workspace, *, after_create: str = "busy") -> _Slot:
        """A reserved slot (caller holds the lock)."""
        self._counter += 1
        name = f"sb-{self._counter}"
        slot = _Slot(
            name=name,
            dir=self.run_dir.path / name,
            key=workspace.key,
            workspace=workspace,
            after_create=after_create,
        )
        self._slots.append(slot)
        return slot

    def _take(self, workspace: Workspace) -> tuple[_Slot | None, bool, _Slot | None]:
        """(slot, needs creating, idle slot to destroy first), or Nones when the caller must wait."""
        victim = None
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox pool is closed")
            idle = [s for s in self._slots if s.state == "idle"]
            for slot in idle:
                if slot.key == workspace.key:
                    slot.state, slot.last_used, slot.workspace = "busy", time.monotonic(), workspace
                    self.stats["warm"] += 1
                    return slot, False, None
            if len(self._slots) >= self.max_sandboxes:
                if not idle:
                    return None, False, None
                victim = min(idle, key=lambda s: s.last_used)
                victim.state = "destroying"
            slot = self._new_slot(workspace)
        return slot, True, victim

    def _create(self, slot: _Slot) -> None:
        slot.dir.mkdir()
        if self.tmpfs:
            _mount_tmpfs(slot.dir, self.limits.disk_bytes)
        slot.work.mkdir()
        slot.private.mkdir()
        if self.cgroups:
            slot.cgroup = Cgroup.create(
                self.cgroups,
                f"{self.run_dir.path.name}/{slot.name}",
                max_processes=self.limits.max_processes,
                memory_bytes=self.limits.memory_bytes,
            )
        slot.workspace.create(slot.work, slot.private)

    def _build(self, slot: _Slot, victim: _Slot | None = None) -> None:
        """Create the slot in a worker thread, after destroying the idle one it replaces; on failure
        destroy it and raise to whoever waits."""
        try:
            if victim is not None:
                self._destroy(victim)
            self._create(slot)
        except Exception:
            log.exception("sandbox pool: creating %s for %s failed", slot.name, slot.key)
            self._destroy(slot)
            raise
        with self._lock:
            self.stats["created"] += 1
            if slot.state == "creating":
                slot.state = slot.after_create

    def _reset(self, slot: _Slot) -> None:
        try:
            self._kill(slot)
            slot.workspace.reset(slot.work, slot.private)
            if not self.tmpfs and _disk_usage(slot.dir) > self.limits.disk_bytes:
                raise SandboxLimitError(f"{slot.name} is still over its disk limit after the reset")
        except Exception:  # a worker thread: a sandbox that cannot be made pristine is thrown away
            log.exception("sandbox pool: resetting %s failed; destroying it", slot.name)
            with self._lock:
                self.stats["reset_failed"] += 1
            self._destroy(slot)
            return
        with self._lock:
            self.stats["reset"] += 1
            if slot.state == "resetting":
                slot.state, slot.last_used, slot.over_disk_limit = "idle", time.monotonic(), False

    def _destroy(self, slot: _Slot) -> None:
        self._kill(slot)
        if slot.cgroup is not None:
            slot.cgroup.remove()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(slot.dir)], capture_output=True, check=False)
        shutil.rmtree(slot.dir, ignore_errors=True)
        with self._lock:
            slot.state = "destroyed"
            if slot in self._slots:
                self._slots.remove(slot)
            self.stats["destroyed"] += 1

    def _kill(self, slot: _Slot) -> None:
        if slot.cgroup is not None:
            slot.cgroup.kill()

    # -- commands ----------------------------------------------------------------------------------

    async def _run(
        self,
        slot: _Slot,
        argv: list[str],
        env: dict[str, str],
        timeout_s: float | None,
        stdin: str,
        read_only: tuple[tuple[str, str], ...],
    ) -> SandboxResult:
        if slot.over_disk_limit:
            raise SandboxLimitError(
                f"the sandbox is over its disk limit ({self.limits.disk_bytes} bytes) and runs no more "
                "commands"
            )
        lim = self.limits
        lifeline, keep_alive = os.pipe()  # EOF once this call ends or this process dies, however
        inner = ["/bin/bash", "-c", _prologue(lim, lifeline), "asyncrl-sandbox", *argv]
        cmd = bwrap_argv(
            self.isolation_mode.bwrap or "bwrap",
            slot.work,
            inner,
            workdir_dest=self.mount_point,
            read_only_dirs=self.read_only_dirs,
            read_only_files=read_only,
            tmpfs=(("/tmp", lim.tmp_bytes),),
        )
        if slot.cgroup is not None:
            cmd = slot.cgroup.join_argv(cmd)
        try:
            result = await run_process(
                cmd,
                cwd=slot.work,
                env=env,
                stdin=stdin,
                wall_s=timeout_s or lim.command_wall_s,
                max_output_bytes=lim.max_output_bytes,
                isolation=self.isolation(),
                on_spawn=self.run_dir.add_pid,
                on_exit=self._on_exit(slot),
                pass_fds=(lifeline,),
            )
        finally:
            os.close(lifeline)
            os.close(keep_alive)
        if not self.tmpfs and _disk_usage(slot.dir) > lim.disk_bytes:
            slot.over_disk_limit = True
        return dataclasses.replace(result, returncode=from_bwrap_returncode(result.returncode))

    def _on_exit(self, slot: _Slot) -> Callable[[int], None]:
        def on_exit(pid: int) -> None:
            self._kill(slot)
            self.run_dir.remove_pid(pid)

        return on_exit


def _prologue(lim: PoolLimits, lifeline: int) -> str:
    """The shell that starts each command inside the sandbox, then `exec`s it.

    It sets the rlimits (soft and hard, so the command cannot raise them; KiB for -v and -f), and
    starts a watchdog that kills everything in the PID namespace once `lifeline` (a pipe whose only
    writer is the pool) reaches EOF. bwrap's --die-with-parent misses a command whose bwrap was still
    setting up when this process was SIGKILLed; the lifeline catches those too.
    """
    ulimits = (
        f"ulimit -t {lim.cpu_s} -v {lim.memory_bytes // 1024} -f {lim.max_file_bytes // 1024} "
        f"-n {lim.max_open_files} -u {lim.max_processes} -c 0"
    )
    watchdog = f"(read -r -u {lifeline} _; kill -KILL -1) &"
    return f'{ulimits} || exit 126; {watchdog} exec "$@" {lifeline}<&-'


def _choose(
    wanted: bool | None, probe: Callable[[], T | None], what: str, why: Callable[[], str]
) -> T | None:
    """What `probe` finds, unless turned off; raise when `wanted` is True and it finds nothing."""
    if wanted is False:
        return None
    available = probe()
    if available is None and wanted:
        raise SandboxIsolationError(f"the sandbox pool was asked for {what}, unavailable here: {why()}")
    return available


def _can_mount(where: Path) -> Path | None:
    """`where` when this process can mount a tmpfs on a directory in it, else None."""
    return where if _try_mount(where) else None


def _try_mount(where: Path) -> bool:
    probe = where / "mount-probe"
    probe.mkdir()
    try:
        ok = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m", "asyncrl-sandbox", str(probe)], capture_output=True
            ).returncode
            == 0
        )
        if ok:
            subprocess.run(["umount", "-l", str(probe)], capture_output=True, check=False)
        return ok
    except FileNotFoundError:  # no mount binary
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def _mount_tmpfs(path: Path, size: int) -> None:
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "asyncrl-sandbox", str(path)],
        capture_output=True,
        check=True,
    )


def _disk_usage(path: Path) -> int:
    """Bytes allocated to the files under `path` (what `du` counts)."""
    total = 0
    for entry in path.rglob("*"):
        with contextlib.suppress(OSError):
            total += entry.lstat().st_blocks * 512
    return total

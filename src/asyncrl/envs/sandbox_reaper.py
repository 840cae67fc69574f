"""Run directories of sandbox pools, and the reaper that removes what a dead run left behind.

    run = RunDir.create(root)          # ROOT/run-<pid>-<start ticks>-<token>/, owned by this process
    report = reap(root)                # ReapReport(runs=1, processes=0, mounts=3, cgroups=1, dirs=1)
    leftovers(root)                    # what dead runs still hold (all zeros after `reap`)

A run directory holds the pool's sandboxes, `pids/` (one empty file `<pid>-<start ticks>` per
running sandbox command) and `cgroups` (the cgroup directories the run made, one a line). A run is
alive while a process with its pid and start time exists; /proc start times make a recycled pid
read as dead. For each dead run `reap` kills the processes of its pid files that are still the
same process (their whole group) and everything in its cgroups, removes the cgroups, unmounts
every mount under its directory (deepest first, lazily), and deletes the directory. Live runs,
other processes' included, are never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from asyncrl.envs.sandbox_cgroup import remove_cgroup_tree

__all__ = ["Leftovers", "ReapReport", "RunDir", "leftovers", "mounts_under", "process_start", "reap"]

_RUN_RE = re.compile(r"^run-(\d+)-(\d+)-[0-9a-f]+$")


def process_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22); None if it is gone or
    a zombie (dead, waiting for its parent to collect it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def _alive(pid: int, start: int) -> bool:
    return process_start(pid) == start


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this mount namespace, deepest first."""
    prefix = str(path.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = (
            line.split()[4].encode().decode("unicode_escape")
        )  # \040 for spaces, as the kernel writes them
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=lambda p: -p.count("/"))


@dataclass(frozen=True, kw_only=True)
class RunDir:
    """The directory of one pool in this process; its name says who owns it."""

    path: Path

    @classmethod
    def create(cls, root: Path) -> RunDir:
        pid = os.getpid()
        start = process_start(pid)
        assert start is not None
        path = root / f"run-{pid}-{start}-{secrets.token_hex(4)}"
        (path / "pids").mkdir(parents=True)
        (path / "cgroups").touch()
        return cls(path=path)

    def add_pid(self, pid: int) -> None:
        start = process_start(pid)
        if start is not None:
            (self.path / "pids" / f"{pid}-{start}").touch()

    def remove_pid(self, pid: int) -> None:
        for f in (self.path / "pids").glob(f"{pid}-*"):
            f.unlink(missing_ok=True)

    def add_cgroup(self, path: Path) -> None:
        with open(self.path / "cgroups", "a") as f:
            f.write(f"{path}\n")


def _owner(run: Path) -> tuple[int, int] | None:
    match = _RUN_RE.match(run.name)
    return (int(match[1]), int(match[2])) if match else None


def _dead_runs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    runs = []
    for run in sorted(root.iterdir()):
        owner = _owner(run)
        if owner is not None and run.is_dir() and not _alive(*owner):
            runs.append(run)
    return runs


def _live_pids(run: Path) -> list[int]:
    pids = []
    for f in (run / "pids").glob("*-*"):
        pid, _, start = f.name.partition("-")
        if pid.isdigit() and start.isdigit() and _alive(int(pid), int(start)):
            pids.append(int(pid))
    return pids


def _cgroups(run: Path) -> list[Path]:
    try:
        lines = (run / "cgroups").read_text().split("\n")
    except OSError:
        return []
    return [Path(line) for line in lines if line and Path(line).is_dir()]


def _processes_naming(run: Path) -> list[int]:
    """Processes whose command line names the run directory (sandboxes of it that no file lists)."""
    needle = str(run).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


@dataclass(frozen=True, kw_only=True)
class Leftovers:
    """What dead runs under a root still hold."""

    runs: int = 0
    processes: int = 0
    mounts: int = 0
    cgroups: int = 0
    dirs: int = 0

    @property
    def total(self) -> int:
        return self.processes + self.mounts + self.cgroups + self.dirs


def leftovers(root: Path) -> Leftovers:
    runs = _dead_runs(root)
    return Leftovers(
        runs=len(runs),
        processes=len({p for r in runs for p in (*_live_pids(r), *_processes_naming(r))}),
        mounts=sum(len(mounts_under(r)) for r in runs),
        cgroups=sum(len(_cgroups(r)) for r in runs),
        dirs=len(runs),
    )


@dataclass(frozen=True, kw_only=True)
class ReapReport:
    """What `reap` removed."""

    runs: int = 0
    processes: int = 0
    mounts: int = 0
    cgroups: int = 0
    dirs: int = 0


def reap(root: Path) -> ReapReport:
    """Remove everything dead runs under `root` left: processes, cgroups, mounts, directories."""
    totals = {"processes": 0, "mounts": 0, "cgroups": 0, "dirs": 0}
    runs = _dead_runs(root)
    for run in runs:
        for key, value in reap_run(run).items():
            totals[key] += value
    return ReapReport(runs=len(runs), **totals)


def reap_run(run: Path) -> dict[str, int]:
    """Tear one run directory down (also used by a pool on its own directory when it closes)."""
    pids = sorted({*_live_pids(run), *_processes_naming(run)})
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # a sandbox command leads its own group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    groups = _cgroups(run)
    for group in groups:
        remove_cgroup_tree(group)
    points = mounts_under(run)
    for point in points:
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    shutil.rmtree(run, ignore_errors=True)
    return {
        "processes": len(pids),
        "mounts": len(points),
        "cgroups": len(groups),
        "dirs": int(not run.exists()),
    }

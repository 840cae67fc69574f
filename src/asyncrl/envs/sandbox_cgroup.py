"""Cgroups for pooled sandboxes: one bound on the processes and memory of a sandbox's whole tree, and
a kill that reaches all of it.

    roots = probe_cgroups()                      # CgroupRoots, or None (`cgroup_problem()` says why)
    group = Cgroup.create(roots, "run-1-2-ab/sb-0", max_processes=256, memory_bytes=1 << 30)
    argv = group.join_argv(["bwrap", ...])       # the command joins the group before it starts anything
    group.kill(); group.remove()

The groups live under the calling process's own cgroup, in `asyncrl-sandboxes/`, so the host's own
accounting still covers them:
- cgroup v2 (`/sys/fs/cgroup` unified): `pids.max`, `memory.max`, `memory.swap.max`, `cgroup.kill`.
  The controllers must be enabled down the path, which v2 refuses under a cgroup that holds
  processes itself ("no internal processes"): run under a delegated cgroup (e.g. `systemd-run
  --user -p Delegate=yes --scope ...`) or the probe reports the refusal;
- cgroup v1 (the `pids` and `memory` hierarchies at `/sys/fs/cgroup/pids` and `/sys/fs/cgroup/memory`):
  `pids.max`, `memory.limit_in_bytes`; the kill sends SIGKILL to every member until none is left.
Creating groups needs write access there (root, or a delegated subtree). Without it the sandboxes
fall back to rlimits alone, which bound one process each, not the tree.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "Cgroup",
    "CgroupRoots",
    "cgroup_problem",
    "kill_cgroup_tree",
    "probe_cgroups",
    "remove_cgroup_tree",
]

_FS = Path("/sys/fs/cgroup")
_BASE = "asyncrl-sandboxes"
_CONTROLLERS = ("pids", "memory")


@dataclass(frozen=True, kw_only=True)
class CgroupRoots:
    """Where sandbox groups are made: one directory per controller (the same one twice on v2)."""

    version: Literal[1, 2]
    dirs: tuple[Path, ...]  # v2: (base,); v1: (pids base, memory base)

    def describe(self) -> str:
        return f"cgroup v{self.version} ({', '.join(map(str, self.dirs))}): pids.max and a memory limit"


def _own_paths() -> dict[str, str]:
    """{controller or "": path} of this process's cgroups, from /proc/self/cgroup."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _enable_v2(own: Path, leaf_base: Path) -> None:
    """Enable pids and memory for the children of every directory from `own` down to `leaf_base`."""
    node = own
    for part in [None, *leaf_base.relative_to(own).parts]:
        node = node / part if part else node
        node.mkdir(exist_ok=True)
        wanted = " ".join(f"+{c}" for c in _CONTROLLERS)
        if set(_CONTROLLERS) - set((node / "cgroup.subtree_control").read_text().split()):
            _write(node / "cgroup.subtree_control", wanted)


def _probe() -> tuple[CgroupRoots | None, str]:
    own = _own_paths()
    if (_FS / "cgroup.controllers").is_file():
        base = _FS / own.get("", "/").lstrip("/") / _BASE
        roots = CgroupRoots(version=2, dirs=(base,))
        try:
            _enable_v2(base.parent, base)
        except OSError as e:
            return None, f"cgroup v2 at {base}: {e} (run under a delegated cgroup)"
    elif all((_FS / c / "cgroup.procs").is_file() for c in _CONTROLLERS):
        dirs = tuple(_FS / c / own.get(c, "/").lstrip("/") / _BASE for c in _CONTROLLERS)
        roots = CgroupRoots(version=1, dirs=dirs)
    else:
        return None, "no cgroup v2 hierarchy and no v1 pids + memory hierarchies under /sys/fs/cgroup"
    try:  # the real test: make a group, give it a limit, remove it
        group = Cgroup.create(roots, f"probe-{uuid.uuid4().hex[:8]}", max_processes=8, memory_bytes=64 << 20)
        group.remove()
    except OSError as e:
        return None, f"cannot create cgroups under {roots.dirs[0]}: {e}"
    return roots, roots.describe()


@functools.cache
def _probed() -> tuple[CgroupRoots | None, str]:
    return _probe()


def probe_cgroups() -> CgroupRoots | None:
    """The place for sandbox cgroups here, probed once per process; None when they cannot be made."""
    return _probed()[0]


def cgroup_problem() -> str:
    """Why `probe_cgroups()` is None, or a description of what it found."""
    return _probed()[1]


def kill_cgroup_tree(path: Path, *, attempts: int = 50) -> int:
    """SIGKILL every process in `path` and the groups below it until none is left; the number killed."""
    killed = 0
    for _ in range(attempts):
        pids = [
            int(pid) for procs in path.rglob("cgroup.procs") for pid in _read_lines(procs) if pid.isdigit()
        ]
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.01)
    return killed


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:  # the group went away while we read
        return []


def remove_cgroup_tree(path: Path) -> None:
    """Kill what runs in `path` and below, then remove the groups, deepest first."""
    if not path.is_dir():
        return
    kill_cgroup_tree(path)
    for group in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _rmdir(group)
    _rmdir(path)


def _rmdir(path: Path) -> None:
    # A killed process leaves its group a moment after the signal; rmdir fails with EBUSY until then.
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    path.rmdir()


@dataclass(frozen=True, kw_only=True)
class Cgroup:
    """One sandbox's group (a directory per controller hierarchy)."""

    version: Literal[1, 2]
    paths: tuple[Path, ...]

    @classmethod
    def create(cls, roots: CgroupRoots, relative: str, *, max_processes: int, memory_bytes: int) -> Cgroup:
        paths = tuple(d / relative for d in roots.dirs)
        if roots.version == 2:
            _enable_v2(roots.dirs[0], paths[0].parent)
            paths[0].mkdir()
            _write(paths[0] / "pids.max", str(max_processes))
            _write(paths[0] / "memory.max", str(memory_bytes))
            if (paths[0] / "memory.swap.max").exists():
                _write(paths[0] / "memory.swap.max", "0")
        else:
            pids_dir, memory_dir = paths
            for p in paths:
                p.mkdir(parents=True)
            _write(pids_dir / "pids.max", str(max_processes))
            _write(memory_dir / "memory.limit_in_bytes", str(memory_bytes))
        return cls(version=roots.version, paths=paths)

    def join_argv(self, argv: list[str]) -> list[str]:
        """`argv` behind a shell that moves itself into the group first, so nothing escapes the count."""
        moves = "; ".join(f"echo $$ > {shlex.quote(str(p / 'cgroup.procs'))} || exit 125" for p in self.paths)
        return ["/bin/sh", "-c", f'{moves}; exec "$@"', "asyncrl-cgroup", *argv]

    def pids(self) -> list[int]:
        return sorted({int(x) for p in self.paths for x in _read_lines(p / "cgroup.procs") if x.isdigit()})

    def kill(self) -> None:
        if self.version == 2 and (self.paths[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(self.paths[0] / "cgroup.kill", "1")
        for p in self.paths:
            kill_cgroup_tree(p)

    def remove(self) -> None:
        for p in self.paths:
            remove_cgroup_tree(p)

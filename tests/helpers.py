"""Helpers shared by test files: free local ports, the environment of child processes, torchrun,
ranks in fresh processes, the processes left behind, the step records that count an env's episodes.

Importable from any test as `from helpers import ...` (pytest's `pythonpath` puts tests/ on the
path, see pyproject.toml). No test uses a fixed port: two runs on one machine must not collide.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "SRC",
    "child_env",
    "env_records",
    "free_port",
    "free_port_run",
    "left_after_kill",
    "processes_naming",
    "run_ranks",
    "torchrun_trainer",
]

SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of `n` consecutive free ports (for `deployment.base_port` with n servers)."""
    while True:
        base = free_port()
        held = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()


def child_env(**extra: str) -> dict[str, str]:
    """os.environ for a child process that imports this checkout's asyncrl, one OpenMP thread, unbuffered."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


def torchrun_trainer(cfg: Path, nproc: int, *extra: str, timeout: float = 300) -> None:
    """`asyncrl.trainer.main @ cfg` under torchrun with `nproc` local ranks; fails the test on a
    non-zero exit, with the end of stderr."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        "-m",
        "asyncrl.trainer.main",
        "@",
        str(cfg),
        *extra,
    ]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


# What the fork server imports once, before any rank, so that a rank starts in a fraction of a
# second: torch's parallel stack, and the asyncrl modules the rank functions of tests/ import.
_PRELOAD = [
    "pytest",
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers",
    "asyncrl.distributed",
    "asyncrl.model.hf",
    "asyncrl.model.presets",
    "asyncrl.tools.init_model",
    "asyncrl.trainer.logprobs",
    "asyncrl.trainer.publish",
    "asyncrl.trainer.publish_distributed",
    "asyncrl.trainer.scaleout",
    "asyncrl.weight_transfer",
]


def _rank_entry(rank: int, fn, args: tuple, stacks_dir: str) -> None:
    # SIGUSR1 writes every thread's Python stack to a file the parent reads when a rank hangs.
    stacks = open(os.path.join(stacks_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 (lives as long as the rank)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    fn(rank, *args)


def _stacks(stacks_dir: str, rank: int) -> str:
    path = Path(stacks_dir, f"rank{rank}.txt")
    return path.read_text() if path.exists() else "(no stacks: the rank had not reached its function)\n"


def run_ranks(fn, nprocs: int, *args, deadline_s: float = 180.0) -> None:
    """Run `fn(rank, *args)` for rank 0..nprocs-1, each in a new process, and wait for all of them.

    The processes come from multiprocessing's fork server, a single-threaded process that has
    imported torch and asyncrl, not forked from this one: a fork copies what earlier tests of this
    process left behind without the threads behind it (a gloo group left as garbage, whose destructor
    the child's garbage collector runs and which then waits forever to join gloo threads the child
    does not have; a lock held by a receive loop blocked in gloo). `fn` and `args` are pickled (`fn`
    must be a module-level function).

    A rank's exception fails the test with its traceback. Ranks still running after `deadline_s`
    (under pytest's own timeout) are made to write their Python stacks, killed, and the test fails
    with those stacks in its message.
    """
    import torch.multiprocessing as mp  # here: `import helpers` stays free of torch

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="ranks-") as stacks_dir:
        procs = mp.start_processes(
            _rank_entry, args=(fn, args, stacks_dir), nprocs=nprocs, join=False, start_method="forkserver"
        )
        deadline = time.monotonic() + deadline_s
        while not procs.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() < deadline:
                continue
            alive = {r: p for r, p in enumerate(procs.processes) if p.is_alive()}
            for p in alive.values():
                os.kill(p.pid, signal.SIGUSR1)
            time.sleep(2.0)
            dumps = "\n".join(
                f"--- rank {r} (pid {p.pid}) ---\n{_stacks(stacks_dir, r)}" for r, p in alive.items()
            )
            for p in procs.processes:
                p.kill()
                p.join(5.0)
            raise AssertionError(
                f"{fn.__name__}: ranks {sorted(alive)} of {nprocs} still running after {deadline_s:.0f} s; "
                f"their stacks:\n{dumps}"
            )


def pid_of(pattern: str) -> int | None:
    """The first process whose command line matches `pattern` (pgrep -f), if any."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def processes_naming(path: Path) -> list[int]:
    """PIDs of the live processes whose command line contains `path`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def left_after_kill(path: Path, timeout_s: float = 5.0) -> list[int]:
    """`processes_naming(path)` once they had `timeout_s` to die: a SIGKILLed process needs CPU time
    to exit, which a loaded machine gives it late (the sandbox pool's kill waits at most 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_naming(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def env_records(records: list[dict], env: str) -> list[dict]:
    """The orchestrator's step records that count episodes of `env`. A step whose batch was cut from
    groups already buffered (one collection can bring two batches' worth) has no episodes of its
    own, and its record leaves out every per-env key (asyncrl.orchestrator.metrics): those records
    are checked to carry none, and at least one record must count episodes."""
    prefix = f"env/{env}/"
    counted = [r for r in records if prefix + "episodes" in r]
    assert counted, f"no step record counts episodes of {env}: {records}"
    for r in records:
        if prefix + "episodes" not in r:
            assert f"reward/{env}" not in r and not any(k.startswith(prefix) for k in r), r
    return counted

"""`asyncrl rl` when a child dies: killing the trainer mid-run stops everything, names it, leaves no
orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.tools.init_model import init_model
from helpers import child_env, free_port

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc"
)


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below `root`, read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited while we looked
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                try:
                    found[child] = (Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")).decode()
                except OSError:
                    continue
                frontier.append(child)
    return found


def alive(pid: int) -> bool:
    """True if `pid` runs and is not a zombie (an exited child nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.5)


def trainer_stepped(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    return any(json.loads(line).get("role") != "orchestrator" for line in metrics.read_text().splitlines())


def test_killing_the_trainer_stops_the_run_and_names_it(tmp_path):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "asyncrl",
        "rl",
        "--model",
        str(tmp_path / "model"),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "1000",
        "--seq-len",
        "256",
        "--deployment.base-port",
        str(free_port()),
        "--orchestrator.envs.envs",
        '[{name = "reverse-text", max_total_tokens = 256}]',
        "--orchestrator.batch_size",
        "8",
        "--orchestrator.group_size",
        "4",
        "--orchestrator.sampling.max_tokens",
        "8",
        "--inference.device",
        "cpu",
    ]
    launcher = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        wait_for(lambda: trainer_stepped(run_dir), 240, "the trainer's first step")
        procs = descendants(launcher.pid)
        trainer = [pid for pid, cmd in procs.items() if " asyncrl trainer " in f"{cmd} "]
        others = [
            pid
            for pid, cmd in procs.items()
            if " asyncrl inference " in cmd or " asyncrl orchestrator " in cmd
        ]
        assert len(trainer) == 1 and len(others) == 2, procs
        os.kill(trainer[0], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode != 0
    assert "process 'trainer' was killed by SIGKILL" in stderr, stderr
    wait_for(lambda: not any(alive(pid) for pid in procs), 10, f"no orphans left of {procs}")

"""A short `asyncrl rl` run of the fault-injection suite, and the means to break it.

Every run is a reverse-text run of MAX_STEPS steps with tiny batches and 8-token completions, on
CPU. `Run.start()` launches `asyncrl rl` (again with `resume=True`); tests kill its processes with
SIGKILL at chosen points and audit the run directory afterwards (audit.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import child_env, free_port

MAX_STEPS = 4


class Run:
    """One run directory and the `asyncrl rl` launches on it."""

    def __init__(self, model: Path, run_dir: Path, **overrides: str) -> None:
        self.model, self.run_dir, self.overrides = model, run_dir, overrides
        self.proc: subprocess.Popen | None = None

    def argv(self, resume: bool) -> list[str]:
        args = {
            "model": str(self.model),
            "run-dir": str(self.run_dir),
            "max-steps": str(MAX_STEPS),
            "seq-len": "256",
            "deployment.base_port": str(free_port()),
            "inference.device": "cpu",
            "orchestrator.envs.envs": '[{name = "reverse-text", max_total_tokens = 256}]',
            "orchestrator.batch_size": "4",
            "orchestrator.group_size": "2",
            "orchestrator.sampling.max_tokens": "8",
            "orchestrator.health_poll_s": "0.5",
            "trainer.checkpoint.interval": "2",
            "trainer.peak_flops": "1e12",
            "trainer.batch_timeout_s": "240",
        } | self.overrides
        flags = [x for key, value in args.items() for x in (f"--{key}", value)]
        return [sys.executable, "-m", "asyncrl", "rl", *flags, *(["--resume"] if resume else [])]

    def start(self, resume: bool = False) -> subprocess.Popen:
        self.proc = subprocess.Popen(
            self.argv(resume), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()
        )
        return self.proc

    def finish(self, timeout_s: float = 300) -> tuple[int, str, str]:
        assert self.proc is not None
        out, err = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, out, err

    def lines(self, role: str) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written right now
                continue
        return [r for r in records if r.get("role") == role]

    def wait_for(self, predicate, what: str, timeout_s: float = 240, poll_s: float = 0.1) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.proc is not None
            if self.proc.poll() is not None:
                _, err = self.proc.communicate()
                raise AssertionError(f"the run ended before {what}:\n{err[-3000:]}")
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(poll_s)

    def _pids(self, child: str) -> tuple[str, list[str]]:
        """PIDs of this run's `asyncrl <role>` child (its config file is unique to the run dir)."""
        role = "inference" if child.startswith("inference") else child
        pattern = f"asyncrl {role} @ {self.run_dir}/configs/{child}.toml"
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        return pattern, found.stdout.split()

    def pid_of(self, child: str) -> int:
        pattern, pids = self._pids(child)
        assert pids, f"no process matches {pattern!r}"
        return int(pids[0])

    def is_running(self, child: str) -> bool:
        return bool(self._pids(child)[1])

    def signal(self, child: str, sig: signal.Signals) -> None:
        os.kill(self.pid_of(child) if child != "launcher" else self.proc.pid, sig)

    def kill(self, child: str) -> None:
        self.signal(child, signal.SIGKILL)

    def wait_all_gone(self, timeout_s: float = 30) -> None:
        """No process of this run is left (children of a killed launcher die with it)."""
        deadline = time.monotonic() + timeout_s
        pattern = f"{self.run_dir}/configs/"
        while subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, f"processes of {self.run_dir} outlived their launcher"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

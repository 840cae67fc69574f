"""`asyncrl rl` with two real inference servers: one is killed mid-run; the run still finishes.

The launcher restarts the dead server and the orchestrator retries its episodes on the other one.
(Re-admission of a restarted server at the current weights is checked with fake servers in
tests/unit/orchestrator/test_dispatcher.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from asyncrl.tools.init_model import init_model
from asyncrl.transport.metrics import read_metrics
from asyncrl.transport.rollouts import read_batch
from helpers import free_port_run, pid_of

pytestmark = pytest.mark.slow


def test_killing_one_of_two_servers_mid_run(tmp_path):
    model = tmp_path / "model"
    init_model("tiny-moe", model, seed=0)
    run_dir = tmp_path / "run"
    port = free_port_run(2)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "rl",
        "--model",
        str(model),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "5",
        "--seq-len",
        "256",
        "--deployment.num_inference_servers",
        "2",
        "--orchestrator.envs.envs",
        '[{name = "reverse-text", max_total_tokens = 256}]',
        "--deployment.base_port",
        str(port),
        "--orchestrator.batch_size",
        "8",
        "--orchestrator.group_size",
        "4",
        "--orchestrator.sampling.max_tokens",
        "8",
        "--orchestrator.max_async_steps",
        "1",
        "--orchestrator.max_off_policy_steps",
        "2",
        "--orchestrator.health_poll_s",
        "0.5",
        "--trainer.optim.lr",
        "1e-4",
        "--trainer.batch_timeout_s",
        "240",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not read_metrics(run_dir, "orchestrator"):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no batch written in time"
            time.sleep(0.2)
        victim = pid_of(f"inference @ {run_dir}/configs/inference-0.toml")
        assert victim is not None
        subprocess.run(["kill", "-9", str(victim)], check=True)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "process 'inference-0' was killed by SIGKILL; restarting (1/3)" in err
    records = read_metrics(run_dir, "orchestrator")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    batches = [read_batch(run_dir, s, timeout_s=1) for s in range(1, 6)]
    versions = {int(v) for b in batches for s in b.samples for v in s.policy_versions[s.loss_mask]}
    assert max(versions) >= 1, "weights must have been updated in flight"
    assert pid_of(f"{run_dir}/configs/") is None, "no process of this run may outlive the launcher"

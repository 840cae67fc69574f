"""`asyncrl rl @ examples/reverse_text/rl.toml --weights.transport distributed`, shortened, end to end.

The demo's config on a fresh tiny-moe, 24 steps, two embedded servers; one server is killed after
the first batch. The run finishes; every version went over the update channels (a small
publication with its manifest, files only for the last step), the restarted server joined a new
channel and took the current version before it was back in rotation, and rollouts sampled by
updated weights reached the trainer. 30-90 s on 2 shared cores (seen): `long`, skipped in CI unless
ASYNCRL_LONG_TESTS=1.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.transport.metrics import read_metrics
from asyncrl.transport.rollouts import read_batch
from helpers import child_env, free_port_run, pid_of

pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[2]
STEPS = 24  # long enough for the killed server to restart (~10-20 s) and rejoin before the end


def test_the_demo_runs_with_the_distributed_transport_through_a_server_restart(tmp_path):
    model, run_dir = tmp_path / "model", tmp_path / "rl"
    init_model("tiny-moe", model, seed=0)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "rl",
        "@",
        str(REPO / "examples/reverse_text/rl.toml"),
        "--weights.transport",
        "distributed",
        "--model",
        str(model),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(STEPS),
        "--deployment.num_inference_servers",
        "2",
        "--deployment.base_port",
        str(free_port_run(2)),
        "--orchestrator.batch_size",
        "16",
        "--orchestrator.health_poll_s",
        "0.5",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(run_dir, "orchestrator"):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no batch written in time"
            time.sleep(0.2)
        victim = pid_of(f"inference @ {run_dir}/configs/inference-1.toml")
        assert victim is not None
        subprocess.run(["kill", "-9", str(victim)], check=True)
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "process 'inference-1' was killed by SIGKILL; restarting" in err
    assert [r["step"] for r in read_metrics(run_dir, "trainer")] == list(range(1, STEPS + 1))
    trainer = (run_dir / "logs/trainer.log").read_text()
    assert all(f"weights v{step} sent" in trainer for step in range(1, STEPS + 1))
    manifest = json.loads(
        (weights_dir(run_dir, STEPS - 1) / "manifest.json").read_text()
    )  # kept: keep_last 2
    assert manifest["transport"] == "distributed" and "server0" in manifest["servers"]
    assert (weights_dir(run_dir, STEPS) / "model.safetensors").exists()  # the last step: files too
    restarted = (run_dir / "logs/inference-1.log").read_text()
    assert "joined channel ch/server1/2" in restarted  # a new generation of its channel
    orchestrator = (run_dir / "logs/orchestrator.log").read_text()
    assert "brought from v0 to v" in orchestrator and "back in rotation" in orchestrator
    batches = [read_batch(run_dir, s, timeout_s=1) for s in range(1, STEPS + 1)]
    versions = {int(v) for b in batches for s in b.samples for v in s.policy_versions[s.loss_mask]}
    assert max(versions) >= 1, "weights must have been updated in flight"

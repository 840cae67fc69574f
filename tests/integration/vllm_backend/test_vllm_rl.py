"""A short `asyncrl rl` run on reverse-text with `backend = "vllm"`: trainer steps, in-flight
weight updates, and per-token policy versions stamped by vLLM in the rollout batches; and the
same run with `--weights.transport distributed` through a restart of vLLM (long: two more vLLM
starts, ~5 minutes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from vllm_helpers import HAS_VLLM, NO_VLLM, REPO, VLLM_PYTHON

from asyncrl.run_dir import log_file
from asyncrl.tools.init_model import init_model
from asyncrl.transport.rollouts import read_batch
from helpers import child_env, free_port, pid_of

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)]

EXAMPLE = REPO / "examples" / "reverse_text"


def _rl_argv(model: Path, run: Path, steps: int, port: int) -> list[str]:
    """`asyncrl rl` of the reverse-text demo with its vLLM overlay."""
    return [
        sys.executable,
        "-m",
        "asyncrl",
        "rl",
        "@",
        str(EXAMPLE / "rl.toml"),
        "@",
        str(EXAMPLE / "rl-vllm.toml"),
        "--model",
        str(model),
        "--run-dir",
        str(run),
        "--max-steps",
        str(steps),
        "--deployment.base-port",
        str(port),
        "--inference.vllm.python",
        VLLM_PYTHON,
        "--orchestrator.batch-size",
        "32",
    ]


def _run_rl(tmp_path, steps: int) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The demo's RL stage on vLLM, to its end; the process and metrics.jsonl."""
    model, run = tmp_path / "model", tmp_path / "run"
    init_model("tiny-moe", model, seed=0)
    argv = _rl_argv(model, run, steps, free_port())
    done = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check_versions(run, steps: int) -> None:
    """Every sampled token carries a version; later batches were sampled by trained weights."""
    versions = []
    for step in range(1, steps + 1):
        batch = read_batch(run, step, timeout_s=5)
        sampled = np.concatenate([s.policy_versions[s.loss_mask] for s in batch.samples])
        assert sampled.size and (sampled >= 0).all() and (sampled <= step - 1).all()
        versions.append(sampled)
    assert (versions[0] == 0).all() and versions[-1].max() >= 1


def test_reverse_text_rl_run_with_vllm(tmp_path):
    steps = 3
    done, rows = _run_rl(tmp_path, steps)
    run = tmp_path / "run"
    assert "router replay OFF" in done.stdout and "vLLM 0.32" in done.stdout

    trainer = [r for r in rows if r["role"] == "trainer"]
    orchestrator = [r for r in rows if r["role"] == "orchestrator"]
    assert [r["step"] for r in trainer] == list(range(1, steps + 1))
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["mismatch_kl"]) for r in trainer)
    # in-flight updates happened and their pauses were measured
    assert sum(r["inference/pause_s"] for r in orchestrator) > 0
    _check_versions(run, steps)
    assert all(s.routed_experts is None for s in read_batch(run, steps, timeout_s=5).samples)


@pytest.mark.long
def test_reverse_text_rl_run_with_vllm_receiving_over_the_weights_channel_through_a_restart(tmp_path):
    """vLLM killed after the first batch: the supervisor restarts it, its workers register a new
    channel and take the current version whole, and it is synced before it serves again."""
    steps, port = 4, free_port()
    model, run = tmp_path / "model", tmp_path / "run"
    init_model("tiny-moe", model, seed=0)
    argv = [*_rl_argv(model, run, steps, port), "--weights.transport", "distributed"]
    argv += ["--orchestrator.health_poll_s", "0.5"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"  # files: a pipe left unread could fill up
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(argv, env=child_env(), stdout=o, stderr=e, text=True)
    try:
        deadline = time.monotonic() + 600
        while (
            not (run / "metrics.jsonl").exists()
            or '"orchestrator"' not in (run / "metrics.jsonl").read_text()
        ):
            assert proc.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "no batch written in time"
            time.sleep(0.5)
        victim = pid_of(f"api_server .*--port {port} ")
        assert victim is not None
        subprocess.run(["kill", "-9", str(victim)], check=True)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, f"{out.read_text()[-3000:]}\n{err.read_text()[-3000:]}"
    assert "process 'inference-0' was killed by SIGKILL; restarting" in err.read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["role"] == "trainer"] == list(range(1, steps + 1))
    sent = log_file(run, "trainer").read_text()
    assert all(f"weights v{step} sent: " in sent for step in range(1, steps + 1))
    orchestrator = log_file(run, "orchestrator").read_text()
    assert "brought from v0 to v" in orchestrator and "back in rotation" in orchestrator
    _check_versions(run, steps)

"""A short `asyncrl rl` run on reverse-text with `backend = "vllm"`: trainer steps, in-flight
weight updates, and per-token policy versions stamped by vLLM in the rollout batches; and the
same run with `--weights.transport distributed` (long: a second vLLM start and run, ~2 minutes)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from vllm_helpers import HAS_VLLM, NO_VLLM, REPO, VLLM_PYTHON

from asyncrl.run_dir import log_file
from asyncrl.tools.init_model import init_model
from asyncrl.transport.rollouts import read_batch
from helpers import child_env, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)]

EXAMPLE = REPO / "examples" / "reverse_text"


def _run_rl(tmp_path, steps: int, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`asyncrl rl` of the reverse-text demo with its vLLM overlay; the process and metrics.jsonl."""
    model, run = tmp_path / "model", tmp_path / "run"
    init_model("tiny-moe", model, seed=0)
    argv = [
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
        str(free_port()),
        "--inference.vllm.python",
        VLLM_PYTHON,
        "--orchestrator.batch-size",
        "32",
        *extra,
    ]
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
def test_reverse_text_rl_run_with_vllm_receiving_over_the_weights_channel(tmp_path):
    steps = 3
    _, rows = _run_rl(tmp_path, steps, "--weights.transport", "distributed")
    run = tmp_path / "run"
    trainer = [r for r in rows if r["role"] == "trainer"]
    orchestrator = [r for r in rows if r["role"] == "orchestrator"]
    assert [r["step"] for r in trainer] == list(range(1, steps + 1))
    assert sum(r["inference/pause_s"] for r in orchestrator) > 0  # swaps happened, inside pauses
    # every version went over the channel to the one vLLM server, which took it
    sent = log_file(run, "trainer").read_text()
    for step in range(1, steps + 1):
        assert f"weights v{step} sent: " in sent and "LEFT BEHIND" not in sent
    assert sent.count("to 1 server(s)") >= steps
    _check_versions(run, steps)

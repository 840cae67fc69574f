"""The reverse-text RL loop end to end on a tiny GLM-5 (MLA + sparse attention + grouped sigmoid
router): `asyncrl rl` with inference server, orchestrator and trainer, a few steps, no SFT.

It checks the plumbing a new family needs, not learning (test_demo.py checks learning on Qwen3-MoE):
every step trains, the fp32 engine and trainer agree on tokens sampled by the trained weights,
rollouts carry routed experts in the GLM-5 shape, and the published weights load in transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tomli_w
from test_demo import ENV_ARGS, child_env, free_port
from transformers import AutoModelForCausalLM

from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.transport.rollouts import read_batch

RL_STEPS = 3


@pytest.mark.slow  # ~110 s on 2 CPU cores
@pytest.mark.timeout(600)
def test_glm5_rl_loop_runs_end_to_end(tmp_path):
    init_model("tiny-glm5", tmp_path / "base", seed=0)
    run_dir = tmp_path / "rl"
    cfg = {
        "model": str(tmp_path / "base"),
        "run_dir": str(run_dir),
        "max_steps": RL_STEPS,
        "seq_len": 256,
        "deployment": {"base_port": free_port()},
        "inference": {"max_num_seqs": 32, "device": "cpu"},
        "orchestrator": {
            "batch_size": 16,
            "group_size": 4,
            "max_async_steps": 1,
            "max_off_policy_steps": 1,
            "sampling": {"temperature": 1.0, "max_tokens": 4},
            "envs": {"envs": [{"name": "reverse-text", "args": ENV_ARGS, "max_total_tokens": 256}]},
        },
        "trainer": {"optim": {"lr": 2e-3}, "peak_flops": 1e11},
    }
    config = tmp_path / "rl.toml"
    config.write_text(tomli_w.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "rl", "@", str(config)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    orch = [r for r in records if r.get("role") == "orchestrator"]
    trainer = [r for r in records if r.get("role") != "orchestrator"]
    assert sorted(r["step"] for r in orch) == list(range(1, RL_STEPS + 1)) and len(trainer) == RL_STEPS
    assert max(r["mismatch_kl_current"] for r in trainer) < 5e-3
    for step in range(1, RL_STEPS + 1):
        for s in read_batch(run_dir, step, timeout_s=1.0).samples:
            assert s.routed_experts.shape == (s.num_tokens, 4, 2)
            assert (s.routed_experts[:, 0] == 0).all() and s.routed_experts[:, 1:].max() < 8
    hf = AutoModelForCausalLM.from_pretrained(weights_dir(run_dir, RL_STEPS))
    assert type(hf).__name__ == "GlmMoeDsaForCausalLM"

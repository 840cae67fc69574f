"""A short `asyncrl rl` on the `swe` env: a tiny random model, the env's two example tasks, 2 steps.

The model never writes a tool call or a fix, so every reward is 0; the run still goes end to end
(episodes in pooled sandboxes, graded by the tasks' tests) and its metrics.jsonl carries, per step,
the env's named rewards and sandbox figures as `env/swe/<name>`. The example tasks (a tiny
repository written here) keep prompts, and so trainer steps, short; the shipped task set's prompts
are 2-3 times longer (BENCHMARKS.md "SWE task set" has a run on it). Marked slow: about 2 min on 2
shared cores, most of it the trainer.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tomli_w

from asyncrl.envs.builtin.swe.example import write_example
from asyncrl.envs.sandbox_bwrap import probe_isolation
from asyncrl.tools.init_model import init_model
from asyncrl.transport.metrics import read_metrics
from asyncrl.transport.rollouts import read_batch
from helpers import child_env, env_records, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(probe_isolation().mode != "bwrap", reason="the swe env needs bubblewrap"),
]

STEPS = 2


@pytest.mark.timeout(600)
def test_rl_on_the_swe_env_reports_its_named_rewards_per_step(tmp_path):
    tasks = write_example(tmp_path / "example")
    init_model("tiny-moe", tmp_path / "model", seed=0)
    run_dir, sandboxes = tmp_path / "run", tmp_path / "sandboxes"
    env = {
        "name": "swe",
        "max_turns": 2,
        "max_total_tokens": 4096,
        "deadline_s": 120,
        "args": {"tasks": str(tasks), "sandbox": {"root": str(sandboxes), "max_sandboxes": 4}},
    }
    config = {
        "model": str(tmp_path / "model"),
        "run_dir": str(run_dir),
        "max_steps": STEPS,
        "seq_len": 4096,
        "deployment": {"base_port": free_port()},
        "inference": {"max_num_seqs": 8, "device": "cpu"},
        "orchestrator": {
            "batch_size": 4,
            "group_size": 2,
            "sampling": {"temperature": 1.0, "max_tokens": 16},
            "advantage": {"filter_zero_advantage": False},  # every reward is 0: keep the groups
            "envs": {"envs": [env]},
        },
        "trainer": {"optim": {"lr": 1e-4}, "peak_flops": 1e11},
    }
    path = tmp_path / "rl.toml"
    path.write_text(tomli_w.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "rl", "@", str(path)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=580,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    orch = read_metrics(run_dir, "orchestrator")
    assert [r["step"] for r in orch] == list(range(1, STEPS + 1)) and len(
        read_metrics(run_dir, "trainer")
    ) == STEPS
    for r in env_records(orch, "swe"):
        assert r["env/swe/episodes"] >= 2
        assert r["env/swe/resolved"] == r["reward/swe"] == 0.0  # a random model fixes nothing
        assert r["env/swe/fail_to_pass"] == 0.0 and r["env/swe/pass_to_pass"] == 1.0  # graded: the bug stays
        assert r["env/swe/grading_error"] == 0.0 and r["env/swe/failed"] == 0.0
        assert r["env/swe/test_run_s"] > 0 and r["env/swe/sandbox_start_s"] > 0
        assert 0.0 <= r["env/swe/sandbox_warm"] <= 1.0 and r["env/swe/num_turns"] >= 1.0
        assert "env/swe/num_tool_calls" in r and "env/swe/submitted" in r
    for step in range(1, STEPS + 1):
        batch = read_batch(run_dir, step, timeout_s=1.0)
        assert len(batch.samples) >= 4 and {s.env for s in batch.samples} == {"swe"}
    assert not any(sandboxes.iterdir()), json.dumps(sorted(map(str, sandboxes.rglob("*")))[:10])

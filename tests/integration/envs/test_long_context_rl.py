"""The long-context loop (examples/long_context/rl.toml) at 4k tokens instead of 32k: `asyncrl rl` with
the embedded engine, the orchestrator and a 2-rank trainer with context parallel 2, on a tiny GLM-5,
2 steps.

Episodes of the `long-context` env grow a page per turn; the random model never calls the tool nor
answers, so each episode is shown every page and ends after its last (reward 0). The example's own
file is the config, with the lengths scaled down, so the test keeps it runnable. The 32k run is the
example's documented command, not a test. Marked slow: about 1 min on a quiet 2-core machine,
several when other jobs share it.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from asyncrl.tools.init_model import init_model
from asyncrl.transport.metrics import read_metrics
from asyncrl.transport.rollouts import read_batch
from helpers import child_env, env_records, free_port

EXAMPLE = Path(__file__).parents[3] / "examples" / "long_context" / "rl.toml"
STEPS, SEQ_LEN, NUM_PAGES, PAGE_CHARS = 2, 4096, 3, 1000


def _config(tmp_path: Path) -> dict:
    config = tomllib.loads(EXAMPLE.read_text())
    config |= {"model": str(tmp_path / "model"), "run_dir": str(tmp_path / "run"), "max_steps": STEPS}
    config["seq_len"] = SEQ_LEN
    config["deployment"]["base_port"] = free_port()
    config["orchestrator"]["sampling"]["max_tokens"] = 32
    [env] = config["orchestrator"]["envs"]["envs"]
    env |= {"args": {"num_pages": NUM_PAGES, "page_chars": PAGE_CHARS}, "max_total_tokens": SEQ_LEN}
    return config


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_long_context_loop_grows_episodes_over_turns_and_trains_with_context_parallel(tmp_path):
    init_model("tiny-glm5-32k", tmp_path / "model", seed=0)
    config = _config(tmp_path)
    assert config["deployment"]["trainer_nproc"] == 2 and config["trainer"]["parallel"]["cp"] == 2
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
    assert "--nproc-per-node=2" in proc.stdout

    run_dir = tmp_path / "run"
    orch, trainer = read_metrics(run_dir, "orchestrator"), read_metrics(run_dir, "trainer")
    assert [r["step"] for r in orch] == list(range(1, STEPS + 1)) and len(trainer) == STEPS
    counted = env_records(orch, "long-context")
    # bridged: one sample per episode, so every trained sample's episode was counted in some record
    assert sum(r["env/long-context/episodes"] for r in counted) >= sum(r["batch/samples"] for r in orch)
    for r in counted:
        assert r["env/long-context/num_turns"] >= NUM_PAGES  # a page a turn
        assert r["env/long-context/pages_seen"] == 1.0 and r["env/long-context/failed"] == 0.0
        assert r["env/long-context/num_resets"] == 0.0  # bridged: one sample per episode
    for r in trainer:
        assert np.isfinite(r["loss"]) and r["peak_memory_gb"] > 0
    for step in range(1, STEPS + 1):
        samples = read_batch(run_dir, step, timeout_s=1.0).samples
        assert len(samples) == config["orchestrator"]["batch_size"]
        for s in samples:
            # the prompt and every page but the last before the last turn, at one token a character
            assert (NUM_PAGES - 1) * PAGE_CHARS < s.num_tokens <= SEQ_LEN
            assert s.loss_mask.sum() > 32  # sampled tokens of several turns

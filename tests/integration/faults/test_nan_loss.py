"""A NaN loss: the trainer skips that step (weights unchanged), logs it once, publishes, and goes on."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import load_file

from asyncrl.config import load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.run_dir import weights_dir
from asyncrl.trainer.rl import run_rl
from asyncrl.transport.metrics import read_metrics
from asyncrl.transport.rollouts import write_batch
from asyncrl.transport.weights import stable_steps
from asyncrl.wire import RolloutBatch, RolloutSample


def _batch(step: int, advantage: float) -> RolloutBatch:
    rng = np.random.default_rng(step)
    samples = []
    for i in range(4):
        n = 12
        samples.append(
            RolloutSample(
                token_ids=rng.integers(3, 250, n).astype(np.int32),
                loss_mask=np.arange(n) >= 6,
                inference_logprobs=np.where(np.arange(n) >= 6, -5.5, 0.0).astype(np.float32),
                advantages=np.full(n, advantage if i % 2 else -advantage, np.float32),
                temperatures=np.ones(n, np.float32),
                policy_versions=np.full(n, step - 1, np.int32),
                reward=float(i % 2),
                episode_id=f"ep-{step}-{i}",
            )
        )
    return RolloutBatch(step=step, samples=samples)


def _weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(weights_dir(run_dir, step).glob("*.safetensors")):
        out |= load_file(f)
    return out


def test_a_nan_loss_step_is_skipped_logged_once_and_the_run_goes_on(base_model, tmp_path):
    run_dir = tmp_path / "run"
    for step in (1, 2, 3):
        write_batch(run_dir, _batch(step, float("nan") if step == 2 else 1.0))
    cfg = load_config(
        RLTrainerConfig,
        {
            "model": {"path": str(base_model)},
            "run_dir": str(run_dir),
            "max_steps": 3,
            "seq_len": 64,
            "peak_flops": 1e12,
            "batch_timeout_s": 5,
            "router_replay": False,
            "optim": {"lr": 1e-3},
        },
    )
    run_rl(cfg)
    lines = read_metrics(run_dir, "trainer")
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert [r["skipped"] for r in lines] == [False, True, False]
    assert stable_steps(run_dir) == [1, 2, 3]
    w1, w2, w3 = (_weights(run_dir, s) for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # the NaN step changed nothing
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # the next step trains again
    assert all(torch.isfinite(t).all() for t in w3.values())

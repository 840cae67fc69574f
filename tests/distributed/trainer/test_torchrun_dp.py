"""Two gloo ranks under torchrun, each reading its own part of every batch, train exactly like one
process reading the whole batch (loss, grad norm, weights), and resume in one process on those parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.model import from_pretrained
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.checkpoint import checkpoint_metrics
from asyncrl.trainer.rl import run_rl
from asyncrl.trainer.synthetic import synthetic_batch
from asyncrl.transport import write_batch
from asyncrl.transport.metrics import read_metrics
from helpers import child_env, torchrun_trainer


def _toml(path: Path, model_dir: Path, run_dir: Path, max_steps: int) -> Path:
    path.write_text(
        f'run_dir = "{run_dir}"\nmax_steps = {max_steps}\nseq_len = 64\npeak_flops = 1e11\n'
        f'[model]\npath = "{model_dir}"\n[optim]\nlr = 2e-3\n[checkpoint]\ninterval = 2\n'
        '[publish]\ndtype = "float32"\n'  # the weights are compared at fp32 tolerances
    )
    return path


def _run(cfg: Path, nproc: int, extra: tuple[str, ...] = ()) -> None:
    if nproc > 1:
        torchrun_trainer(cfg, nproc, *extra, timeout=240)
        return
    cmd = [sys.executable, "-m", "asyncrl.trainer.main", "@", str(cfg), *extra]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _losses(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_two_ranks_match_one_process_and_resume_at_another_world_size(tmp_path):
    model_dir = tmp_path / "model"
    init_model("tiny-moe", model_dir, seed=0)
    model = from_pretrained(model_dir)
    batches = [
        synthetic_batch(model, step=s, num_samples=5, prompt_len=8, completion_len=16, seed=s)
        for s in (1, 2, 3)
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    for b in batches:
        write_batch(one, b)  # one part: the whole batch
        write_batch(two, b, num_parts=2)  # one part per data rank
    run_rl(load_config(RLTrainerConfig, ["@", str(_toml(tmp_path / "one.toml", model_dir, one, 3))]))
    _run(_toml(tmp_path / "two.toml", model_dir, two, 2), nproc=2)
    # Resume the 2-rank checkpoint (step 2) in a single process: DCP is world-size independent.
    _run(_toml(tmp_path / "two.toml", model_dir, two, 3), nproc=1, extra=("--resume",))

    a, b = _losses(one), _losses(two)
    assert [r["step"] for r in read_metrics(two, "trainer")] == [1, 2, 3]  # step 2 not logged again
    assert checkpoint_metrics(two, 2)["loss"] == b[2]["loss"]  # rank 0's record, kept with the checkpoint
    for step in (1, 2, 3):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=1e-5), step  # loss is a +/- sum near 0
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), step
        assert b[step]["num_loss_tokens"] == a[step]["num_loss_tokens"]
        assert b[step]["num_samples"] == a[step]["num_samples"] == 5
        assert b[step]["reward_mean"] == pytest.approx(a[step]["reward_mean"])
    # each rank read its own part; the resumed single process read both parts of batch 3
    for step in (1, 2):
        assert b[step]["batch_bytes_read"] < 0.7 * b[step]["batch_bytes"], b[step]
    assert b[3]["batch_bytes_read"] > b[3]["batch_bytes"]  # both parts and the manifest
    wa, wb = from_pretrained(weights_dir(one, 3)), from_pretrained(weights_dir(two, 3))
    # Adam divides by sqrt(v): rounding in near-zero gradients (a different summation order) can move
    # a weight by a fraction of lr, so compare at 0.1 * lr; a wrong gradient would move it by ~lr.
    for (name, p), q in zip(wa.named_parameters(), wb.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-4, msg=name)

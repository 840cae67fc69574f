"""The real `asyncrl trainer` under torchrun with FSDP2 x EP, CP and FSDP2 x CP x EP matches one process.

FSDP2 x EP2 (2 ranks) and CP2 with activation checkpointing (2 ranks) train two RL steps on the
same rollout batches as an in-process world-size-1 run (tiny-moe, fp32, router replay on, gloo
on CPU): per-step loss, grad norm, token counts, and the published Hugging Face weights after
step 2 must agree. The EP run's step-2 checkpoint then resumes for step 3 at world size 4
(dp_shard 2 x cp 2 x ep 2) and at world size 1; both must match the reference's step 3.

Tolerances (fp32): loss atol 1e-5 (a +/- advantage sum near 0), grad norm rtol 1e-4, weights
atol 2e-4 after two AdamW steps at lr 2e-3 (Adam divides by sqrt(v), so summation-order noise
in near-zero gradients can move a weight by a fraction of lr; a wrong gradient moves it by ~lr).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.model import from_pretrained
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.rl import run_rl
from asyncrl.trainer.synthetic import synthetic_batch
from asyncrl.transport import write_batch
from helpers import torchrun_trainer

LAYOUTS = {  # name: (nproc, [trainer.parallel] lines)
    "fsdp2_ep2": (2, "ep = 2\n"),
    "cp2": (2, "cp = 2\nactivation_checkpointing = true\n"),
}
COMBINED = (4, "dp_shard = 2\ncp = 2\nep = 2\n")


def _toml(path: Path, model_dir: Path, run_dir: Path, max_steps: int, parallel: str = "") -> Path:
    path.write_text(
        f'run_dir = "{run_dir}"\nmax_steps = {max_steps}\nseq_len = 32\npeak_flops = 1e11\n'
        f'[model]\npath = "{model_dir}"\n[optim]\nlr = 2e-3\n[checkpoint]\ninterval = 2\n'
        '[publish]\ndtype = "float32"\n'  # the weights are compared at fp32 tolerances
        f"[parallel]\n{parallel}"
    )
    return path


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _assert_same_run(ref: Path, run: Path, steps: tuple[int, ...], label: str) -> None:
    a, b = _records(ref), _records(run)
    for step in steps:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=1e-5), (label, step)
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), (label, step)
        assert b[step]["num_loss_tokens"] == a[step]["num_loss_tokens"], (label, step)
        assert b[step]["num_tokens"] == a[step]["num_tokens"], (label, step)
    wa, wb = from_pretrained(weights_dir(ref, steps[-1])), from_pretrained(weights_dir(run, steps[-1]))
    for (name, p), q in zip(wa.named_parameters(), wb.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-4, msg=f"{label}: {name}")


@pytest.mark.slow
def test_parallel_layouts_match_one_process_and_checkpoints_reshard(tmp_path):
    model_dir = tmp_path / "model"
    init_model("tiny-moe", model_dir, seed=0)
    model = from_pretrained(model_dir)
    # 5 samples of 17-24 tokens, one per row of 32: 2 data ranks get 3 and 2 rows (a pad row).
    batches = [
        synthetic_batch(model, step=s, num_samples=5, prompt_len=8, completion_len=16, seed=s)
        for s in (1, 2, 3)
    ]
    runs = {name: tmp_path / name for name in ("ref", *LAYOUTS)}
    for run_dir in runs.values():
        for b in batches:  # in 2 parts: read one per rank at dp 2, both (re-split) at dp 1
            write_batch(run_dir, b, num_parts=2)
    run_rl(load_config(RLTrainerConfig, ["@", str(_toml(tmp_path / "ref.toml", model_dir, runs["ref"], 3))]))
    for name, (nproc, parallel) in LAYOUTS.items():
        torchrun_trainer(_toml(tmp_path / f"{name}.toml", model_dir, runs[name], 2, parallel), nproc)
        _assert_same_run(runs["ref"], runs[name], (1, 2), name)
    # The EP run's step-2 checkpoint (sharded over 2 ranks) resumes for step 3 at world size 4
    # with dp_shard 2 x cp 2 x ep 2 (model and Adam state reshard), and in one process.
    combined = tmp_path / "combined"
    shutil.copytree(runs["fsdp2_ep2"], combined, ignore=shutil.ignore_patterns("metrics.jsonl", "weights"))
    nproc, parallel = COMBINED
    torchrun_trainer(_toml(tmp_path / "combined.toml", model_dir, combined, 3, parallel), nproc, "--resume")
    _assert_same_run(runs["ref"], combined, (3,), "fsdp2 x cp2 x ep2, resumed at world size 4")
    resumed = _toml(tmp_path / "resume.toml", model_dir, runs["fsdp2_ep2"], 3)
    run_rl(load_config(RLTrainerConfig, ["@", str(resumed), "--resume"]))
    _assert_same_run(runs["ref"], runs["fsdp2_ep2"], (3,), "resumed at world size 1")

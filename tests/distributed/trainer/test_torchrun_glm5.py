"""A GLM-5 (glm_moe_dsa) `asyncrl trainer` at world size 2 resumes from its checkpoint, and its DSA
indexer stays frozen there as in one process.

tiny-glm5 with index_topk 16, so the indexer chooses among the keys of each 32-token sample. Step 1
runs under context parallel 2 (sparse attention over the gathered latent) and checkpoints; step 2
resumes from that checkpoint under FSDP 2. Both steps must match an in-process world-size-1 run
(fp32, loss atol 1e-5, grad norm rtol 1e-4), and the published indexer weights equal the base
model's. Before the indexer was frozen, the resume failed on optimizer state the checkpoint lacked.
"""

from __future__ import annotations

import json
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


def _toml(path: Path, model_dir: Path, run_dir: Path, max_steps: int, parallel: str = "") -> Path:
    path.write_text(
        f'run_dir = "{run_dir}"\nmax_steps = {max_steps}\nseq_len = 48\npeak_flops = 1e11\n'
        f'[model]\npath = "{model_dir}"\n[optim]\nlr = 2e-3\n[checkpoint]\ninterval = 1\n'
        f'[publish]\ndtype = "float32"\n[parallel]\n{parallel}'
    )
    return path


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_glm5_checkpoint_at_two_ranks_resumes_with_the_indexer_frozen(tmp_path):
    model_dir = tmp_path / "model"
    init_model("tiny-glm5", model_dir, seed=0)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"index_topk": 16}))
    model = from_pretrained(model_dir)
    assert model.args.index_topk == 16
    ref, run = tmp_path / "ref", tmp_path / "run"
    for step in (1, 2):
        batch = synthetic_batch(model, step=step, num_samples=4, prompt_len=8, completion_len=24, seed=step)
        write_batch(ref, batch)
        write_batch(run, batch, num_parts=2)  # a part per data rank of the FSDP 2 step
    run_rl(load_config(RLTrainerConfig, ["@", str(_toml(tmp_path / "ref.toml", model_dir, ref, 2))]))
    torchrun_trainer(_toml(tmp_path / "cp.toml", model_dir, run, 1, "cp = 2\n"), 2)
    torchrun_trainer(_toml(tmp_path / "fsdp.toml", model_dir, run, 2, "dp_shard = 2\n"), 2, "--resume")

    want, got = _records(ref), _records(run)
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), step
    published = dict(from_pretrained(weights_dir(run, 2)).named_parameters())
    base = dict(model.named_parameters())
    indexer = [n for n in published if ".indexer." in n]
    assert indexer and all(torch.equal(published[n], base[n]) for n in indexer)
    assert not torch.equal(published["lm_head.weight"], base["lm_head.weight"])  # the rest trained

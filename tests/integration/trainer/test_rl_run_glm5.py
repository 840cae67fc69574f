"""A GLM-5 (glm_moe_dsa) RL trainer run resumes from its checkpoint, and its DSA indexer stays frozen:
no gradient, no optimizer state, published unchanged (docs/trainer.md, "Sparse attention (DSA) in
training")."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-glm5"
    init_model("tiny-glm5", path, seed=0)
    return path


def _cfg(model_dir, run_dir, **overrides) -> RLTrainerConfig:
    base = {
        "model": {"path": str(model_dir)},
        "run_dir": str(run_dir),
        "max_steps": 2,
        "seq_len": 48,
        "optim": {"lr": 2e-3, "weight_decay": 0.1},  # decay would move a parameter the optimizer held
        "checkpoint": {"interval": 1, "keep_last": 2},
        "publish": {"dtype": "float32"},
        "batch_timeout_s": 0.5,
        "peak_flops": 1e11,
    }
    return load_config(RLTrainerConfig, base | overrides)


def test_glm5_run_resumes_from_its_checkpoint_with_the_indexer_frozen(model_dir, tmp_path):
    model = from_pretrained(model_dir)
    for step in (1, 2):
        write_batch(tmp_path, synthetic_batch(model, step=step, num_samples=4, prompt_len=8,
                                              completion_len=12, seed=step))  # fmt: skip
    first = run_rl(_cfg(model_dir, tmp_path))
    again = run_rl(_cfg(model_dir, tmp_path, resume_step=1))
    assert [r["step"] for r in again] == [2]
    assert again[0]["loss"] == first[1]["loss"] and again[0]["grad_norm"] == first[1]["grad_norm"]

    published = from_pretrained(weights_dir(tmp_path, 2))
    base = dict(model.named_parameters())
    indexer = [n for n, _ in published.named_parameters() if ".indexer." in n]
    assert indexer
    for name, p in published.named_parameters():
        assert torch.equal(p, base[name]) == (name in indexer), name

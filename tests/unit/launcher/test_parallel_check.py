"""The launch-time EP check reads the expert count the trainer uses, for every model family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.launcher import rl
from asyncrl.launcher.parallel_check import check_trainer_parallel
from asyncrl.model import preset_args


def _model_dir(tmp_path: Path, preset: str) -> Path:
    path = tmp_path / preset
    path.mkdir()
    (path / "config.json").write_text(json.dumps(preset_args(preset).to_hf_config()))
    return path


def _check(model: Path, ep: int, world_size: int) -> None:
    cfg = load_config(
        RLTrainerConfig, {"model": {"path": str(model)}, "max_steps": 1, "parallel": {"ep": ep}}
    )
    check_trainer_parallel(cfg, world_size=world_size, where=f"world size {world_size}")


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv3", "tiny-glm4moe", "tiny-moe"])
def test_ep_uses_the_real_expert_count_of_every_family(tmp_path, preset):
    """GLM-5, DeepSeek-V3 and GLM-4.5 name their 8 experts `n_routed_experts`, Qwen3-MoE `num_experts`."""
    model = _model_dir(tmp_path, preset)
    _check(model, ep=2, world_size=2)
    _check(model, ep=4, world_size=4)
    with pytest.raises(ConfigError, match=r"ep \(3\) must divide num_experts \(8\)"):
        _check(model, ep=3, world_size=6)


def test_ep_on_a_dense_model_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="ep = 2 needs an MoE model"):
        _check(_model_dir(tmp_path, "tiny-dense"), ep=2, world_size=2)


def test_an_unreadable_model_config_leaves_ep_to_the_trainer(tmp_path):
    """The trainer reports a broken config.json with its own error; the launcher does not guess."""
    model = _model_dir(tmp_path, "tiny-glm5")
    (model / "config.json").write_text('{"model_type": "glm_moe_dsa"}')
    _check(model, ep=2, world_size=2)


def test_a_model_not_reachable_from_here_leaves_ep_to_the_trainer(tmp_path):
    _check(tmp_path / "on-the-cluster-only", ep=2, world_size=2)


def test_asyncrl_rl_dry_run_accepts_ep_2_on_glm5(tmp_path, capsys):
    model = _model_dir(tmp_path, "tiny-glm5")
    cfg = tmp_path / "rl.toml"
    cfg.write_text(
        f'model = "{model}"\nrun_dir = "{tmp_path / "run"}"\n[deployment]\ntrainer_nproc = 2\n'
        "[trainer.parallel]\nep = 2\n"
    )
    assert rl.main(["@", str(cfg), "--dry-run"]) == 0, capsys.readouterr().err
    assert rl.main(["@", str(cfg), "--dry-run", "--trainer.parallel.ep", "3"]) == 2
    assert "ep (3) must divide num_experts (8)" in capsys.readouterr().err

"""`asyncrl rl --slurm --dry-run` writes the sbatch job; `[trainer.parallel]` reaches the trainer and is
checked."""

from __future__ import annotations

import json
import subprocess
import tomllib
from dataclasses import replace

import pytest

from asyncrl.config import load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.launcher import rl
from asyncrl.model import preset_args

TOML = """
model = "models/m"
run_dir = "{run}"

[deployment]
num_inference_servers = 2
trainer_nproc = 4

[trainer.parallel]
dp_shard = 2
cp = 2
ep = 2
activation_checkpointing = true

[slurm]
inference_nodes = 1
trainer_nodes = 2
gpus_per_node = 2
servers_per_inference_node = 2
"""


def _write(tmp_path):
    cfg = tmp_path / "rl.toml"
    cfg.write_text(TOML.format(run=tmp_path / "run"))
    return cfg


def _trainer_parallel(run) -> dict:
    trainer_toml = run / "configs" / "trainer.toml"
    parallel = tomllib.loads(trainer_toml.read_text())["parallel"]
    cfg = load_config(RLTrainerConfig, ["@", str(trainer_toml)])  # what the trainer process will parse
    assert (cfg.parallel.dp_shard, cfg.parallel.cp, cfg.parallel.ep) == (2, 2, 2)
    return parallel


def test_rl_slurm_dry_run_writes_sbatch_and_passes_parallel_to_trainer(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("--dry-run must not submit"))
    assert rl.main(["@", str(_write(tmp_path)), "--slurm", "--dry-run"]) == 0
    run = tmp_path / "run"
    script = (run / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=3" in script
    assert "--nnodes=2 --nproc-per-node=2" in script
    assert f'-m asyncrl trainer @ "{run}/configs/trainer.toml"' in script
    assert _trainer_parallel(run)["activation_checkpointing"] is True
    # 2 nodes x 2 GPUs at dp_shard 2 x cp 2: batches are written in 2 parts
    assert tomllib.loads((run / "configs" / "orchestrator.toml").read_text())["trainer_dp_size"] == 2
    assert "wrote" in capsys.readouterr().out


def test_rl_dry_run_without_slurm_accepts_the_slurm_table_and_uses_torchrun(tmp_path, capsys):
    assert rl.main(["@", str(_write(tmp_path)), "--dry-run"]) == 0
    run = tmp_path / "run"
    assert not (run / "slurm.sbatch").exists()
    assert "--nproc-per-node=4" in capsys.readouterr().out
    _trainer_parallel(run)


def test_rl_slurm_config_error_is_reported(tmp_path, capsys):
    cfg = _write(tmp_path)
    cfg.write_text(cfg.read_text().replace("num_inference_servers = 2", "num_inference_servers = 3"))
    assert rl.main(["@", str(cfg), "--slurm", "--dry-run"]) == 2
    assert "num_inference_servers (3)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "edit", "message"),
    [
        (
            [],
            ("trainer_nproc = 4", "trainer_nproc = 6"),
            "deployment.trainer_nproc = 6: dp_replicate * dp_shard",
        ),
        (["--slurm"], ("gpus_per_node = 2", "gpus_per_node = 4"), "= 2 * 4: dp_replicate * dp_shard * cp"),
    ],
)
def test_parallel_dims_that_do_not_fit_the_trainer_world_fail_before_launch(
    tmp_path, capsys, flags, edit, message
):
    cfg = _write(tmp_path)
    cfg.write_text(cfg.read_text().replace(*edit))
    assert rl.main(["@", str(cfg), *flags, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "[trainer.parallel]" in err and message in err
    assert not (tmp_path / "run" / "configs").exists()


def test_expert_parallel_is_checked_against_the_model_config(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    config = replace(preset_args("tiny-moe"), num_experts=6).to_hf_config()
    (model / "config.json").write_text(json.dumps(config))
    cfg = _write(tmp_path)
    cfg.write_text(cfg.read_text().replace('"models/m"', f'"{model}"').replace("ep = 2", "ep = 4"))
    assert rl.main(["@", str(cfg), "--dry-run"]) == 2
    assert "ep (4) must divide num_experts (6)" in capsys.readouterr().err

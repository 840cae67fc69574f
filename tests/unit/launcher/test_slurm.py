"""`asyncrl slurm`: the sbatch script for 2 inference nodes + 4 trainer nodes, dry-run, config errors."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest

from asyncrl.launcher import rl, slurm
from asyncrl.transport.rollouts import write_batch
from asyncrl.wire import RolloutBatch, RolloutSample

TOML = """
model = "models/m"
run_dir = "{run}"
seq_len = 4096

[deployment]
num_inference_servers = {servers}
base_port = 8100

[slurm]
inference_nodes = 2
trainer_nodes = 4
gpus_per_node = 8
servers_per_inference_node = {per}
partition = "h200"
time = "12:00:00"
setup = ["source /opt/venv/bin/activate"]
env = {{ NCCL_DEBUG = "WARN", HF_HUB_OFFLINE = "1" }}
"""


def _batch(step: int) -> RolloutBatch:
    n = 4
    sample = RolloutSample(
        token_ids=np.ones(n, np.int32),
        loss_mask=np.ones(n, bool),
        inference_logprobs=np.zeros(n, np.float32),
        advantages=np.zeros(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.zeros(n, np.int32),
    )
    return RolloutBatch(step=step, samples=[sample])


def _write(tmp_path, servers=4, per=2):
    cfg = tmp_path / "rl.toml"
    cfg.write_text(TOML.format(run=tmp_path / "run", servers=servers, per=per))
    return cfg


def test_dry_run_writes_script_and_configs_for_2_inference_and_4_trainer_nodes(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("--dry-run must not submit"))
    assert slurm.main(["@", str(_write(tmp_path)), "--dry-run"]) == 0
    run = tmp_path / "run"
    script = (run / "slurm.sbatch").read_text()
    assert {p.name for p in (run / "configs").iterdir()} >= {
        "trainer.toml",
        "orchestrator.toml",
        "inference-3.toml",
    }
    assert "#SBATCH --nodes=6" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=h200" in script and "#SBATCH --time=12:00:00" in script
    assert 'INFERENCE_NODES=("${NODES[@]:0:2}")' in script
    assert 'TRAINER_NODES=("${NODES[@]:2:4}")' in script
    assert "--nnodes=4 --nproc-per-node=8 --rdzv-backend=c10d" in script
    assert '--rdzv-endpoint="${TRAINER_MASTER}:29500"' in script
    assert "srun --nodes=4 --ntasks-per-node=1" in script
    # 2 servers per inference node sharing it (--overlap), 4 GPUs each, on base_port + local index:
    # `launch NODE FIRST_GPU:COUNT LOG COMMAND ... --port PORT`
    launches = [
        line.split()[1:3] + line.split()[-1:] for line in script.splitlines() if line.startswith("launch ")
    ]
    assert launches == [
        ["0", "0:4", "8100"],
        ["0", "4:4", "8101"],
        ["1", "0:4", "8100"],
        ["1", "4:4", "8101"],
    ]
    assert "srun --overlap --nodes=1 --ntasks=1" in script
    assert '--nodelist="${TRAINER_MASTER}"' in script and "orchestrator.toml" in script
    assert "export HF_HUB_OFFLINE=1" in script and "export NCCL_DEBUG=WARN" in script
    assert script.index("source /opt/venv/bin/activate") < script.index("srun")
    assert 'exit "$status"' in script


def test_rendered_configs_leave_the_device_to_each_node(tmp_path):
    # a GPU node must train and serve on its GPUs unless the config says otherwise
    assert slurm.main(["@", str(_write(tmp_path)), "--dry-run"]) == 0
    configs = tmp_path / "run" / "configs"
    trainer = tomllib.loads((configs / "trainer.toml").read_text())
    inference = tomllib.loads((configs / "inference-0.toml").read_text())
    assert trainer["model"]["device"] == "auto" and inference["device"] == "auto"
    toml = _write(tmp_path)
    toml.write_text(toml.read_text() + '[trainer.model]\ndevice = "cpu"\n')
    assert slurm.main(["@", str(toml), "--dry-run"]) == 0
    assert tomllib.loads((configs / "trainer.toml").read_text())["model"]["device"] == "cpu"


def test_server_count_must_match_the_slurm_layout(tmp_path, capsys):
    assert slurm.main(["@", str(_write(tmp_path, servers=3)), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "deployment.num_inference_servers (3) must equal" in err and "2 * 2 = 4" in err
    assert slurm.main(["@", str(_write(tmp_path, servers=6, per=3)), "--dry-run"]) == 2
    assert "servers_per_inference_node (3) must divide slurm.gpus_per_node (8)" in capsys.readouterr().err


SEED = Path(__file__).resolve().parents[3] / "docs" / "configs" / "glm5-seed.toml"
GLM5 = SEED.with_name("glm5.json")


def test_the_reference_glm5_job_renders_where_the_model_is_not(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # its run_dir is relative: outputs/glm5-seed here
    assert rl.main(["@", str(SEED), "--slurm", "--dry-run"]) == 0
    assert "/models/GLM-5-FP8/config.json is not readable here" in capsys.readouterr().out
    run = tmp_path / "outputs" / "glm5-seed"
    script = (run / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=28" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--nnodes=20 --nproc-per-node=8" in script and "--data-parallel-size 8" in script
    assert "for path in /models/GLM-5-FP8 .venv-vllm/bin/python" in script  # checked on every node
    trainer = tomllib.loads((run / "configs" / "trainer.toml").read_text())
    inference = tomllib.loads((run / "configs" / "inference-7.toml").read_text())
    assert trainer["model"]["device"] == "auto" and inference["device"] == "auto"
    assert (trainer["parallel"]["ep"], trainer["parallel"]["cp"]) == (8, 8)
    assert trainer["publish"]["fp8"] is True and trainer["publish"]["dtype"] == "bfloat16"  # as served
    orchestrator = tomllib.loads((run / "configs" / "orchestrator.toml").read_text())
    assert orchestrator["batch_size"] == 256 and orchestrator["trainer_dp_size"] == 20


def test_the_reference_job_checks_expert_parallel_against_a_given_model_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["@", str(SEED), "--slurm", "--dry-run", "--model-config", str(GLM5)]
    assert rl.main(argv) == 0
    assert "not readable here" not in capsys.readouterr().out
    # 256 experts: ep = 512 divides neither them nor 160 GPUs; the render says so at once
    assert rl.main([*argv, "--trainer.parallel.ep", "512"]) == 2
    assert "[trainer.parallel] with slurm.trainer_nodes * gpus_per_node = 20 * 8" in capsys.readouterr().err


def test_resume_renders_a_job_that_applies_the_plan_when_it_starts(tmp_path, monkeypatch, capsys):
    # an earlier job wrote batches 1..3 and checkpoint 2, then was killed
    monkeypatch.setattr(slurm, "check_inputs", lambda resolved: None)  # the job start's, on the cluster
    for step in (1, 2, 3):
        write_batch(tmp_path / "run", _batch(step))
    (tmp_path / "run" / "checkpoints" / "step_2").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_2" / ".metadata").write_bytes(b"")
    toml = _write(tmp_path)
    assert rl.main(["@", str(toml), "--slurm", "--dry-run"]) == 2  # a new run may not start over it
    assert "already holds a run" in capsys.readouterr().err

    assert rl.main(["@", str(toml), "--slurm", "--dry-run", "--resume"]) == 0
    assert "resuming: trainer from checkpoint step 2, retraining batches 3..3" in capsys.readouterr().out
    script = (tmp_path / "run" / "slurm.sbatch").read_text()
    rl_toml = tmp_path / "run" / "configs" / "rl.toml"
    assert f'-m asyncrl slurm --job-start --resume @ "{rl_toml}"' in script
    # the job's head node plans again from what the run directory holds then, and applies it
    (tmp_path / "run" / "configs" / "trainer.toml").unlink()
    assert slurm.main(["--job-start", "--resume", "@", str(rl_toml)]) == 0
    trainer = tomllib.loads((tmp_path / "run" / "configs" / "trainer.toml").read_text())
    orchestrator = tomllib.loads((tmp_path / "run" / "configs" / "orchestrator.toml").read_text())
    assert trainer["resume_step"] == 2 and orchestrator["resume"] is True
    # the job of a new run refuses to start over it
    assert slurm.main(["--job-start", "@", str(rl_toml)]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_distributed_weights_get_the_trainer_nodes_address_when_the_job_runs(tmp_path, capsys):
    """One trainer node: the store listens there at rdzv_port + 1; the configs hold the job's variable,
    which the job's command lines expand. Several trainer nodes are refused (rank 0's node is not known)."""
    cfg = tmp_path / "rl.toml"
    cfg.write_text(
        TOML.format(run=tmp_path / "run", servers=4, per=2).replace("trainer_nodes = 4", "trainer_nodes = 1")
    )
    assert slurm.main(["@", str(cfg), "--dry-run", "--weights.transport", "distributed"]) == 0
    run = tmp_path / "run"
    script = (run / "slurm.sbatch").read_text()
    flag = '--weights.endpoint "${TRAINER_MASTER}:29501"'
    assert f'--port "$port" {flag} &' in script and f'trainer.toml" {flag} &' in script
    configs = {
        n: tomllib.loads((run / "configs" / f"{n}.toml").read_text()) for n in ("trainer", "inference-3")
    }
    assert {c["weights"]["endpoint"] for c in configs.values()} == {"${TRAINER_MASTER}:29501"}
    assert configs["inference-3"]["weights_server"] == "server3"
    assert slurm.main(["@", str(_write(tmp_path)), "--dry-run", "--weights.transport", "distributed"]) == 2
    assert "slurm.trainer_nodes = 4 is not supported yet" in capsys.readouterr().err

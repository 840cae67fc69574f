"""`asyncrl slurm`: the sbatch script for 2 inference nodes + 4 trainer nodes, dry-run, config errors."""

from __future__ import annotations

import shutil
import subprocess
import tomllib

import pytest

from asyncrl.launcher import slurm

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
    # 2 servers per inference node, 4 GPUs each, on base_port + local index
    assert "port=$((8100 + j))" in script and "devices=$(seq -s, $((j * 4)) $((j * 4 + 3)))" in script
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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_rendered_script_is_valid_bash_and_builds_the_server_list(tmp_path):
    assert slurm.main(["@", str(_write(tmp_path)), "--dry-run"]) == 0
    script = (tmp_path / "run" / "slurm.sbatch").read_text()
    assert subprocess.run(["bash", "-n", "-c", script], check=False).returncode == 0
    # Execute the node-list and server-list logic with fake Slurm commands.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/bash\necho n1; echo n2; echo t1; echo t2; echo t3; echo t4\n")
    # The fake trainer waits (up to 5 s) until the 4 servers and the orchestrator have logged.
    (fake / "srun").write_text(
        '#!/bin/bash\nif [[ "$*" == *torch.distributed.run* ]]; then\n'
        '  for _ in $(seq 50); do [ "$(wc -l < "$SRUN_LOG")" -ge 5 ] && break; sleep 0.1; done\nfi\n'
        'echo "srun $*" >> "$SRUN_LOG"\n'
    )
    for f in fake.iterdir():
        f.chmod(0o755)
    body = script.replace("source /opt/venv/bin/activate", "true")
    log = tmp_path / "srun.log"
    log.touch()
    env = {
        "PATH": f"{fake}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "x",
        "SLURM_JOB_ID": "7",
        "SRUN_LOG": str(log),
    }
    assert subprocess.run(["bash", "-c", body], env=env, check=False).returncode == 0
    calls = log.read_text().splitlines()
    assert sum("inference @" in c for c in calls) == 4
    assert any("--nodelist=t1,t2,t3,t4" in c and "--rdzv-endpoint=t1:29500" in c for c in calls)
    orch = next(c for c in calls if "orchestrator @" in c)
    assert '["http://n1:8100","http://n1:8101","http://n2:8100","http://n2:8101"]' in orch


def test_server_count_must_match_the_slurm_layout(tmp_path, capsys):
    assert slurm.main(["@", str(_write(tmp_path, servers=3)), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "deployment.num_inference_servers (3) must equal" in err and "2 * 2 = 4" in err
    assert slurm.main(["@", str(_write(tmp_path, servers=6, per=3)), "--dry-run"]) == 2
    assert "servers_per_inference_node (3) must divide slurm.gpus_per_node (8)" in capsys.readouterr().err

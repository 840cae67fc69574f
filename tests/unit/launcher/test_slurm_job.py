"""The rendered sbatch job run on a fake cluster (tests/fake_slurm.py): where each step lands, which
GPUs and port each server gets, and the cluster check that stops a job before it starts anything.

The job's interpreter is a stand-in: asyncrl's own checks (`-c 'import asyncrl'`, `-m asyncrl slurm
--job-start`) run for real; the run's processes only record their node, GPUs and command line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncrl.launcher import slurm
from asyncrl.tools.init_model import init_model
from fake_slurm import FakeSlurm
from helpers import child_env

TOML = """
model = "models/m"
run_dir = "run"
seq_len = 4096

[deployment]
num_inference_servers = 4
base_port = 8100

[slurm]
inference_nodes = 2
trainer_nodes = 1
gpus_per_node = 4
servers_per_inference_node = 2
rdzv_port = 29600
python = "{python}"
"""

NODES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
GPUS = {node: {"CUDA_VISIBLE_DEVICES": "4,5,6,7"} for node in NODES}  # as Slurm sets it per node

# Run-process lines: 4 servers, the orchestrator and the trainer's torchrun. The fake trainer waits
# for the others to be up, then exits 0 as a finished run's trainer does.
_INTERPRETER = """#!/bin/bash
case "$1 $2 $3" in "-c "*|"-m asyncrl slurm") exec {python} "$@";; esac
echo "$SLURMD_NODENAME|${{CUDA_VISIBLE_DEVICES:-}}|$*" >> {log}
if [[ "$*" == *torch.distributed.run* ]]; then
  for _ in $(seq 300); do [ "$(wc -l < {log})" -ge 6 ] && exit 0; sleep 0.1; done
  exit 1
fi
exec sleep 60
"""


def _render(tmp_path: Path, monkeypatch, *, model: bool = False) -> tuple[Path, Path]:
    """Render the job in tmp_path (its working directory); the job script and the processes' log.

    `model`: a real model at models/m, which the head node's input check reads; otherwise an empty
    directory, enough for a job that stops before."""
    log = tmp_path / "processes.log"
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(_INTERPRETER.format(python=sys.executable, log=log))
    python.chmod(0o755)
    if model:
        init_model("tiny-moe", tmp_path / "models" / "m", seed=0)
    else:
        (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "rl.toml").write_text(TOML.format(python=python))
    monkeypatch.chdir(tmp_path)
    assert slurm.main(["@", "rl.toml", "--dry-run"]) == 0
    return tmp_path / "run" / "slurm.sbatch", log


def _submit(cluster: FakeSlurm, script: Path) -> int:
    out = subprocess.run(
        ["sbatch", str(script)], env=cluster.env(child_env()), capture_output=True, text=True
    )
    assert out.stdout.strip() == "Submitted batch job 1", out.stderr
    return cluster.wait(1, timeout_s=120)


def test_each_server_gets_its_node_its_gpus_and_its_port(tmp_path, monkeypatch):
    script, log = _render(tmp_path, monkeypatch, model=True)
    cluster = FakeSlurm(tmp_path / "slurm", NODES, node_env=GPUS)
    assert _submit(cluster, script) == 0, (tmp_path / "run" / "logs" / "slurm-1.out").read_text()
    lines = [line.split("|") for line in log.read_text().splitlines()]
    servers = sorted(
        (node, gpus, cmd.split("--port ")[1]) for node, gpus, cmd in lines if "inference @" in cmd
    )
    assert servers == [
        ("127.0.0.2", "4,5", "8100"),
        ("127.0.0.2", "6,7", "8101"),
        ("127.0.0.3", "4,5", "8100"),
        ("127.0.0.3", "6,7", "8101"),
    ]
    trainer = next(cmd for node, _, cmd in lines if node == "127.0.0.4" and "torch.distributed.run" in cmd)
    assert "--nproc-per-node=4" in trainer and "--rdzv-endpoint=127.0.0.4:29600" in trainer
    orchestrator = next(cmd for node, _, cmd in lines if node == "127.0.0.4" and "orchestrator @" in cmd)
    urls = '["http://127.0.0.2:8100","http://127.0.0.2:8101","http://127.0.0.3:8100","http://127.0.0.3:8101"]'
    assert urls in orchestrator
    out = (tmp_path / "run" / "logs" / "slurm-1.out").read_text()
    assert out.count("GPUs counted") == 3  # the cluster check ran once on every node
    assert cluster.processes(1) == []  # the job stopped the servers when the trainer finished


def test_a_node_that_does_not_share_the_filesystem_stops_the_job_before_it_starts(tmp_path, monkeypatch):
    script, log = _render(tmp_path, monkeypatch)
    elsewhere = tmp_path / "other-fs"
    (elsewhere / "run").mkdir(parents=True)
    cluster = FakeSlurm(tmp_path / "slurm", NODES, node_env=GPUS, node_cwd={"127.0.0.3": str(elsewhere)})
    assert _submit(cluster, script) == 1
    out = (tmp_path / "run" / "logs" / "slurm-1.out").read_text()
    assert "node 127.0.0.3: run/slurm.check does not hold what the head node just wrote" in out
    assert "filesystem shared by every node" in out and "nothing was started" in out
    assert not log.exists()


def test_a_node_with_fewer_gpus_than_gpus_per_node_stops_the_job(tmp_path, monkeypatch):
    script, log = _render(tmp_path, monkeypatch)
    gpus = GPUS | {"127.0.0.4": {"CUDA_VISIBLE_DEVICES": "0,1"}}
    cluster = FakeSlurm(tmp_path / "slurm", NODES, node_env=gpus)
    assert _submit(cluster, script) == 1
    out = (tmp_path / "run" / "logs" / "slurm-1.out").read_text()
    assert "node 127.0.0.4: 2 GPU(s) visible, but [slurm] gpus_per_node is 4" in out
    assert not log.exists()


def test_a_missing_model_path_stops_the_job(tmp_path, monkeypatch):
    script, log = _render(tmp_path, monkeypatch)
    (tmp_path / "models" / "m").rmdir()
    assert _submit(FakeSlurm(tmp_path / "slurm", NODES, node_env=GPUS), script) == 1
    out = (tmp_path / "run" / "logs" / "slurm-1.out").read_text()
    assert "models/m not found: it must be at the same path on every node" in out
    assert not log.exists()


def test_the_head_node_checks_the_runs_inputs_before_it_starts_a_process(tmp_path, monkeypatch):
    # the render cannot (the files may live on the cluster only); the job's head node does
    script, log = _render(tmp_path, monkeypatch)  # models/m is there, but holds no model
    assert _submit(FakeSlurm(tmp_path / "slurm", NODES, node_env=GPUS), script) == 2
    out = (tmp_path / "run" / "logs" / "slurm-1.out").read_text()
    assert "asyncrl slurm: model = 'models/m': models/m has no config.json" in out
    assert not log.exists()

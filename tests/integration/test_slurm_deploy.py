"""The reference deployment's shape, run: the sbatch job of `asyncrl rl --slurm` with a prefill/decode
pair whose groups are each DP = 2 over two inference nodes, executed by the stand-in Slurm
(tests/fake_slurm.py) with stand-in vLLM processes (tests/fake_vllm.py), for 3 RL steps.

Nodes are loopback addresses: 127.0.0.2 and 127.0.0.3 serve (2 GPU slices each, one GPU per
slice), 127.0.0.4 trains (torchrun, 2 gloo ranks) and runs the orchestrator. What runs for real:
the rendered job, the placement of every step (node, CUDA_VISIBLE_DEVICES), the heads' and
followers' flags (address, handshake port, ranks: each follower connects to its head, which serves
only once its group is whole), the orchestrator's pairs and the two-hop requests with their salts
and versions, in-flight weight updates of both servers of the pair, and the trainer. What does not:
vLLM itself; each head serves with asyncrl's embedded engine, the followers' engines do nothing,
and no KV crosses between the pair's servers (the decode server recomputes the prompt).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from asyncrl.tools.init_model import init_model
from asyncrl.transport.metrics import read_metrics
from fake_slurm import FakeSlurm
from helpers import child_env, free_port, free_port_run

pytestmark = pytest.mark.long

NODES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
GPUS = {node: {"CUDA_VISIBLE_DEVICES": "0,1"} for node in NODES}
STEPS = 3
KV = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
OFFLOAD = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30},
}
# the decode servers also offload their KV to CPU memory
DECODE_KV = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"connectors": [KV, OFFLOAD]},
}
FAKE_VLLM = Path(__file__).resolve().parents[1] / "fake_vllm.py"


def _config(tmp_path: Path) -> dict:
    group = {
        "python": str(tmp_path / "bin" / "vllm-python"),
        "data_parallel_size": 2,
        "data_parallel_size_local": 1,
        "data_parallel_rpc_port": free_port_run(2),
        "kv_transfer_config": KV,
    }
    return {
        "model": "model",
        "run_dir": "run",
        "max_steps": STEPS,
        "seq_len": 256,
        "deployment": {"num_inference_servers": 1, "base_port": free_port_run(2)},
        "inference": {
            "backend": "vllm",
            "dtype": "float32",
            "max_num_seqs": 32,
            "deployment": "disaggregated",
            "vllm": group | {"kv_transfer_config": DECODE_KV},
            "prefill": group,
        },
        "orchestrator": {
            "batch_size": 8,
            "group_size": 4,
            "max_async_steps": 1,
            "max_off_policy_steps": 1,
            "health_poll_s": 0.5,
            "sampling": {"temperature": 1.0, "max_tokens": 4},
            "envs": {
                "envs": [
                    {
                        "name": "reverse-text",
                        "args": {"min_len": 1, "max_len": 2, "alphabet": "abcdefgh"},
                        "max_total_tokens": 256,
                    }
                ]
            },
        },
        "trainer": {"optim": {"lr": 2e-3}, "peak_flops": 1e11},
        "slurm": {
            "inference_nodes": 2,
            "trainer_nodes": 1,
            "gpus_per_node": 2,
            "servers_per_inference_node": 2,
            "rdzv_port": free_port(),
            "python": sys.executable,
        },
    }


def _logs(run: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run / "logs").iterdir()))


@pytest.mark.timeout(900)
def test_a_prefill_decode_pair_of_dp2_groups_over_two_nodes_runs_3_rl_steps(tmp_path):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    shim = tmp_path / "bin" / "vllm-python"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_VLLM} "$@"\n')
    shim.chmod(0o755)
    cfg = _config(tmp_path)
    (tmp_path / "rl.toml").write_text(tomli_w.dumps(cfg))
    cluster = FakeSlurm(tmp_path / "slurm", NODES, node_env=GPUS)
    env = cluster.env(child_env(FAKE_VLLM_LOG=str(tmp_path / "vllm.jsonl")))
    argv = [sys.executable, "-m", "asyncrl", "rl", "@", "rl.toml", "--slurm"]
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "Submitted batch job 1" in out.stdout, out.stdout + out.stderr
    run = tmp_path / "run"
    assert cluster.wait(1, timeout_s=900) == 0, _logs(run)

    steps = [r["step"] for r in read_metrics(run, "trainer")]
    assert steps == list(range(1, STEPS + 1))
    fields = ("node", "gpus", "port", "headless", "start_rank", "address", "rpc_port")
    processes = sorted(
        (*(p[k] for k in fields), p["kv_transfer_config"]["kv_connector"])
        for p in map(json.loads, (tmp_path / "vllm.jsonl").read_text().splitlines())
    )
    base, rpc = cfg["deployment"]["base_port"], cfg["inference"]["vllm"]["data_parallel_rpc_port"]
    assert processes == [
        # prefill head (slice 0 of node 0), decode head (slice 1); their followers on node 1
        ("127.0.0.2", "0", str(base), False, None, "127.0.0.2", str(rpc), "NixlConnector"),
        ("127.0.0.2", "1", str(base + 1), False, None, "127.0.0.2", str(rpc + 1), "MultiConnector"),
        ("127.0.0.3", "0", str(base), True, "1", "127.0.0.2", str(rpc), "NixlConnector"),
        ("127.0.0.3", "1", str(base + 1), True, "1", "127.0.0.2", str(rpc + 1), "MultiConnector"),
    ]
    log = (run / "logs" / "orchestrator.log").read_text()
    for version in (1, 2):  # loaded into the pair: both its servers, inside one pause
        assert f"weights v{version} " in log and "loaded on 1 server(s)" in log
    # both hops of the requests: to the prefill head (base) and the decode head (base + 1)
    assert (
        f"127.0.0.2:{base}/inference/v1/generate" in log
        and f"127.0.0.2:{base + 1}/inference/v1/generate" in log
    )
    assert cluster.processes(1) == []

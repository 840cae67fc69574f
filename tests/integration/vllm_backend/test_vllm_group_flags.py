"""The commands a Slurm job gives the nodes of vLLM data-parallel groups, read by vLLM's own parser
(its `serve` arguments): the head and the headless follower of a group over two nodes, with a KV
connector, and a server with vLLM's CPU KV offload. Nothing is started: vLLM's import, 20-60 s."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest
from vllm_helpers import HAS_VLLM, NO_VLLM, VLLM_PYTHON

from asyncrl.config import load_config
from asyncrl.launcher.slurm import SlurmRLConfig, render_sbatch

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)]

KV = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}

# Each argv as vLLM's `serve` reads it: the api_server module and `vllm serve` share this parser.
_PARSE = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
for argv in json.loads(sys.stdin.read()):
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    keys = ("headless", "data_parallel_size", "data_parallel_size_local", "data_parallel_address",
            "data_parallel_rpc_port", "data_parallel_start_rank", "enable_expert_parallel",
            "kv_offloading_size", "kv_offloading_backend", "port")
    out = {k: getattr(ns, k) for k in keys}
    out["kv_connector"] = ns.kv_transfer_config.kv_connector if ns.kv_transfer_config else None
    print(json.dumps(out))
"""


def _argvs(cfg: SlurmRLConfig) -> list[list[str]]:
    """vLLM's arguments of every step of the job, the head's host name filled in."""
    out = []
    for line in render_sbatch(cfg, cfg.run_dir).splitlines():
        if line.startswith("launch "):
            argv = shlex.split(line.replace("${INFERENCE_NODES[0]}", "10.0.0.1"))
            start = argv.index("-m") + 2
            out.append(argv[start + (argv[start - 1] == "vllm.entrypoints.cli.main") :])
    return out


def _parse(argvs: list[list[str]]) -> list[dict]:
    done = subprocess.run(
        [VLLM_PYTHON, "-c", _PARSE], input=json.dumps(argvs), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _cfg(inference: dict, servers: int) -> SlurmRLConfig:
    return load_config(
        SlurmRLConfig,
        {
            "model": "models/m",
            "api_key": "k",
            "deployment": {"num_inference_servers": servers, "base_port": 8000},
            "inference": {"backend": "vllm"} | inference,
            "slurm": {"inference_nodes": 2, "trainer_nodes": 1, "gpus_per_node": 8},
        },
    )


def test_vllm_reads_a_groups_head_and_follower_and_the_offload_flags():
    group = {"data_parallel_size": 16, "data_parallel_size_local": 8, "enable_expert_parallel": True}
    pair = _cfg({"vllm": group | {"kv_transfer_config": KV}}, servers=1)
    offload = _cfg({"vllm": {"data_parallel_size": 8, "kv_offloading_size_gb": 4}}, servers=2)
    head, follower, first, _ = _parse(_argvs(pair) + _argvs(offload))
    common = {
        "data_parallel_size": 16,
        "data_parallel_size_local": 8,
        "data_parallel_address": "10.0.0.1",
        "data_parallel_rpc_port": 13345,
        "enable_expert_parallel": True,
        "kv_connector": "NixlConnector",
    }
    assert head.items() >= (common | {"headless": False, "data_parallel_start_rank": None}).items()
    assert follower.items() >= (common | {"headless": True, "data_parallel_start_rank": 8}).items()
    assert (first["kv_offloading_size"], first["kv_offloading_backend"]) == (4.0, "native")
    assert first["data_parallel_size"] == 8 and first["data_parallel_address"] is None

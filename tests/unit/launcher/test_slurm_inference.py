"""The inference side of a Slurm job: data-parallel groups across nodes, prefill/decode pairs, GPU
slices, ports and ranks (asyncrl.launcher.slurm_inference), and the lines the job runs them with."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.launcher import rl
from asyncrl.launcher.slurm import SlurmRLConfig, render_sbatch
from asyncrl.launcher.slurm_inference import check_one_machine, plan_inference

KV = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def _cfg(inference: dict, *, servers: int = 1, nodes: int = 2, per: int = 2, gpus: int = 8) -> SlurmRLConfig:
    return load_config(
        SlurmRLConfig,
        {
            "model": "models/m",
            "api_key": "k",
            "deployment": {"num_inference_servers": servers, "base_port": 8000},
            "inference": {"backend": "vllm"} | inference,
            "slurm": {
                "inference_nodes": nodes,
                "trainer_nodes": 1,
                "gpus_per_node": gpus,
                "servers_per_inference_node": per,
            },
        },
    )


def _plan(cfg: SlurmRLConfig):
    return plan_inference(
        cfg.slurm,
        cfg.resolve().inference[0],
        num_servers=cfg.deployment.num_inference_servers,
        base_port=8000,
    )


def _rows(steps) -> list[tuple]:
    return [
        (s.name, s.node, s.gpu_first, s.gpu_count, s.head, s.port, s.rpc_port, s.start_rank) for s in steps
    ]


def test_a_prefill_decode_pair_of_groups_spanning_two_nodes_gets_slices_ports_and_ranks():
    # prefill: DP 2 x TP 2 on one node; decode: DP 4 over 2 nodes (2 engines of TP 2 per node)
    cfg = _cfg(
        {
            "deployment": "disaggregated",
            "vllm": {
                "tensor_parallel_size": 2,
                "data_parallel_size": 4,
                "data_parallel_size_local": 2,
                "kv_transfer_config": KV,
            },
            "prefill": {"tensor_parallel_size": 2, "data_parallel_size": 2, "kv_transfer_config": KV},
        },
        servers=2,
        nodes=3,
    )
    assert _rows(_plan(cfg)) == [
        # name, node, first GPU, GPUs, head node, HTTP port, handshake port, first DP rank
        ("prefill-0", 0, 0, 4, 0, 8000, 13345, 0),
        ("prefill-1", 0, 4, 4, 0, 8001, 13346, 0),
        ("decode-0", 1, 0, 4, 1, 8000, 13345, 0),
        ("decode-0-rank2", 2, 0, 4, 1, 8000, 13345, 2),
        ("decode-1", 1, 4, 4, 1, 8001, 13346, 0),
        ("decode-1-rank2", 2, 4, 4, 1, 8001, 13346, 2),
    ]


def test_the_job_starts_a_head_and_headless_followers_and_tells_the_orchestrator_each_pair(tmp_path):
    cfg = _cfg(
        {
            "deployment": "disaggregated",
            "vllm": {
                "data_parallel_size": 2,
                "data_parallel_size_local": 1,
                "enable_expert_parallel": True,
                "kv_transfer_config": KV,
            },
            "prefill": {"data_parallel_size": 2, "data_parallel_size_local": 1, "kv_transfer_config": KV},
        },
        gpus=2,
    )
    script = render_sbatch(cfg, tmp_path)
    launches = [line for line in script.splitlines() if line.startswith("launch ")]
    assert [line.split()[1:3] for line in launches] == [
        ["0", "0:1"],
        ["1", "0:1"],
        ["0", "1:1"],
        ["1", "1:1"],
    ]
    head, follower = launches[2], launches[3]
    assert "-m vllm.entrypoints.openai.api_server" in head and "--headless" not in head
    assert "--port 8001" in head and "--data-parallel-size 2 --enable-expert-parallel" in head
    group = '--data-parallel-size-local 1 --data-parallel-address "${INFERENCE_NODES[0]}"'
    group += " --data-parallel-rpc-port 13346"
    assert group in head and group in follower
    assert "-m vllm.entrypoints.cli.main serve --model models/m" in follower
    assert follower.endswith("--headless --data-parallel-start-rank 1")
    assert '"kv_connector":"NixlConnector"' in head and '"kv_connector":"NixlConnector"' in launches[0]
    assert 'PREFILL_SERVERS+=("\\"http://${INFERENCE_NODES[0]}:8000\\"")' in script
    assert 'SERVERS+=("\\"http://${INFERENCE_NODES[0]}:8001\\"")' in script
    assert script.count("SERVERS+=(") == 2  # heads only
    assert '--prefill-servers "[$(IFS=,; echo "${PREFILL_SERVERS[*]}")]"' in script
    assert "export VLLM_API_KEY=" in script and "VLLM_API_KEY=k" not in script


def test_kv_offload_renders_vllms_flags():
    cfg = _cfg({"vllm": {"kv_offloading_size_gb": 64, "data_parallel_size": 4}}, servers=4, nodes=2)
    script = render_sbatch(cfg, cfg.run_dir)
    assert script.count("--kv-offloading-size 64.0 --kv-offloading-backend native") == 4


@pytest.mark.parametrize(
    ("inference", "servers", "message"),
    [
        (
            {"vllm": {"data_parallel_size": 8}},
            4,
            "= 8 GPUs per node, more than its slice of slurm.gpus_per_node / servers_per_inference_node = 4",
        ),
        (
            {"vllm": {"tensor_parallel_size": 2, "data_parallel_size": 4, "data_parallel_size_local": 2}},
            4,
            "take 8 node slices",
        ),
        (
            {"vllm": {"data_parallel_size": 4}},
            3,
            "deployment.num_inference_servers (3) must equal slurm.inference_nodes",
        ),
    ],
)
def test_layouts_that_do_not_fit_the_nodes_are_errors_that_name_the_keys(inference, servers, message):
    with pytest.raises(ConfigError) as e:
        _plan(_cfg(inference, servers=servers))
    assert message in str(e.value)


def test_a_group_that_finds_no_free_slice_on_consecutive_nodes_is_an_error():
    # 3 groups of 2 nodes fill 6 slices of 3 nodes in count, but the third would need a fourth node
    group = {"data_parallel_size": 2, "data_parallel_size_local": 1}
    with pytest.raises(ConfigError, match="the serve server 2 spans 2 nodes and finds no free slice"):
        _plan(_cfg({"vllm": group}, servers=3, nodes=3, per=2, gpus=2))
    assert len(_plan(_cfg({"vllm": group}, servers=3, nodes=2, per=3, gpus=3))) == 6


def test_asyncrl_rl_on_one_machine_refuses_what_only_a_job_lays_out():
    for inference in (
        {"deployment": "disaggregated", "vllm": {"kv_transfer_config": KV}},
        {"vllm": {"data_parallel_size": 2, "data_parallel_size_local": 1}},
    ):
        with pytest.raises(ConfigError, match="asyncrl rl --slurm"):
            check_one_machine(_cfg(inference).resolve().inference[0])
    check_one_machine(_cfg({"vllm": {"data_parallel_size": 2}}).resolve().inference[0])


DEPLOY = Path(__file__).resolve().parents[3] / "docs" / "configs" / "glm5-deploy.toml"


def test_the_reference_deployment_renders_pairs_of_groups_over_two_nodes_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rl.main(["@", str(DEPLOY), "--slurm", "--dry-run"]) == 0
    run = tmp_path / "outputs" / "glm5-deploy"
    script = (run / "slurm.sbatch").read_text()
    launches = [line.split()[1:4] for line in script.splitlines() if line.startswith("launch ")]
    logs = [Path(log.strip('"')).name for _, _, log in launches]
    assert [(node, gpus) for node, gpus, _ in launches] == [(str(n), "0:8") for n in range(8)]
    assert logs == [
        f"{name}{rank}.log"
        for name in ("prefill-0", "prefill-1", "decode-0", "decode-1")
        for rank in ("", "-rank8")
    ]
    assert script.count("--headless --data-parallel-start-rank 8") == 4
    assert script.count("--data-parallel-size 16 --enable-expert-parallel") == 8
    assert script.count('"kv_connector":"MultiConnector"') == 4  # the decode groups offload too
    orchestrator = tomllib.loads((run / "configs" / "orchestrator.toml").read_text())
    assert orchestrator["return_routed_experts"] is False and orchestrator["inference_backend"] == "vllm"
    assert "--prefill-servers" in script

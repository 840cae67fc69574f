"""`[inference] deployment`, `[inference.prefill]` and the data-parallel keys of `[inference.vllm]`:
what each role runs, and the mistakes caught as the file is read."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, InferenceConfig, load_config
from asyncrl.config.rl import RLConfig
from asyncrl.config.vllm import VLLMConfig

KV = {"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}


def _inference(**keys) -> InferenceConfig:
    return load_config(InferenceConfig, {"model": "m", "backend": "vllm"} | keys)


def test_each_role_runs_its_own_vllm_keys():
    cfg = _inference(
        deployment="disaggregated",
        vllm={"data_parallel_size": 16, "data_parallel_size_local": 8, "kv_transfer_config": KV},
        prefill={"tensor_parallel_size": 4, "kv_transfer_config": KV},
    )
    decode, prefill = cfg.role_config("decode").vllm, cfg.role_config("prefill").vllm
    assert (decode.nodes_per_group, decode.gpus_per_node) == (2, 8)
    assert (prefill.nodes_per_group, prefill.gpus_per_node) == (1, 4)
    same = _inference(deployment="disaggregated", vllm={"kv_transfer_config": KV})
    assert same.role_config("prefill") is same  # no [inference.prefill]: the decode servers' keys


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"prefill": {"kv_transfer_config": KV}}, '[inference.prefill] is for deployment = "disaggregated"'),
        ({"deployment": "disaggregated", "backend": "embedded"}, 'needs backend = "vllm"'),
        ({"deployment": "disaggregated"}, "the prefill servers need a KV connector: set [inference.vllm]"),
        (
            {"deployment": "disaggregated", "vllm": {"kv_transfer_config": KV}, "prefill": {}},
            "the prefill servers need a KV connector: set [inference.prefill] kv_transfer_config",
        ),
        (
            {
                "deployment": "disaggregated",
                "vllm": {"kv_transfer_config": KV, "enable_return_routed_experts": True},
            },
            "does not return routed experts yet",
        ),
        (
            {"vllm": {"data_parallel_size": 6, "data_parallel_size_local": 4}},
            "must divide data_parallel_size (6)",
        ),
        (
            {"vllm": {"kv_transfer_config": KV, "kv_offloading_size_gb": 8}},
            "kv_offloading_size_gb replaces kv_transfer_config's connector in vLLM",
        ),
    ],
)
def test_deployment_mistakes_are_errors_that_name_the_key(keys, message):
    with pytest.raises(ConfigError) as e:
        _inference(**keys)
    assert message in str(e.value)


def test_the_orchestrator_gets_a_prefill_url_per_server_and_cannot_set_them_itself():
    base = {
        "model": "m",
        "deployment": {"num_inference_servers": 2, "base_port": 9000},
        "inference": {"backend": "vllm", "deployment": "disaggregated", "vllm": {"kv_transfer_config": KV}},
    }
    resolved = load_config(RLConfig, base).resolve()
    assert resolved.orchestrator.servers == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert resolved.orchestrator.prefill_servers == ["http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    assert load_config(RLConfig, {"model": "m"}).resolve().orchestrator.prefill_servers == []
    with pytest.raises(ConfigError, match="prefill_servers"):
        load_config(RLConfig, base | {"orchestrator": {"prefill_servers": ["http://x"]}})


def test_vllm_defaults_keep_a_group_on_one_node():
    v = VLLMConfig(data_parallel_size=8, tensor_parallel_size=1)
    assert (v.engines_per_node, v.nodes_per_group, v.gpus_per_node) == (8, 1, 8)

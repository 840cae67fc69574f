"""The one HF writer (`HFCheckpointWriter`) and the one dtype table, on a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.model import (
    HFCheckpointWriter,
    Transformer,
    dtype_name,
    preset_args,
    to_hf_state_dict,
    torch_dtype,
)


@pytest.fixture
def model() -> Transformer:
    m = Transformer(preset_args("tiny-moe"))
    m.init_weights(seed=0)
    return m


def test_index_lists_every_tensor_once_with_the_total_size(model, tmp_path):
    state = to_hf_state_dict(model)
    writer = HFCheckpointWriter(tmp_path, model, max_shard_bytes=100_000)
    for name, t in state.items():
        writer.add(name, t)
    writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == state.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert {p.name for p in tmp_path.glob("*.safetensors")} == set(index["weight_map"].values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"


def test_unknown_duplicate_and_missing_tensors_are_named(model, tmp_path):
    state = to_hf_state_dict(model)
    writer = HFCheckpointWriter(tmp_path, model)
    with pytest.raises(
        ValueError, match="'model.layers.0.mlp.experts.gate_proj' is not in the checkpoint plan"
    ):
        writer.add("model.layers.0.mlp.experts.gate_proj", model.layers[0].mlp.experts.gate_proj)  # stacked
    first = next(iter(state))
    writer.add(first, state[first])
    with pytest.raises(ValueError, match="added twice"):
        writer.add(first, state[first])
    with pytest.raises(ValueError, match="tensors never added"):
        writer.finish()
    assert not (tmp_path / "config.json").exists()


def test_dtype_table_round_trips_and_names_the_choices():
    for name in ("float32", "bfloat16", "float16"):
        assert dtype_name(torch_dtype(name)) == name
    with pytest.raises(
        ValueError, match=r"unknown dtype 'fp32'; expected one of \['bfloat16', 'float16', 'float32'\]"
    ):
        torch_dtype("fp32")
    with pytest.raises(ValueError, match="unsupported weight dtype torch.float64"):
        dtype_name(torch.float64)

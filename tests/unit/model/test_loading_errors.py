"""Bad model directories and configs get errors that name the problem."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from asyncrl.model import ModelConfigError, from_pretrained


def _config(path):
    return json.loads((path / "config.json").read_text())


def _write_config(path, cfg):
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ModelConfigError, match="model directory not found"):
        from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match="no config.json"):
        from_pretrained(tmp_path)


def test_missing_model_type(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3_moe")
    cfg = _config(path)
    del cfg["model_type"]
    _write_config(path, cfg)
    with pytest.raises(ModelConfigError, match="no 'model_type'"):
        from_pretrained(path)


def test_unsupported_model_type(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3_moe")
    _write_config(path, _config(path) | {"model_type": "llama"})
    with pytest.raises(ModelConfigError, match="unsupported model_type 'llama'.*qwen3_moe"):
        from_pretrained(path)


def test_unsupported_features_are_not_silently_ignored(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    cfg = _config(path)
    _write_config(path, cfg | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ModelConfigError, match="RoPE scaling"):
        from_pretrained(path)
    _write_config(path, cfg | {"use_sliding_window": True})
    with pytest.raises(ModelConfigError, match="sliding_window"):
        from_pretrained(path)


def test_invalid_json(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="invalid JSON"):
        from_pretrained(path)


def test_missing_tensor_is_named(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3_moe")
    file = path / "model.safetensors"
    state = load_file(file)
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, file)
    with pytest.raises(
        ModelConfigError, match=r"missing tensors \['model.layers.1.self_attn.k_norm.weight'\]"
    ):
        from_pretrained(path)


def test_missing_expert_is_named(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3_moe")
    file = path / "model.safetensors"
    state = load_file(file)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        del state[f"model.layers.2.mlp.experts.4.{proj}.weight"]
    save_file(state, file)
    with pytest.raises(ModelConfigError, match=r"missing experts \[4\] for model.layers.2.mlp.experts"):
        from_pretrained(path)


def test_wrong_shape_and_unexpected_tensor(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    file = path / "model.safetensors"
    state = load_file(file)
    state["model.norm.weight"] = state["model.norm.weight"][:-1].clone()
    save_file(state, file)
    with pytest.raises(ModelConfigError, match=r"'model.norm.weight' has shape \[63\], expected \[64\]"):
        from_pretrained(path)
    state = load_file(file) | {"model.extra.weight": state["model.norm.weight"]}
    state["model.norm.weight"] = state["model.layers.0.input_layernorm.weight"].clone()
    save_file(state, file)
    with pytest.raises(ModelConfigError, match=r"unexpected tensors \['model.extra.weight'\]"):
        from_pretrained(path)


def test_no_weights(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelConfigError, match=r"no \*.safetensors.*\.bin checkpoints are not supported"):
        from_pretrained(path)


def test_bad_head_counts(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    _write_config(path, _config(path) | {"num_key_value_heads": 3})
    with pytest.raises(
        ModelConfigError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"
    ):
        from_pretrained(path)

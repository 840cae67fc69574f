"""The serving format of published weights: bf16 / fp32 casts and block-scale FP8 as vLLM loads it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from asyncrl.model import HFCheckpointWriter, Transformer, from_pretrained, preset_args, to_hf_state_dict
from asyncrl.model.fp8 import FP8_DTYPE, dequantize_weight, quantize_weight
from asyncrl.model.hf import load_state_dict
from asyncrl.model.serving import ServingFormat, dequantize_blocks, serving_format, to_serving


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = Transformer(preset_args("tiny-moe"))
    m.init_weights(seed=0)
    return m


def _write(model: Transformer, path, fmt: ServingFormat, max_shard_bytes: int = 10**9) -> dict:
    writer = HFCheckpointWriter(path, model, max_shard_bytes, fmt=fmt)
    for name, t in to_hf_state_dict(model).items():
        for out_name, out in to_serving(name, t, fmt):
            writer.add(out_name, out)
    writer.finish()
    tensors = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return tensors


def test_bf16_files_hold_the_weights_cast_and_say_so(model, tmp_path):
    fmt = serving_format(model, torch.bfloat16)
    files = _write(model, tmp_path, fmt, max_shard_bytes=200_000)
    want = to_hf_state_dict(model)
    assert files.keys() == want.keys()
    for name, t in want.items():
        assert files[name].dtype == torch.bfloat16 and torch.equal(files[name], t.to(torch.bfloat16)), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and "quantization_config" not in config
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in want.values())
    loaded = from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float())


def test_fp8_takes_whole_fused_groups_and_never_the_lm_head(model):
    fmt = serving_format(model, torch.bfloat16, fp8=True)
    layer = "model.layers.0"
    # o_proj [128, 128] and the experts ([128, 128] per expert) are eligible; k_proj [64, 128] is not,
    # so q_proj and v_proj, which vLLM fuses with it into qkv_proj, stay bf16 with it.
    assert {m for m in fmt.fp8_modules if m.startswith(layer + ".")} == {
        f"{layer}.self_attn.o_proj",
        f"{layer}.mlp.experts",
    }
    ignored = serving_format(model, torch.bfloat16, fp8=True, ignore=["*.o_proj"])
    assert ignored.fp8_modules == fmt.fp8_modules - {f"model.layers.{i}.self_attn.o_proj" for i in range(4)}
    everything = serving_format(model, torch.bfloat16, fp8=True, ignore=[])
    assert "lm_head" not in everything.fp8_modules  # vLLM's LM head takes no FP8 weights


def test_fp8_files_are_blocks_and_scales_in_deepseek_v3_layout(model, tmp_path):
    fmt = serving_format(model, torch.bfloat16, fp8=True)
    files = _write(model, tmp_path, fmt)
    want = to_hf_state_dict(model)
    expert = "model.layers.2.mlp.experts.5.down_proj.weight"
    q, scale = quantize_weight(want[expert])
    assert files[expert].dtype == FP8_DTYPE and torch.equal(files[expert].float(), q.float())
    assert files[expert + "_scale_inv"].dtype == torch.float32
    assert torch.equal(files[expert + "_scale_inv"], scale)
    q_proj = "model.layers.2.self_attn.q_proj.weight"
    assert torch.equal(files[q_proj], want[q_proj].to(torch.bfloat16))
    assert sum(name.endswith("_scale_inv") for name in files) == 4 * (1 + 3 * 8)  # o_proj + 8 x 3 experts
    config = json.loads((tmp_path / "config.json").read_text())
    quant = config["quantization_config"]
    assert config["torch_dtype"] == "bfloat16"
    assert {k: quant[k] for k in ("quant_method", "activation_scheme", "fmt", "weight_block_size")} == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    kept = set(quant["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.norm", "model.layers.2.mlp.gate"} <= kept
    assert {"model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.k_proj"} <= kept
    assert not kept & fmt.fp8_modules


def test_fp8_files_load_dequantized_and_requantize_to_the_same_blocks(model, tmp_path):
    fmt = serving_format(model, torch.float32, fp8=True)
    _write(model, tmp_path, fmt)
    state = load_state_dict(tmp_path, model.args, torch.float32)
    w = model.layers[1].self_attn.o_proj.weight.detach()
    q, scale = quantize_weight(w)
    loaded = state["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(loaded, dequantize_weight(q, scale))
    q2, scale2 = quantize_weight(loaded)  # what an FP8 engine computes from the loaded weight
    assert torch.equal(q2.float(), q.float())
    torch.testing.assert_close(scale2, scale, rtol=2e-7, atol=0)
    assert torch.equal(state["model.norm.weight"], model.model.norm.weight.detach())


def test_dequantize_handles_partial_edge_blocks():
    q = torch.randn(130, 200).to(FP8_DTYPE)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = dequantize_blocks(q, scale)
    assert torch.equal(w[:128, 128:], q[:128, 128:].float() * 2) and torch.equal(
        w[128:, 128:], q[128:, 128:].float() * 4
    )
    part = dequantize_blocks(q[100:130, 120:200], scale, offset=(100, 120))  # a sharded reader's slice
    assert torch.equal(part, w[100:130, 120:200])

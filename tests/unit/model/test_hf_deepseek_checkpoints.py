"""DeepSeek-V3 / Kimi-K2 checkpoints as published: `model_type: kimi_k2`, YaRN under the older
`rope_scaling` key, block-scale FP8 weights with `quantization_config`; and the published configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncrl.model import ModelConfigError, from_pretrained, load_args

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configs"
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
YARN = {
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _quantize(w_OK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per 128x128 block, the last blocks partial (as DeepSeek stores 576-row weights)."""
    out_dim, K = w_OK.shape
    Ob, Kb = -(-out_dim // 128), -(-K // 128)
    blocks = F.pad(w_OK, (0, Kb * 128 - K, 0, Ob * 128 - out_dim)).view(Ob, 128, Kb, 128)
    scale_ObKb = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale_ObKb[:, None, :, None]).to(torch.float8_e4m3fn).view(Ob * 128, Kb * 128)
    return q[:out_dim, :K].contiguous(), scale_ObKb


def _dequantize(q_OK: torch.Tensor, scale_ObKb: torch.Tensor) -> torch.Tensor:
    out_dim, K = q_OK.shape
    return q_OK.float() * scale_ObKb.repeat_interleave(128, 0)[:out_dim].repeat_interleave(128, 1)[:, :K]


def _rewrite_kimi_style(path: Path, dequantized_copy: Path) -> dict[str, torch.Tensor]:
    """A saved transformers checkpoint rewritten as Moonshot publishes Kimi-K2, and a copy of it
    dequantised for transformers (which dequantises FP8 on GPUs only); returns the FP8 weights'
    dequantised values."""
    shutil.copytree(path, dequantized_copy)
    state = load_file(path / "model.safetensors")
    fp8, dequantized = dict(state), {}
    for name in [n for n in state if n.endswith(("_proj.weight", "_proj_with_mqa.weight"))]:
        q, scale = _quantize(state[name])
        fp8[name], fp8[f"{name}_scale_inv"] = q, scale
        dequantized[name] = _dequantize(q, scale)
    save_file(fp8, path / "model.safetensors", metadata={"format": "pt"})
    save_file(state | dequantized, dequantized_copy / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg |= {"model_type": "kimi_k2", "rope_theta": 5000.0, "rope_scaling": {"type": "yarn", **YARN}}
    (path / "config.json").write_text(json.dumps(cfg | {"quantization_config": FP8_CONFIG}))
    return dequantized


def test_kimi_style_fp8_yarn_checkpoint_gives_transformers_logits_on_the_dequantised_weights(
    family_checkpoint, tmp_path
):
    path, hf = family_checkpoint(
        "deepseek_v3",
        seed=6,
        intermediate_size=160,  # the dense MLP spans two blocks
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, **YARN},
    )
    dequantized = _rewrite_kimi_style(path, tmp_path / "dequantized")
    ours = from_pretrained(path)
    assert ours.args.model_type == "deepseek_v3" and ours.args.rope_scaling.factor == 8.0
    gate = "model.layers.0.mlp.gate_proj.weight"
    assert torch.equal(ours.state_dict()[gate], dequantized[gate])
    assert not torch.equal(dequantized[gate], hf.state_dict()[gate])  # FP8 rounding is there to see
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", attn_implementation="eager")
    assert ref_model.config.rope_parameters["rope_type"] == "yarn"
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(200, 223).expand_as(ids)  # beyond the original 64 positions
    with torch.no_grad():
        ref, got = ref_model.eval()(ids, position_ids=pos).logits, ours(ids, position_ids=pos).logits
    assert ref.abs().max() > 0.1
    assert (got - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["deepseek-v3.json", "kimi-k2.json"])
def test_published_configs_load(tmp_path, name):
    shutil.copy(DOCS / name, tmp_path / "config.json")
    args = load_args(tmp_path)
    assert args.model_type == "deepseek_v3" and args.uses_mla and args.rope_scaling.mscale_all_dim == 1.0
    assert args.extra["quantization_config"]["weight_block_size"] == [128, 128]


def test_an_alias_needs_its_architecture_and_other_quantizations_are_named(tmp_path):
    cfg = json.loads((DOCS / "kimi-k2.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"architectures": ["KimiForCausalLM"]}))
    with pytest.raises(ModelConfigError, match="'kimi_k2' is read as deepseek_v3 only with architectures"):
        load_args(tmp_path)
    for quantization in ({"quant_method": "awq"}, FP8_CONFIG | {"weight_block_size": [64, 64]}):
        (tmp_path / "config.json").write_text(json.dumps(cfg | {"quantization_config": quantization}))
        with pytest.raises(ModelConfigError, match="only block-scale FP8 checkpoints are read"):
            load_args(tmp_path)

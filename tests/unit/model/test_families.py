"""DeepSeek-V3 / Kimi-K2, GLM-4.5 and GLM-5 against transformers 5.x: fp32 logit parity with every
feature on, checkpoint round trips (transformers loads what we write), and MTP layers kept."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncrl.model import from_pretrained, load_args, save_pretrained
from asyncrl.model.hf import HFReader

TOL = 1e-4

_FULL_ROPE = {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 1.0}
_GLM4_PLAIN = {
    "use_qk_norm": False,
    "attention_bias": False,
    "n_group": 2,
    "topk_group": 1,
    "rope_parameters": _FULL_ROPE,
}
CONFIGS = {
    "dsv3-all-features": ("deepseek_v3", {}),
    "dsv3-no-q-lora-half-split-rope": ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False}),
    "dsv3-one-group-no-norm": ("deepseek_v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
    "dsv3-two-dense-tied": ("deepseek_v3", {"first_k_dense_replace": 2, "tie_word_embeddings": True}),
    "glm4moe-all-features": ("glm4_moe", {}),
    "glm4moe-no-qk-norm-full-rope": ("glm4_moe", _GLM4_PLAIN),
    "glm5-all-features": ("glm_moe_dsa", {}),
    "glm5-shared-indexer": ("glm_moe_dsa", {"indexer_types": ["full", "shared", "full"], "index_topk": 4}),
}


def _ids(vocab: int, shape=(2, 23), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(family_checkpoint, name):
    model_type, overrides = CONFIGS[name]
    path, hf = family_checkpoint(model_type, seed=len(name), **overrides)
    ours = from_pretrained(path)
    assert ours.args.model_type == model_type
    ids = _ids(hf.config.vocab_size)  # 23 tokens: longer than index_topk (6) for GLM-5
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids).logits
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"{name}: max |logit diff| {diff:.2e} > {TOL}"
    assert ref.abs().max() > 0.1


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "glm_moe_dsa"])
def test_ours_save_transformers_load_same_logits(family_checkpoint, tmp_path, model_type):
    path, _ = family_checkpoint(model_type, seed=3)
    ours = from_pretrained(path)
    out = tmp_path / "resaved"
    save_pretrained(ours, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["n_routed_experts"] == 8
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, ours.layers[1].mlp.gate.e_score_correction_bias) and bias.abs().sum() > 0
    ids = _ids(ours.args.vocab_size, seed=4)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() <= TOL
        assert torch.equal(from_pretrained(out)(ids).logits, ours(ids).logits)


def test_config_keys_round_trip(family_checkpoint, tmp_path):
    path, _ = family_checkpoint("glm_moe_dsa", indexer_types=["full", "shared", "full"])
    src = json.loads((path / "config.json").read_text())
    save_pretrained(from_pretrained(path), tmp_path / "out")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in (
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "index_topk",
        "index_n_heads",
        "index_head_dim",
        "indexer_types",
        "n_shared_experts",
        "mlp_layer_types",
    ):
        assert out[key] == src[key], key


def test_mtp_layers_are_kept_and_written_back(family_checkpoint, tmp_path):
    """A checkpoint's MTP layer (model.layers.{num_hidden_layers}.*) survives load + save bit for bit."""
    path, hf = family_checkpoint("deepseek_v3", seed=5)
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    gen = torch.Generator().manual_seed(0)
    mtp = {
        "model.layers.3.eh_proj.weight": torch.randn(64, 128, generator=gen),
        "model.layers.3.enorm.weight": torch.randn(64, generator=gen),
        "model.layers.3.mlp.experts.0.gate_proj.weight": torch.randn(32, 64, generator=gen),
        "model.layers.3.shared_head.head.weight": torch.randn(97, 64, generator=gen),
    }
    save_file(tensors | mtp, shard, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))

    ours = from_pretrained(path)
    ids = _ids(97, seed=6)
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() <= TOL  # MTP tensors are not run
    save_pretrained(ours, tmp_path / "out", max_shard_bytes=32 * 1024)
    written: dict[str, torch.Tensor] = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        written |= load_file(f)
    for key, t in mtp.items():
        assert torch.equal(written[key], t), key
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again = from_pretrained(tmp_path / "out")
    assert torch.equal(
        again.mtp.get_buffer("model:layers:3:eh_proj:weight"), mtp["model.layers.3.eh_proj.weight"]
    )


def test_dsa_selection_changes_the_result(family_checkpoint):
    """Guards the parity test above: with 23 tokens and index_topk 6, sparse != dense attention."""
    path, _ = family_checkpoint("glm_moe_dsa", seed=7)
    ours = from_pretrained(path)
    ids = _ids(97, seed=8)
    with torch.no_grad():
        sparse = ours(ids).logits
        for layer in ours.layers:
            layer.self_attn.index_topk = 1000
        dense = ours(ids).logits
    assert (sparse - dense).abs().max() > 1e-3
    assert (sparse[:, :6] - dense[:, :6]).abs().max() <= 1e-5  # the first 6 queries see <= 6 keys anyway


def test_mtp_shapes_come_from_the_headers(family_checkpoint):
    """A sharded trainer builds its MTP placeholders from these (asyncrl.model.hf.build_meta_model)."""
    path, _ = family_checkpoint("deepseek_v3", seed=9)
    args = load_args(path)
    with HFReader(path, args) as reader:
        assert reader.mtp_shapes() == {}
    shard = path / "model.safetensors"
    save_file(
        load_file(shard) | {"model.layers.3.enorm.weight": torch.ones(64)}, shard, metadata={"format": "pt"}
    )
    with HFReader(path, args) as reader:
        assert reader.mtp_shapes() == {"model.layers.3.enorm.weight": (64,)}
        assert reader.bytes_read == 0

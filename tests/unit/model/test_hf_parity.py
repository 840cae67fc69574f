"""Logit parity with transformers' Qwen3 / Qwen3-MoE in fp32, and checkpoint round trips."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.model import from_pretrained, save_pretrained

TOL = 1e-4

CONFIGS = {
    "moe-gqa2": ("qwen3_moe", {}),
    "moe-mha-norm-topk": ("qwen3_moe", {"num_key_value_heads": 4, "norm_topk_prob": True}),
    "moe-gqa4-dense-layer": ("qwen3_moe", {"num_key_value_heads": 1, "mlp_only_layers": [1]}),
    "moe-sparse-step2-top3": ("qwen3_moe", {"decoder_sparse_step": 2, "num_experts_per_tok": 3}),
    "moe-tied-bias": ("qwen3_moe", {"tie_word_embeddings": True, "attention_bias": True}),
    "dense": ("qwen3", {}),
    "dense-tied-mha": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
}


def _ids(vocab: int, shape=(2, 23), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(hf_checkpoint, name):
    model_type, overrides = CONFIGS[name]
    path, hf = hf_checkpoint(model_type, seed=len(name), **overrides)
    ours = from_pretrained(path)
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"{name}: max |logit diff| {diff:.2e} > {TOL}"
    # The test is only meaningful if logits are not trivially small.
    assert ref.abs().max() > 0.1


def test_layer_types_follow_qwen3_moe_rules(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6)
    ours = from_pretrained(path)
    assert [layer.is_moe for layer in ours.layers] == [False, True, False, False, False, True]


def test_ours_save_transformers_load_same_logits(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("qwen3_moe", norm_topk_prob=True, mlp_only_layers=[0])
    ours = from_pretrained(path)
    out = tmp_path / "resaved"
    save_pretrained(ours, out)
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = _ids(ours.args.vocab_size, seed=3)
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids).logits).abs().max().item()
    assert diff <= TOL
    # and back again: our second load equals our first, bit for bit
    again = from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours(ids).logits)


def test_sharded_save_round_trips(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("qwen3_moe")
    ours = from_pretrained(path)
    out = tmp_path / "sharded"
    save_pretrained(ours, out, max_shard_bytes=64 * 1024)
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = _ids(ours.args.vocab_size, seed=4)
    with torch.no_grad():
        assert (hf(ids).logits - from_pretrained(out)(ids).logits).abs().max() <= TOL


def test_bf16_load_is_close_to_fp32(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3_moe")
    ids = _ids(97, seed=5)
    with torch.no_grad():
        ref = from_pretrained(path)(ids).logits
        bf = from_pretrained(path, dtype=torch.bfloat16)(ids).logits
    assert bf.dtype == torch.bfloat16
    assert (bf.float() - ref).abs().max() < 0.1 * ref.abs().max()

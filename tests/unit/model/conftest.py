"""Helpers for model tests: random transformers checkpoints written to a temp directory."""

from __future__ import annotations

import pytest
import torch


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.05) -> None:
    """Fill every parameter with N(0, std) (norm weights around 1) so that differences show up."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1.0 + noise if "norm" in name else noise * (10 if "gate.weight" in name else 1))


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: build a random transformers Qwen3 / Qwen3-MoE model, save it, return (dir, hf_model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    def make(model_type: str, seed: int = 0, **overrides):
        base = dict(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
            max_position_embeddings=512, tie_word_embeddings=False,
        )  # fmt: skip
        if model_type == "qwen3_moe":
            base |= dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
            cfg_cls, model_cls = Qwen3MoeConfig, Qwen3MoeForCausalLM
        else:
            cfg_cls, model_cls = Qwen3Config, Qwen3ForCausalLM
        cfg = cfg_cls(**(base | overrides))
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = model_cls(cfg).eval()
        randomize_(model, seed)
        path = tmp_path / f"{model_type}-{seed}"
        model.save_pretrained(path)
        return path, model

    return make

"""Named architectures for models trained from scratch here (`asyncrl init-model --preset NAME`)."""

from __future__ import annotations

from asyncrl.model.args import ModelArgs
from asyncrl.model.tokenizer import SPECIAL_TOKENS

__all__ = ["PRESETS", "preset_args"]

_VOCAB = 256 + len(SPECIAL_TOKENS)
_IDS = {"bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 259}

PRESETS: dict[str, ModelArgs] = {
    # ~1.8M parameters (~0.6M active): 4 MoE layers of 8 experts, top-2.
    "tiny-moe": ModelArgs(
        model_type="qwen3_moe", vocab_size=_VOCAB, hidden_size=128, intermediate_size=384,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
        max_position_embeddings=4096, rope_theta=10000.0, **_IDS,
    ),
    # ~1.1M parameters, dense.
    "tiny-dense": ModelArgs(
        model_type="qwen3", vocab_size=_VOCAB, hidden_size=128, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, rope_theta=10000.0, **_IDS,
    ),
    # ~50M parameters (~13M active): 8 MoE layers of 8 experts, top-2.
    "moe-50m": ModelArgs(
        model_type="qwen3_moe", vocab_size=_VOCAB, hidden_size=512, intermediate_size=1536,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=448, norm_topk_prob=True,
        max_position_embeddings=8192, rope_theta=100000.0, **_IDS,
    ),
}  # fmt: skip


def preset_args(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ValueError(f"unknown preset '{name}'; choose from {', '.join(PRESETS)}")
    return PRESETS[name]

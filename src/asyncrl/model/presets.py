"""Named architectures for models trained from scratch here (`asyncrl init-model --preset NAME`)."""

from __future__ import annotations

from dataclasses import replace

from asyncrl.model.args import ModelArgs
from asyncrl.model.tokenizer import SPECIAL_TOKENS

__all__ = ["PRESETS", "preset_args"]

_VOCAB = 256 + len(SPECIAL_TOKENS)
_IDS = {"bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 259}

PRESETS: dict[str, ModelArgs] = {
    # ~1.8M parameters (~0.6M active): 4 MoE layers of 8 experts, top-2.
    "tiny-moe": ModelArgs(
        model_type="qwen3_moe",
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        **_IDS,
    ),
    # ~1.1M parameters, dense.
    "tiny-dense": ModelArgs(
        model_type="qwen3",
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        **_IDS,
    ),
    # ~50M parameters (~13M active): 8 MoE layers of 8 experts, top-2.
    "moe-50m": ModelArgs(
        model_type="qwen3_moe",
        vocab_size=_VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=448,
        norm_topk_prob=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        **_IDS,
    ),
    # Qwen3-MoE-shaped, ~0.49B parameters (~0.09B active): 12 MoE layers of 16 experts, top-2, for
    # end-to-end weight-transfer benchmarks on CPU (vLLM's CPU build serves it; glm5-350m's sparse
    # attention it cannot).
    "moe-500m": ModelArgs(
        model_type="qwen3_moe",
        vocab_size=_VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        **_IDS,
    ),
    # DeepSeek-V3 / Kimi-K2 family: MLA (latent 64 + rope 16), 8 experts in 4 groups (2 kept), top-2,
    # one shared expert, the first layer dense.
    "tiny-dsv3": ModelArgs(
        model_type="deepseek_v3",
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_interleave=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        **_IDS,
    ),
    # GLM-5 family: tiny-dsv3's MLA + MoE plus a DSA lightning indexer (8 heads x 32, top-64 keys),
    # and one MTP layer (init-model writes it).
    "tiny-glm5": ModelArgs(
        model_type="glm_moe_dsa",
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_interleave=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        index_topk=64,
        index_n_heads=8,
        index_head_dim=32,
        indexer_types=("full",) * 4,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        **_IDS,
        extra={"num_nextn_predict_layers": 1},
    ),
    # GLM-5-shaped, ~0.33B parameters (~0.12B active) plus a ~29M MTP layer, for scale-out
    # benchmarks on CPU: MLA, DSA indexer, 16 experts top-4 with the grouped sigmoid router, one
    # shared expert, the first layer dense.
    "glm5-350m": ModelArgs(
        model_type="glm_moe_dsa",
        vocab_size=_VOCAB,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        rope_interleave=True,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        norm_topk_prob=True,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        index_topk=256,
        index_n_heads=8,
        index_head_dim=64,
        indexer_types=("full",) * 12,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        **_IDS,
        extra={"num_nextn_predict_layers": 1},
    ),
    # GLM-4.5 family: GQA with half-width RoPE and QK-norm, the sigmoid router, one shared expert.
    "tiny-glm4moe": ModelArgs(
        model_type="glm4_moe",
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        **_IDS,
    ),
}

# tiny-glm5 for the 32k-token loop (examples/long_context/): the same layers, a 32k context, and
# top-512 keys: the share of the context (1.6%) that GLM-5's top-2048 is of its 131k.
PRESETS["tiny-glm5-32k"] = replace(PRESETS["tiny-glm5"], index_topk=512, max_position_embeddings=32768)


def preset_args(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ValueError(f"unknown preset '{name}'; choose from {', '.join(PRESETS)}")
    return PRESETS[name]

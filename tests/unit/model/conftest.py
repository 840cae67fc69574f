"""Helpers for model tests: random transformers checkpoints in a temp directory; a count of host reads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.05) -> None:
    """Fill every parameter with N(0, std) (norm weights around 1) so that differences show up."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1.0 + noise if "norm" in name else noise * (10 if "gate.weight" in name else 1))


class _HostReads(TorchDispatchMode):
    """Counts the tensor -> Python scalar reads (`int(t)`, `t.item()`) inside it: each syncs a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def count_host_reads(fn: Callable[[], object]) -> int:
    """How many tensor values `fn()` reads back to Python (each one a device sync on a GPU)."""
    with torch.no_grad(), _HostReads() as reads:
        fn()
    return reads.count


@pytest.fixture
def host_reads():
    """`host_reads(fn)`: how many tensor values `fn()` reads back to Python."""
    return count_host_reads


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: build a random transformers Qwen3 / Qwen3-MoE model, save it, return (dir, hf_model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    def make(model_type: str, seed: int = 0, **overrides):
        base = dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_theta=5000.0,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
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


# Tiny configs with every feature of a family switched on: several expert groups, a dense first
# layer, shared experts, a scaling factor, low-rank q, interleaved RoPE, QK-norm, a short index_topk.
# 16 index heads: an exact tie of index scores (every relu term zero) then has odds ~2^-16, and
# ties are where transformers' topk and our position-ordered rule may pick different keys.
_SIGMOID_MOE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    n_shared_experts=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)
_MLA = dict(kv_lora_rank=24, q_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)
FAMILY_BASES = {
    "deepseek_v3": _SIGMOID_MOE | _MLA | dict(rope_interleave=True),
    "glm4_moe": _SIGMOID_MOE
    | dict(num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True)
    | dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}),
    "glm_moe_dsa": _SIGMOID_MOE | _MLA | dict(index_topk=6, index_n_heads=16, index_head_dim=16),
}


def _family_classes(model_type: str):
    import transformers

    names = {
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
        "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    }[model_type]
    return getattr(transformers, names[0]), getattr(transformers, names[1])


def build_family(model_type: str, seed: int = 0, **overrides):
    """A random transformers model of a sigmoid-router family, with a random nonzero correction bias."""
    cfg_cls, model_cls = _family_classes(model_type)
    cfg = cfg_cls(**(FAMILY_BASES[model_type] | overrides))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
    return model


@pytest.fixture
def family_checkpoint(tmp_path):
    """Factory: (dir, hf_model) for deepseek_v3 / glm4_moe / glm_moe_dsa tiny random checkpoints."""

    def make(model_type: str, seed: int = 0, **overrides):
        model = build_family(model_type, seed, **overrides)
        path = tmp_path / f"{model_type}-{seed}-{len(overrides)}"
        model.save_pretrained(path)
        return path, model

    return make

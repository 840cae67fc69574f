"""Architecture hyper-parameters, parsed from (and written back to) a Hugging Face config.json.

Only what the transformer needs is typed here; every other key of the original config is kept
verbatim in `extra` so that a load/save round trip does not lose information.

Families (HF `model_type`):
- qwen3, qwen3_moe: GQA with q/k norm; softmax top-k router.
- glm4_moe (GLM-4.5/4.6): GQA with partial rotary and optional q/k norm; sigmoid router with a
  score-correction bias and grouped top-k, shared experts, the first layers dense.
- deepseek_v3 (DeepSeek-V3, Kimi-K2): Multi-head Latent Attention (MLA) + the same MoE. Kimi-K2's
  config says `model_type: kimi_k2` with the DeepseekV3ForCausalLM architecture; it is read as
  deepseek_v3 (the same layout) and written back as deepseek_v3, which transformers loads.
- glm_moe_dsa (GLM-5): MLA + DeepSeek Sparse Attention (a lightning indexer) + the same MoE.

RoPE is plain or YaRN-scaled (`rope_type: yarn`, in `rope_parameters` or the older `rope_scaling`
key, as DeepSeek-V3 and Kimi-K2 ship it) for every family; `asyncrl.model.rope` has the maths.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from asyncrl.fp8_options import BLOCK

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArgs", "ModelConfigError", "YarnScaling", "load_args"]

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "glm_moe_dsa")
_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
MLA_TYPES = ("deepseek_v3", "glm_moe_dsa")
SIGMOID_ROUTER_TYPES = ("glm4_moe", "deepseek_v3", "glm_moe_dsa")
MOE_TYPES = ("qwen3_moe", *SIGMOID_ROUTER_TYPES)
# Other names of a supported layout: model_type -> (ours, the architecture the config must name)
_ALIASES = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}
ROPE_TYPES = ("default", "yarn")


class ModelConfigError(ValueError):
    """config.json is missing, malformed, or describes something this implementation doesn't run."""


@dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN RoPE scaling, with transformers' keys and defaults.

    Example (DeepSeek-V3)::

        YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                    mscale=1.0, mscale_all_dim=1.0)

    `attention_factor` (None: derived from factor, mscale and mscale_all_dim) multiplies cos and sin;
    MLA families also multiply the softmax scale by mscale(factor, mscale_all_dim)^2.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True  # round the ramp's ends outwards to whole dims

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ModelConfigError(
                f"config.json: YaRN 'factor' must be >= 1 (new context / original context), got {self.factor}"
            )
        if self.original_max_position_embeddings <= 0 or min(self.beta_fast, self.beta_slow) <= 0:
            raise ModelConfigError(
                "config.json: YaRN 'original_max_position_embeddings', 'beta_fast' and 'beta_slow' must be "
                f"positive, got {self.original_max_position_embeddings}, {self.beta_fast}, {self.beta_slow}"
            )

    def to_hf(self) -> dict[str, Any]:
        """The `rope_parameters` keys (besides rope_type and rope_theta); unset optional ones left out."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Hyper-parameters of a decoder of one of the supported families.

    Example::

        ModelArgs(model_type="qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)

    For MLA families `head_dim` is the rotary width (= qk_rope_head_dim), as in transformers.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None  # None: plain RoPE
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_qk_norm: bool = True  # per-head RMSNorm on q and k (always on for qwen3; optional for glm4_moe)
    partial_rotary_factor: float = 1.0  # fraction of head_dim that RoPE rotates (glm4_moe: 0.5)
    # MoE (ignored for model_type "qwen3")
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # sigmoid router with correction bias and grouped top-k (glm4_moe, deepseek_v3, glm_moe_dsa)
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    # Multi-head Latent Attention (deepseek_v3, glm_moe_dsa)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek Sparse Attention indexer (glm_moe_dsa); indexer_types[i] is "full" or "shared"
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # -- derived -------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_TYPES and self.num_experts > 0

    @property
    def uses_mla(self) -> bool:
        return self.model_type in MLA_TYPES

    @property
    def uses_dsa(self) -> bool:
        return self.model_type == "glm_moe_dsa"

    @property
    def sigmoid_router(self) -> bool:
        return self.model_type in SIGMOID_ROUTER_TYPES

    @property
    def rope_dim(self) -> int:
        """How many dims of each q/k head RoPE rotates."""
        if self.uses_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.uses_mla else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE: sparse every `decoder_sparse_step` layers except `mlp_only_layers`; the
        sigmoid-router families: every layer from `first_k_dense_replace` on."""
        if not self.is_moe:
            return False
        if self.sigmoid_router:
            return layer_idx >= self.first_k_dense_replace
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def routing_top_k(self) -> int:
        """Width of the routed_experts tensor: top_k for MoE models, 1 for dense ones."""
        return self.num_experts_per_tok if self.is_moe else 1

    def num_params(self, active: bool = False) -> int:
        """Parameter count (or the count active per token, for MoE) computed from the shapes."""
        d = self.hidden_size
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for i in range(self.num_hidden_layers):
            total += self.attention_params() + 2 * d
            if self.is_moe_layer(i):
                n = self.num_experts_per_tok if active else self.num_experts
                total += (
                    d * self.num_experts + (n + self.n_shared_experts) * 3 * d * self.moe_intermediate_size
                )
                total += self.num_experts if self.sigmoid_router else 0  # correction bias
            else:
                total += 3 * d * self.intermediate_size
        return total

    def attention_params(self) -> int:
        """Parameters of one layer's attention block (with the DSA indexer, for GLM-5)."""
        d, h = self.hidden_size, self.num_attention_heads
        if not self.uses_mla:
            g, hd = self.num_key_value_heads, self.head_dim
            norms = 2 * hd if self.use_qk_norm else 0
            o_bias = 0 if self.model_type == "glm4_moe" else d  # GLM-4.5 biases q/k/v only
            bias = hd * (h + 2 * g) + o_bias if self.attention_bias else 0
            return d * hd * (2 * h + 2 * g) + norms + bias
        qk, r, rr = self.qk_head_dim, self.kv_lora_rank, self.qk_rope_head_dim
        q = d * h * qk if self.q_lora_rank is None else d * self.q_lora_rank + self.q_lora_rank * (1 + h * qk)
        kv = d * (r + rr) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + h * self.v_head_dim * d
        if self.uses_dsa:  # indexer: wq_b, wk, k_norm (LayerNorm), weights_proj
            ih, idim = self.index_n_heads, self.index_head_dim
            attn += (self.q_lora_rank or 0) * ih * idim + d * idim + 2 * idim + d * ih
        return attn

    # -- validation ----------------------------------------------------------------------------
    def _validate(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type '{self.model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        positive = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config.json: '{name}' must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_dim % 2 or self.rope_dim <= 0:
            raise ModelConfigError(
                f"config.json: the rotary width must be even and positive, got {self.rope_dim}"
            )
        if self.model_type in MOE_TYPES:
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelConfigError(
                    f"config.json: need 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                    f"num_experts ({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ModelConfigError(
                    "config.json: moe_intermediate_size and decoder_sparse_step must be positive"
                )
        if self.sigmoid_router:
            self._validate_grouped_router()
        if self.uses_mla:
            self._validate_mla()
        if (
            any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
            and self.intermediate_size <= 0
        ):
            raise ModelConfigError("config.json: 'intermediate_size' must be positive when a layer is dense")

    def _validate_grouped_router(self) -> None:
        E, n, g = self.num_experts, self.n_group, self.topk_group
        if n <= 0 or E % n or not 0 < g <= n:
            raise ModelConfigError(
                f"config.json: need n_group ({n}) dividing n_routed_experts ({E}) and 0 < topk_group ({g}) "
                "<= n_group"
            )
        if n > 1 and E // n < 2:
            raise ModelConfigError(
                "config.json: grouped top-k scores each group by its top 2 experts; need >= 2 per group"
            )
        if self.num_experts_per_tok > g * (E // n):
            raise ModelConfigError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                f"topk_group ({g}) groups of {E // n}"
            )

    def _validate_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config.json: '{name}' must be positive, got {getattr(self, name)}")
        if self.head_dim != self.qk_rope_head_dim:
            raise ModelConfigError("MLA: head_dim must equal qk_rope_head_dim (the rotary width)")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ModelConfigError("MLA: num_key_value_heads must equal num_attention_heads")
        if self.attention_bias:
            raise ModelConfigError("MLA: attention_bias=true is not supported")
        if self.uses_dsa:
            if self.q_lora_rank is None:
                raise ModelConfigError("glm_moe_dsa: the indexer needs q_lora_rank")
            if min(self.index_topk, self.index_n_heads, self.index_head_dim) <= 0:
                raise ModelConfigError(
                    "glm_moe_dsa: index_topk, index_n_heads and index_head_dim must be positive"
                )
            if self.index_head_dim < self.qk_rope_head_dim:
                raise ModelConfigError("glm_moe_dsa: index_head_dim must be >= qk_rope_head_dim")
            types = self.indexer_types
            if len(types) != self.num_hidden_layers or set(types) - {"full", "shared"} or types[0] != "full":
                raise ModelConfigError(
                    "glm_moe_dsa: indexer_types must list 'full'/'shared' per layer, starting with 'full'; "
                    f"got {types}"
                )

    # -- HF conversion -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        model_type = _model_type(cfg)
        _reject_unsupported_features(cfg)
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ModelConfigError(f"config.json ({model_type}) is missing required key '{key}'")
        heads = cfg["num_attention_heads"]
        rope = _rope_parameters(cfg)
        kwargs: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": cfg["vocab_size"],
            "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg.get("intermediate_size", 0),
            "num_hidden_layers": cfg["num_hidden_layers"],
            "num_attention_heads": heads,
            "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            "rope_scaling": _yarn_scaling(cfg, rope) if _rope_type(rope) == "yarn" else None,
            "max_position_embeddings": cfg.get("max_position_embeddings", 32768),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
            "attention_bias": cfg.get("attention_bias", False),
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_id": cfg.get("eos_token_id"),
            "pad_token_id": cfg.get("pad_token_id"),
        }
        if model_type == "qwen3_moe":
            kwargs |= {
                "num_experts": cfg.get("num_experts", cfg.get("num_local_experts", 0)),
                "num_experts_per_tok": cfg.get("num_experts_per_tok", 0),
                "moe_intermediate_size": cfg.get("moe_intermediate_size", 0),
                "norm_topk_prob": cfg.get("norm_topk_prob", False),
                "decoder_sparse_step": cfg.get("decoder_sparse_step", 1),
                "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()),
            }
        if model_type in SIGMOID_ROUTER_TYPES:
            kwargs |= _grouped_router_kwargs(cfg)
        if model_type == "glm4_moe":
            kwargs |= {
                "use_qk_norm": cfg.get("use_qk_norm", False),
                "partial_rotary_factor": rope.get(
                    "partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)
                ),
            }
        if model_type in MLA_TYPES:
            kwargs |= _mla_kwargs(cfg, model_type)
        typed = {f.name for f in fields(cls)} | _CONSUMED_KEYS
        kwargs["extra"] = {k: v for k, v in cfg.items() if k not in typed}
        return cls(**kwargs)

    def to_hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        cfg: dict[str, Any] = dict(self.extra)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "yarn", "rope_theta": self.rope_theta} | self.rope_scaling.to_hf()
        cfg |= {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype,
        }
        if self.model_type == "qwen3_moe":
            cfg |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
            }
        if self.sigmoid_router:
            cfg |= {
                "n_routed_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "n_shared_experts": self.n_shared_experts,
                "n_group": self.n_group,
                "topk_group": self.topk_group,
                "routed_scaling_factor": self.routed_scaling_factor,
                "first_k_dense_replace": self.first_k_dense_replace,
            }
        if self.model_type == "glm4_moe":
            cfg |= {"use_qk_norm": self.use_qk_norm, "partial_rotary_factor": self.partial_rotary_factor}
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        if self.uses_mla:
            cfg |= {
                "q_lora_rank": self.q_lora_rank,
                "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim,
                "rope_interleave": self.rope_interleave,
            }
        if self.uses_dsa:
            cfg |= {
                "index_topk": self.index_topk,
                "index_n_heads": self.index_n_heads,
                "index_head_dim": self.index_head_dim,
                "indexer_types": list(self.indexer_types),
                "mlp_layer_types": [
                    "sparse" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)
                ],
            }
        return cfg


# Keys read into typed fields under another name, or recomputed on save (not kept in `extra`).
_CONSUMED_KEYS = {
    "rope_parameters",
    "rope_scaling",
    "original_max_position_embeddings",
    "num_local_experts",
    "n_routed_experts",
    "mlp_layer_types",
    "index_topk_pattern",
    "index_topk_freq",
    "index_skip_topk_offset",
}


def _grouped_router_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_experts": cfg.get("n_routed_experts", cfg.get("num_local_experts", 0)),
        "num_experts_per_tok": cfg.get("num_experts_per_tok", 0),
        "moe_intermediate_size": cfg.get("moe_intermediate_size", 0),
        "norm_topk_prob": cfg.get("norm_topk_prob", True),
        "n_shared_experts": cfg.get("n_shared_experts") or 0,
        "n_group": cfg.get("n_group") or 1,
        "topk_group": cfg.get("topk_group") or 1,
        "routed_scaling_factor": cfg.get("routed_scaling_factor", 1.0),
        "first_k_dense_replace": cfg.get("first_k_dense_replace") or 0,
    }


def _mla_kwargs(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if key not in cfg:
            raise ModelConfigError(f"config.json ({model_type}) is missing required key '{key}'")
    out = {
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_nope_head_dim": cfg["qk_nope_head_dim"],
        "qk_rope_head_dim": cfg["qk_rope_head_dim"],
        "v_head_dim": cfg["v_head_dim"],
        "head_dim": cfg["qk_rope_head_dim"],  # transformers' convention: head_dim is the rotary width
        "num_key_value_heads": cfg["num_attention_heads"],  # MLA expands the latent to every head
        "rope_interleave": cfg.get("rope_interleave", model_type == "deepseek_v3"),
    }
    if model_type == "glm_moe_dsa":
        n = cfg["num_hidden_layers"]
        out |= {
            "rope_interleave": True,  # GLM-5 always applies interleaved RoPE (transformers ignores the key)
            "index_topk": cfg.get("index_topk", 2048),
            "index_n_heads": cfg.get("index_n_heads", 32),
            "index_head_dim": cfg.get("index_head_dim", 128),
            "indexer_types": tuple(_indexer_types(cfg, n)),
        }
        dense = min(cfg.get("first_k_dense_replace", 3), n)
        out["first_k_dense_replace"] = dense
        want = ["dense"] * dense + ["sparse"] * (n - dense)
        if cfg.get("mlp_layer_types") not in (None, want):
            raise ModelConfigError(
                f"glm_moe_dsa: mlp_layer_types {cfg['mlp_layer_types']} is not 'first_k_dense_replace dense, "
                "then sparse'; other patterns are not supported"
            )
    return out


def _indexer_types(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """transformers' rule: explicit `indexer_types`, else `index_topk_pattern`, else freq/offset."""
    if cfg.get("indexer_types") is not None:
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return (
            [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        )
    freq = max(cfg.get("index_topk_freq", 1), 1)
    offset = cfg.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _reject_unsupported_features(cfg: dict[str, Any]) -> None:
    """Fail loudly on settings that would silently change the maths if ignored."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(
            f"config.json: hidden_act '{cfg['hidden_act']}' is not supported (only 'silu')"
        )
    if cfg.get("use_sliding_window"):
        raise ModelConfigError("config.json: use_sliding_window=true is not supported")
    rope_type = _rope_type(_rope_parameters(cfg))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(
            f"config.json: RoPE scaling '{rope_type}' is not supported; supported rope types: "
            f"{', '.join(ROPE_TYPES)}"
        )
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ModelConfigError("config.json: only the sigmoid 'noaux_tc' router (DeepSeek-V3) is supported")


def _model_type(cfg: dict[str, Any]) -> str:
    """Our family of a config: its model_type, or the layout an alias with the right architecture names."""
    supported = ", ".join((*SUPPORTED_MODEL_TYPES, *_ALIASES))
    if "model_type" not in cfg:
        raise ModelConfigError(f"config.json has no 'model_type'; supported: {supported}")
    name = cfg["model_type"]
    if name in _ALIASES:
        ours, architecture = _ALIASES[name]
        if architecture not in (cfg.get("architectures") or []):
            raise ModelConfigError(
                f"config.json: model_type '{name}' is read as {ours} only with architectures "
                f"['{architecture}'], got {cfg.get('architectures')}"
            )
        return ours
    if name not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(f"unsupported model_type '{name}'; supported: {supported}")
    return name


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' rule: the older `rope_scaling` key, when set, replaces `rope_parameters`."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelConfigError(f"config.json: RoPE parameters must be an object, got {rope!r}")
    return rope


def _rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _yarn_scaling(cfg: dict[str, Any], rope: dict[str, Any]) -> YarnScaling:
    """transformers' reading: a top-level original_max_position_embeddings wins over the rope dict's,
    which defaults to max_position_embeddings; a missing factor is their ratio; betas default 32 / 1."""
    max_positions = cfg.get("max_position_embeddings", 32768)
    original = cfg.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings", max_positions
    )
    factor = rope.get("factor")
    return YarnScaling(
        factor=float(max_positions / original if factor is None else factor),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
        truncate=rope.get("truncate", True),
    )


def load_args(path: str | os.PathLike) -> ModelArgs:
    """Parse `path/config.json` into ModelArgs, with errors that name the directory and the key."""
    path = Path(path)
    if not path.is_dir():
        raise ModelConfigError(f"model directory not found: {path}")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelConfigError(f"{path} has no config.json (expected a Hugging Face model directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{cfg_path}: invalid JSON: {e}") from None
    try:
        _check_quantization(cfg.get("quantization_config"))
        return ModelArgs.from_hf_config(cfg)
    except (ModelConfigError, TypeError) as e:
        raise ModelConfigError(f"{cfg_path}: {e}") from None


def _check_quantization(quantization: object) -> None:
    """Of quantized checkpoints, block-scale FP8 is read (`HFReader` dequantises it); name any other."""
    if quantization is None:
        return
    if not isinstance(quantization, dict):
        raise ModelConfigError(f"quantization_config must be an object, got {quantization!r}")
    method, blocks = quantization.get("quant_method"), quantization.get("weight_block_size")
    if method != "fp8" or blocks != [BLOCK, BLOCK] or quantization.get("fmt", "e4m3") != "e4m3":
        raise ModelConfigError(
            f"quantization_config {quantization} is not supported: only block-scale FP8 checkpoints are read "
            f'(quant_method "fp8", fmt "e4m3", weight_block_size [{BLOCK}, {BLOCK}], as DeepSeek-V3 and '
            "Kimi-K2 ship); dequantise other formats to bf16 first"
        )

"""Architecture hyper-parameters, parsed from (and written back to) a Hugging Face config.json.

Only what the transformer needs is typed here; every other key of the original config is kept
verbatim in `extra` so that a load/save round trip does not lose information.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArgs", "ModelConfigError"]

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class ModelConfigError(ValueError):
    """config.json is missing, malformed, or describes something this implementation doesn't run."""


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Hyper-parameters of a Qwen3 / Qwen3-MoE decoder.

    Example::

        ModelArgs(model_type="qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
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
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE (ignored for model_type "qwen3")
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # -- derived -------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe" and self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule: sparse every `decoder_sparse_step` layers, except `mlp_only_layers`."""
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def routing_top_k(self) -> int:
        """Width of the routed_experts tensor: top_k for MoE models, 1 for dense ones."""
        return self.num_experts_per_tok if self.is_moe else 1

    def num_params(self, active: bool = False) -> int:
        """Parameter count (or the count active per token, for MoE) computed from the shapes."""
        d, h, g, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * hd * (2 * h + 2 * g) + 2 * hd + (hd * (h + 2 * g) + d if self.attention_bias else 0)
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for i in range(self.num_hidden_layers):
            total += attn + 2 * d
            if self.is_moe_layer(i):
                n = self.num_experts_per_tok if active else self.num_experts
                total += d * self.num_experts + n * 3 * d * self.moe_intermediate_size
            else:
                total += 3 * d * self.intermediate_size
        return total

    # -- validation ----------------------------------------------------------------------------
    def _validate(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type '{self.model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"]  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config.json: '{name}' must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type == "qwen3_moe":
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelConfigError(
                    f"config.json: need 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                    f"num_experts ({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ModelConfigError(
                    "config.json: moe_intermediate_size and decoder_sparse_step must be positive"
                )
        if (
            any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
            and self.intermediate_size <= 0
        ):
            raise ModelConfigError("config.json: 'intermediate_size' must be positive when a layer is dense")

    # -- HF conversion -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        if "model_type" not in cfg:
            raise ModelConfigError(
                f"config.json has no 'model_type'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        model_type = cfg["model_type"]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type '{model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _reject_unsupported_features(cfg)
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ModelConfigError(f"config.json ({model_type}) is missing required key '{key}'")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
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
        typed = {f.name for f in fields(cls)} | {"rope_parameters", "num_local_experts"}
        kwargs["extra"] = {k: v for k, v in cfg.items() if k not in typed}
        return cls(**kwargs)

    def to_hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        cfg: dict[str, Any] = dict(self.extra)
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
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
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
        return cfg


def _reject_unsupported_features(cfg: dict[str, Any]) -> None:
    """Fail loudly on settings that would silently change the maths if ignored."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(
            f"config.json: hidden_act '{cfg['hidden_act']}' is not supported (only 'silu')"
        )
    if cfg.get("use_sliding_window"):
        raise ModelConfigError("config.json: use_sliding_window=true is not supported")
    rope_type = (cfg.get("rope_parameters") or {}).get("rope_type", "default")
    scaling = cfg.get("rope_scaling")
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        raise ModelConfigError(f"config.json: RoPE scaling is not supported (got {scaling or rope_type!r})")

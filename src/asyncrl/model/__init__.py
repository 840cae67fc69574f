"""The one transformer implementation shared by the trainer and the embedded inference engine.

from asyncrl.model import from_pretrained, save_pretrained
model = from_pretrained("outputs/tiny-moe")            # Qwen3 / Qwen3-MoE, HF layout
out = model(input_ids, return_routing=True)            # .logits, .routed_experts
out = model(input_ids, routed_experts=out.routed_experts)  # router replay (R3)

The names below load their module on first use: `ModelArgs`, `ModelConfigError` and `load_args`
import without torch (the launcher checks a model directory with them before it starts anything).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "args": ("SUPPORTED_MODEL_TYPES", "ModelArgs", "ModelConfigError", "load_args"),
        "dtypes": ("DTYPES", "dtype_name", "torch_dtype"),
        "hf": ("HFCheckpointWriter", "from_pretrained", "save_pretrained", "to_hf_state_dict"),
        "layers": ("AttentionBackend", "PackedCausalAttention"),
        "presets": ("PRESETS", "preset_args"),
        "transformer": ("ModelOutput", "Transformer"),
    },
)

__all__ = [
    "DTYPES",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "AttentionBackend",
    "HFCheckpointWriter",
    "ModelArgs",
    "ModelConfigError",
    "ModelOutput",
    "PackedCausalAttention",
    "Transformer",
    "dtype_name",
    "from_pretrained",
    "load_args",
    "preset_args",
    "save_pretrained",
    "to_hf_state_dict",
    "torch_dtype",
]


if TYPE_CHECKING:  # what type checkers and editors see
    from asyncrl.model.args import SUPPORTED_MODEL_TYPES, ModelArgs, ModelConfigError, load_args
    from asyncrl.model.dtypes import DTYPES, dtype_name, torch_dtype
    from asyncrl.model.hf import HFCheckpointWriter, from_pretrained, save_pretrained, to_hf_state_dict
    from asyncrl.model.layers import AttentionBackend, PackedCausalAttention
    from asyncrl.model.presets import PRESETS, preset_args
    from asyncrl.model.transformer import ModelOutput, Transformer

"""The one transformer implementation shared by the trainer and the embedded inference engine.

from asyncrl.model import from_pretrained, save_pretrained
model = from_pretrained("outputs/tiny-moe")            # Qwen3 / Qwen3-MoE, HF layout
out = model(input_ids, return_routing=True)            # .logits, .routed_experts
out = model(input_ids, routed_experts=out.routed_experts)  # router replay (R3)
"""

from asyncrl.model.args import SUPPORTED_MODEL_TYPES, ModelArgs, ModelConfigError
from asyncrl.model.dtypes import DTYPES, dtype_name, torch_dtype
from asyncrl.model.hf import HFCheckpointWriter, from_pretrained, load_args, save_pretrained, to_hf_state_dict
from asyncrl.model.layers import AttentionBackend, PackedCausalAttention
from asyncrl.model.presets import PRESETS, preset_args
from asyncrl.model.transformer import ModelOutput, Transformer

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

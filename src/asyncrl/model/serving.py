"""The serving format: published weights in the dtype the inference servers serve, optionally block-FP8.

    fmt = serving_format(model, torch.bfloat16)                         # every tensor in bf16
    fmt = serving_format(model, torch.bfloat16, fp8=True)               # eligible linears in FP8
    for name, t in to_serving(hf_name, tensor, fmt):                    # one HF tensor -> 1 or 2
        ...

A weight in FP8 is stored as DeepSeek-V3 checkpoints and vLLM's `fp8` quantization store it:
`X.weight` in float8_e4m3fn and `X.weight_scale_inv` in float32, one scale per 128x128 block
(weight ~= weight_fp8 * weight_scale_inv, block by block), with `quantization_config` in config.json
(`quantization_config_for`) listing every other weight-holding module in `modules_to_not_convert`.
The quantization is `asyncrl.model.fp8`'s, so a server that runs FP8 re-quantizes a loaded weight
to the same blocks. Which linears are FP8 follows `plan_fp8` (the embedded engine's rule: dims
multiples of 128, not ignored), with two exceptions for vLLM's loader: the LM head stays high
precision, and linears that vLLM fuses into one layer (q/k/v, gate/up, q_a/kv_a) are FP8 only
together.

Both directions live here: `to_serving` for writers (the file publisher, a bucketed sender) and
`dequantize_blocks` for readers (`asyncrl.model.hf_reader.HFReader`, whole weights or slices).

Shape legend: O output dim, K input dim, Ob = ceil(O/128), Kb = ceil(K/128) blocks; o, k the dims
of a slice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from asyncrl.fp8_options import DEFAULT_FP8_IGNORE
from asyncrl.model.fp8 import BLOCK, FP8_DTYPE, plan_fp8, quantize_weight

__all__ = [
    "SCALE_SUFFIX",
    "ServingFormat",
    "dequantize_blocks",
    "is_fp8_scale",
    "quantization_config_for",
    "serving_format",
    "to_serving",
]

SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
_WRAPPER = "._checkpoint_wrapped_module"  # activation checkpointing's module prefix; not in HF names
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.\d+\.(?:gate_proj|up_proj|down_proj)$")
# Linears vLLM fuses into one layer: its FP8 loader needs all of a group quantized, or none.
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


@dataclass(frozen=True, kw_only=True)
class ServingFormat:
    """How published tensors are stored. Example: ServingFormat(dtype=torch.bfloat16,
    fp8_modules=frozenset({"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts"})):
    those modules' weights in FP8 with block scales (an expert stack counts as one module, as in
    vLLM), every other tensor in bfloat16."""

    dtype: torch.dtype
    fp8_modules: frozenset[str] = field(default_factory=frozenset)

    @property
    def fp8(self) -> bool:
        return bool(self.fp8_modules)


def serving_format(
    model: nn.Module, dtype: torch.dtype, *, fp8: bool = False, ignore: Sequence[str] = DEFAULT_FP8_IGNORE
) -> ServingFormat:
    """The format of `model`'s published weights: `dtype`, plus FP8 linears when `fp8`."""
    if not fp8:
        return ServingFormat(dtype=dtype)
    report = plan_fp8(model, ignore)
    linears = {_hf_module(n) for n in (*report.converted, *report.kept)}
    chosen = {_hf_module(n) for n in report.converted} - {"lm_head"}
    return ServingFormat(dtype=dtype, fp8_modules=frozenset(_whole_fused_groups(chosen, linears)))


def _hf_module(name: str) -> str:
    return name.replace(_WRAPPER, "")


def _whole_fused_groups(chosen: set[str], linears: set[str]) -> set[str]:
    """`chosen` less every fused group (siblings under one parent) that is only partly chosen."""
    out = set(chosen)
    for name in chosen:
        parent, _, leaf = name.rpartition(".")
        for group in _FUSED_GROUPS:
            members = {f"{parent}.{m}" for m in group} & linears
            if leaf in group and not members <= chosen:
                out -= members
    return out


def _module_of(hf_name: str) -> str | None:
    """The module a weight belongs to, as vLLM names it (a per-expert weight: the expert stack)."""
    if not hf_name.endswith(".weight"):
        return None
    module = hf_name.removesuffix(".weight")
    m = _EXPERT.match(module)
    return m[1] if m else module


def to_serving(
    hf_name: str, tensor: torch.Tensor, fmt: ServingFormat, *, copy: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """One Hugging Face tensor in the serving format: (name, tensor), and its block scales if FP8.

    copy=True returns new storage even where the dtype already matches (a snapshot that outlives
    later in-place updates of `tensor`). Meta tensors give meta results of the right shapes and
    dtypes, for planning files from shapes alone.
    """
    if _module_of(hf_name) not in fmt.fp8_modules:
        yield hf_name, tensor.to(fmt.dtype, copy=copy)
        return
    if tensor.is_meta:
        out_dim, K = tensor.shape
        q = torch.empty(out_dim, K, dtype=FP8_DTYPE, device="meta")
        scale = torch.empty(-(-out_dim // BLOCK), -(-K // BLOCK), dtype=torch.float32, device="meta")
    else:
        q, scale = quantize_weight(tensor)
    yield hf_name, q
    yield hf_name + SCALE_SUFFIX, scale


def is_fp8_scale(hf_name: str) -> bool:
    return hf_name.endswith(".weight" + SCALE_SUFFIX)


def quantization_config_for(hf_names: Iterable[str], fmt: ServingFormat) -> dict[str, Any] | None:
    """config.json's `quantization_config` for files of `hf_names` in `fmt` (None when not FP8).

    DeepSeek-V3's keys, read by vLLM's `fp8` method; `modules_to_not_convert` names every module
    with a weight that is not FP8 (norms, embeddings, routers, LM head, small linears, MTP layers),
    since vLLM otherwise expects FP8 weights for each of its linear layers.
    """
    if not fmt.fp8:
        return None
    kept = {m for n in hf_names if (m := _module_of(n)) is not None and m not in fmt.fp8_modules}
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(kept),
    }


def dequantize_blocks(
    q_ok: torch.Tensor, scale_inv_ObKb: torch.Tensor, offset: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """fp32 values of FP8 weight rows/columns `q_ok` that start at `offset` in a weight whose 128x128
    blocks have the scales `scale_inv_ObKb`: a whole weight, or the slice a sharded reader reads."""
    rows = torch.arange(offset[0], offset[0] + q_ok.shape[0]) // BLOCK
    cols = torch.arange(offset[1], offset[1] + q_ok.shape[1]) // BLOCK
    return q_ok.float() * scale_inv_ObKb.float()[rows][:, cols]

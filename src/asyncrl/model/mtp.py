"""Checkpoint tensors carried through unchanged: the multi-token-prediction (MTP) layers.

DeepSeek-V3, Kimi-K2, GLM-4.5 and GLM-5 checkpoints hold `num_nextn_predict_layers` extra decoder
layers after the last one (`model.layers.{num_hidden_layers + i}.*`). Neither we nor transformers
run them; vLLM uses them for speculative decoding, so a checkpoint we write must still hold them.
They are kept, frozen, as buffers of a `PassthroughTensors` module, so every path that walks
`model.state_dict()` (save_pretrained, weight publishing, DCP checkpoints) carries them, and the
optimizer never sees them (docs/trainer.md says why they are not trained). Buffer names cannot
contain '.', so the HF name is stored with ':' in its place; `model.mtp.items()` gives them back
under their HF names. Under FSDP (`asyncrl.distributed.apply_parallelism`) each one becomes a
DTensor sharded on dim 0 over the FSDP mesh, so a rank holds 1/N of GLM-5's ~10B-parameter layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from asyncrl.model.args import ModelArgs

__all__ = ["PREFIX", "PassthroughTensors", "hf_name", "is_mtp_key", "num_mtp_layers", "our_name"]

PREFIX = "mtp."
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def num_mtp_layers(args: ModelArgs) -> int:
    """The config's `num_nextn_predict_layers` (kept in `ModelArgs.extra`, written back as read)."""
    return int(args.extra.get("num_nextn_predict_layers") or 0)


def is_mtp_key(hf_key: str, args: ModelArgs) -> bool:
    """Whether an HF tensor name belongs to a layer past the last decoder layer (an MTP layer)."""
    m = _LAYER.match(hf_key)
    return m is not None and int(m[1]) >= args.num_hidden_layers


def our_name(hf_key: str) -> str:
    return PREFIX + hf_key.replace(".", ":")


def hf_name(name: str) -> str:
    assert name.startswith(PREFIX), name
    return name[len(PREFIX) :].replace(":", ".")


class PassthroughTensors(nn.Module):
    """Holds tensors by (encoded) HF name; the model never reads them."""

    def put(self, hf_key: str, tensor: torch.Tensor) -> None:
        self.register_buffer(our_name(hf_key)[len(PREFIX) :], tensor)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every kept tensor: a DTensor (1/N per rank) under a sharded trainer."""
        for name, t in self.named_buffers(recurse=False):
            yield name.replace(":", "."), t

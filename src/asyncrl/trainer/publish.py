"""Weight publishing: after step n, make policy version v_n available to the inference servers.

`WeightPublisher` is the interface; `FilesystemWeightPublisher` writes `RUN/weights/step_n/` in
Hugging Face layout (safetensors + config.json + the tokenizer files of the source model) through
`asyncrl.transport.stage_weights` (temporary name, rename, STABLE marker, keep last K). A
torch.distributed broadcast publisher can implement the same interface later.

Under FSDP2 / EP (world size > 1) no rank holds the full model: every rank walks
`asyncrl.distributed.iter_hf_tensors`, which gathers one Hugging Face tensor at a time onto rank
0 only, and rank 0 streams them into safetensors shards (`asyncrl.model.HFCheckpointWriter`, the
writer `save_pretrained` uses), so rank 0 holds about one shard's worth of full tensors and the
others only their own shards.
"""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

from asyncrl.distributed import DistInfo, barrier, iter_hf_tensors
from asyncrl.model import HFCheckpointWriter, Transformer
from asyncrl.transport import STABLE_MARKER, stage_weights

__all__ = ["FilesystemWeightPublisher", "WeightPublisher", "copy_tokenizer_files"]

_WEIGHT_FILES = ("config.json", "model.safetensors.index.json", STABLE_MARKER)


class WeightPublisher(Protocol):
    def publish(self, model: Transformer, step: int) -> None:
        """Make the current weights available as policy version `step`. Called on every rank."""
        ...


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy every top-level file of `src` that is not weights or config (tokenizer, chat template...)."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _WEIGHT_FILES:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


class FilesystemWeightPublisher:
    """Rank 0 writes weights/step_n/; under FSDP2 / EP the tensors are gathered to it one at a time."""

    def __init__(self, run_dir: Path, tokenizer_dir: Path, keep_last: int, info: DistInfo) -> None:
        self.run_dir, self.tokenizer_dir, self.keep_last, self.info = run_dir, tokenizer_dir, keep_last, info

    def publish(self, model: Transformer, step: int) -> None:
        # One path at every world size: at world size 1 iter_hf_tensors gathers nothing.
        staging = stage_weights(self.run_dir, step, keep_last=self.keep_last) if self.info.is_main else None
        with staging or nullcontext() as tmp:
            writer = HFCheckpointWriter(tmp, model) if tmp is not None else None
            for name, tensor in iter_hf_tensors(model):  # collective
                if writer is not None:  # only rank 0 receives tensors
                    writer.add(name, tensor)
            if writer is not None:
                writer.finish()
                copy_tokenizer_files(self.tokenizer_dir, tmp)
        barrier(self.info)

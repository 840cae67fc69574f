"""Weight publishing: after step n, make policy version v_n available to the inference servers.

`WeightPublisher` is the interface; `FilesystemWeightPublisher` writes `RUN/weights/step_n/` in
Hugging Face layout (safetensors + config.json + the tokenizer files of the source model) through
`asyncrl.transport.stage_weights` (a directory of its own, STABLE marker, `step_n` link swapped in
one rename, keep last K). A torch.distributed broadcast publisher can implement the same
interface later.

Before writing, rank 0 checks the free space against the parameter bytes; a publish that does not
fit (then, or a full disk while writing) raises `DiskFullError` on every rank and publishes
nothing.

Under FSDP2 / EP (world size > 1) no rank holds the full model: every rank walks
`asyncrl.distributed.iter_hf_tensors`, which gathers one Hugging Face tensor at a time onto rank
0 only, and rank 0 streams them into safetensors shards (`asyncrl.model.HFCheckpointWriter`, the
writer `save_pretrained` uses), so rank 0 holds about one shard's worth of full tensors and the
others only their own shards.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

from asyncrl.distributed import DistInfo, iter_hf_tensors
from asyncrl.model import HFCheckpointWriter, Transformer
from asyncrl.run_dir import weights_dir
from asyncrl.trainer.diskspace import ensure_free_space, raise_together, state_bytes
from asyncrl.transport import STABLE_MARKER, DiskFullError, stage_weights

__all__ = ["FilesystemWeightPublisher", "WeightPublisher", "copy_tokenizer_files"]

_WEIGHT_FILES = ("config.json", "model.safetensors.index.json", STABLE_MARKER)


class WeightPublisher(Protocol):
    def publish(self, model: Transformer, step: int) -> None:
        """Make the current weights available as policy version `step`. Called on every rank."""
        ...


def _tokenizer_files(src: Path) -> list[Path]:
    """Every top-level file of `src` that is not weights or config (tokenizer, chat template...)."""
    return [
        f
        for f in sorted(src.iterdir())
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _WEIGHT_FILES
    ]


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy `src`'s tokenizer files into `dst`; returns their names."""
    copied = []
    for f in _tokenizer_files(src):
        shutil.copy2(f, dst / f.name)
        copied.append(f.name)
    return copied


class FilesystemWeightPublisher:
    """Rank 0 writes weights/step_n/; under FSDP2 / EP the tensors are gathered to it one at a time."""

    def __init__(self, run_dir: Path, tokenizer_dir: Path, keep_last: int, info: DistInfo) -> None:
        self.run_dir, self.tokenizer_dir, self.keep_last, self.info = run_dir, tokenizer_dir, keep_last, info

    def publish(self, model: Transformer, step: int) -> None:
        what = f"published weights of step {step}"
        need = state_bytes(model) + _tokenizer_bytes(self.tokenizer_dir) if self.info.is_main else 0
        ensure_free_space(weights_dir(self.run_dir, step), need, what, self.info)
        error = None
        try:
            self._write(model, step)
        except DiskFullError as e:
            error = e
        raise_together(error, self.info)

    def _write(self, model: Transformer, step: int) -> None:
        # One path at every world size: at world size 1 iter_hf_tensors gathers nothing.
        tensors = iter_hf_tensors(model)  # collective: rank 0 receives the full tensors
        try:
            if self.info.is_main:
                with stage_weights(self.run_dir, step, keep_last=self.keep_last) as tmp:
                    writer = HFCheckpointWriter(tmp, model)
                    for name, tensor in tensors:
                        writer.add(name, tensor)
                    writer.finish()
                    copy_tokenizer_files(self.tokenizer_dir, tmp)
        finally:
            for _ in tensors:  # the gathers need every rank, also after rank 0 failed to write
                pass


def _tokenizer_bytes(src: Path) -> int:
    return sum(f.stat().st_size for f in _tokenizer_files(src))

"""Weight publishing: after step n, make policy version v_n available to the inference servers.

`WeightPublisher` is the interface; `FilesystemWeightPublisher` writes `RUN/weights/step_n/` in
Hugging Face layout (safetensors + config.json + the tokenizer files of the source model) through
`asyncrl.transport.stage_weights` (temporary name, rename, STABLE marker, keep last K). A
torch.distributed broadcast publisher can implement the same interface later.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

from asyncrl.model import Transformer, save_pretrained
from asyncrl.trainer.parallel import DistInfo, barrier
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
    """Rank 0 writes weights/step_n/ (the weights are replicated under plain data parallelism)."""

    def __init__(self, run_dir: Path, tokenizer_dir: Path, keep_last: int, info: DistInfo) -> None:
        self.run_dir, self.tokenizer_dir, self.keep_last, self.info = run_dir, tokenizer_dir, keep_last, info

    def publish(self, model: Transformer, step: int) -> None:
        if self.info.is_main:
            with stage_weights(self.run_dir, step, keep_last=self.keep_last) as tmp:
                save_pretrained(model, tmp)
                copy_tokenizer_files(self.tokenizer_dir, tmp)
        barrier(self.info)

"""Weight publishing: after step n, make policy version v_n available to the inference servers.

`WeightPublisher` is the interface; `FilesystemWeightPublisher` writes `RUN/weights/step_n/` in
Hugging Face layout (safetensors + config.json + the tokenizer files of the source model) through
`asyncrl.transport.stage_weights` (temporary name, rename, STABLE marker, keep last K). A
torch.distributed broadcast publisher can implement the same interface later.

Under FSDP2 / EP (world size > 1) no rank holds the full model: every rank walks
`asyncrl.distributed.iter_hf_tensors`, which gathers one Hugging Face tensor at a time onto rank
0 only, and rank 0 streams them into safetensors shards (`ShardedSafetensorsWriter`), so rank 0
holds at most one shard's worth of full tensors and the others only their own shards.
"""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from asyncrl.distributed import iter_hf_tensors
from asyncrl.model import Transformer, save_pretrained
from asyncrl.trainer.parallel import DistInfo, barrier
from asyncrl.transport import STABLE_MARKER, stage_weights

__all__ = ["FilesystemWeightPublisher", "ShardedSafetensorsWriter", "WeightPublisher", "copy_tokenizer_files"]

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


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ShardedSafetensorsWriter:
    """Write (name, tensor) pairs as they come into the layout `save_pretrained` produces.

    Shards are flushed when the next tensor would pass `max_shard_bytes`; at `finish` they are
    renamed `model-0000i-of-0000n.safetensors` with an index, or `model.safetensors` when one.
    """

    def __init__(self, path: Path, max_shard_bytes: int = 4 * 1024**3) -> None:
        self.path, self.max_shard_bytes = Path(path), max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.dtype: torch.dtype | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if self.current and self.current_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.dtype = self.dtype or t.dtype
        self.current[name] = t
        self.current_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        part = self.path / f".part-{len(self.files):05d}.safetensors"
        save_file(self.current, str(part), metadata={"format": "pt"})
        self.files.append((part, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def finish(self, model: Transformer) -> None:
        """Flush, name the shards, write the index (several shards) and config.json."""
        if self.current or not self.files:
            self._flush()
        dtype_name = _DTYPE_NAMES.get(self.dtype, "float32") if self.dtype else "float32"
        config = model.args.to_hf_config(dtype_name)
        (self.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        n = len(self.files)
        if n == 1:
            self.files[0][0].rename(self.path / "model.safetensors")
            return
        weight_map = {}
        for i, (part, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            part.rename(self.path / final)
            weight_map |= dict.fromkeys(names, final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


class FilesystemWeightPublisher:
    """Rank 0 writes weights/step_n/; under FSDP2 / EP the tensors are gathered to it one at a time."""

    def __init__(self, run_dir: Path, tokenizer_dir: Path, keep_last: int, info: DistInfo) -> None:
        self.run_dir, self.tokenizer_dir, self.keep_last, self.info = run_dir, tokenizer_dir, keep_last, info

    def publish(self, model: Transformer, step: int) -> None:
        if not self.info.is_distributed:
            with stage_weights(self.run_dir, step, keep_last=self.keep_last) as tmp:
                save_pretrained(model, tmp)
                copy_tokenizer_files(self.tokenizer_dir, tmp)
            return
        staging = stage_weights(self.run_dir, step, keep_last=self.keep_last) if self.info.is_main else None
        with staging or nullcontext() as tmp:
            writer = ShardedSafetensorsWriter(tmp) if tmp is not None else None
            tied = model.args.tie_word_embeddings
            for name, tensor in iter_hf_tensors(model, tie_word_embeddings=tied):  # collective
                if writer is not None:  # only rank 0 receives tensors
                    writer.add(name, tensor)
            if writer is not None:
                writer.finish(model)
                copy_tokenizer_files(self.tokenizer_dir, tmp)
        barrier(self.info)

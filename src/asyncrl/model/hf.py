"""Hugging Face checkpoints: load a directory into a `Transformer`, save one that transformers loads.

This module owns the HF format: the naming (`is_hf_tensor`, `to_hf_tensors`) and the one streaming
sharded writer (`HFCheckpointWriter`). `save_pretrained` (one process) and the trainer's weight
publishing (every rank writing its share of the shards, in the serving format of
`asyncrl.model.serving`) go through them. Loading reads block-scale FP8 weights too (dequantized).

On disk, experts are per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, as on the Hub); in
memory they are stacked. Loading also accepts transformers' fused in-memory layout
(`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]) for convenience.
Every load reads through `asyncrl.model.hf_reader.HFReader`, which maps our names to HF tensors
and reads whole tensors or slices (a sharded model's ranks read only their own slices).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import StateDictSplit, split_torch_state_dict_into_shards
from safetensors.torch import save_file

from asyncrl.model.args import ModelArgs, ModelConfigError, load_args
from asyncrl.model.compute import drop_kept_copies
from asyncrl.model.dtypes import dtype_name
from asyncrl.model.hf_reader import HFReader
from asyncrl.model.mtp import PREFIX as MTP_PREFIX
from asyncrl.model.mtp import hf_name as mtp_hf_name
from asyncrl.model.serving import ServingFormat, quantization_config_for, to_serving
from asyncrl.model.transformer import Transformer

__all__ = [
    "FilePlan",
    "HFCheckpointWriter",
    "HFReader",
    "build_meta_model",
    "check_state_dict",
    "from_pretrained",
    "is_hf_tensor",
    "load_args",
    "load_into",
    "load_state_dict",
    "plan_files",
    "save_pretrained",
    "to_hf_state_dict",
    "to_hf_tensors",
]

MAX_SHARD_BYTES = 4 * 1024**3


def load_state_dict(path: str | os.PathLike, args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read every tensor of the checkpoint, in our (stacked-expert) names and `dtype`."""
    with HFReader(path, args) as reader:
        return {name: reader.read(name, dtype) for name in reader.names}


def build_meta_model(reader: HFReader, dtype: torch.dtype) -> Transformer:
    """The checkpoint's model on the meta device in `dtype`, with a placeholder per MTP tensor."""
    with torch.device("meta"):
        model = Transformer(reader.args).to(dtype)
        for hf_key, shape in reader.mtp_shapes().items():
            model.mtp.put(hf_key, torch.empty(shape, dtype=dtype))
    return model


def from_pretrained(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Transformer:
    """Load a Hugging Face directory (config.json + safetensors) of a supported family.

    Names and shapes are checked before anything is read; then one tensor at a time is read
    into the model, so the peak is the model plus its largest tensor.
    """
    with HFReader(path, load_args(path)) as reader:
        model = build_meta_model(reader, dtype)
        model.to_empty(device=device)
        model.tie_weights()
        targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if is_hf_tensor(n, model.args)}
        reader.check({n: t.shape for n, t in targets.items()}, where=str(path))
        with torch.no_grad():
            for name, t in targets.items():
                t.copy_(reader.read(name, dtype))
    return model


def _tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """What a checkpoint fills: parameters and buffers (the routers' score-correction bias, kept MTP
    tensors)."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def check_state_dict(model: Transformer, state: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Raise ModelConfigError unless `state` (our names) has exactly `model`'s names, shapes and dtypes.

    `load_into` calls it before the first copy, so a rejected state leaves the model untouched.
    """
    params = _tensors(model)
    names = set(state) - ({"lm_head.weight"} if model.args.tie_word_embeddings else set())
    missing = sorted(set(params) - names)
    unexpected = sorted(names - set(params))
    if missing:
        raise ModelConfigError(f"{where}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        raise ModelConfigError(
            f"{where}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    for name, p in params.items():
        t = state[name]
        if t.shape != p.shape:
            raise ModelConfigError(
                f"{where}: tensor '{name}' has shape {list(t.shape)}, expected {list(p.shape)}"
            )
        if t.dtype != p.dtype:
            raise ModelConfigError(f"{where}: tensor '{name}' has dtype {t.dtype}, expected {p.dtype}")


def load_into(
    model: Transformer, state: dict[str, torch.Tensor], where: str = "checkpoint", *, share: bool = False
) -> None:
    """Copy `state` (our names) into `model`; every name, shape and dtype is checked before any copy.

    share=True points the model's tensors at `state`'s instead, where they sit on the same device
    (no copy: the engine's weight swap is then a pointer swap); the caller must not reuse `state`.
    Every fp32 copy derived from the old values (`compute.as_fp32`) is dropped: nothing computed
    from the old weights outlives the swap, whatever addresses the new tensors got.
    """
    check_state_dict(model, state, where)
    params = _tensors(model)
    with torch.no_grad():
        for name, p in params.items():
            t = state[name]
            if share and t.device == p.device:
                p.data = t
            else:
                p.copy_(t)
    drop_kept_copies(params.values())


def is_hf_tensor(name: str, args: ModelArgs) -> bool:
    """Whether our state-dict entry `name` is written to HF files (a tied LM head is not)."""
    return not (name == "lm_head.weight" and args.tie_word_embeddings)


def to_hf_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One of our state-dict entries under Hugging Face's on-disk names.

    Stacked experts `model.layers.i.mlp.experts.gate_proj` [E, I, D] become E tensors
    `model.layers.i.mlp.experts.{e}.gate_proj.weight` [I, D] (views, no copy); others pass through.
    """
    if name.startswith(MTP_PREFIX):
        yield mtp_hf_name(name), tensor
    elif name.startswith("model.layers.") and ".mlp.experts." in name:
        prefix, proj = name.rsplit(".", 1)
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.{proj}.weight", tensor[e]
    else:
        yield name, tensor


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our parameters in Hugging Face's on-disk names (experts unstacked, tied head dropped)."""
    return {
        hf_name: t
        for name, p in model.state_dict().items()
        if is_hf_tensor(name, model.args)
        for hf_name, t in to_hf_tensors(name, p)
    }


@dataclass(frozen=True, kw_only=True)
class FilePlan:
    """A checkpoint's safetensors files, planned from shapes alone: the same at every world size.

    Example: FilePlan(split=<huggingface_hub's file <-> tensor-name maps>, sources={
    "model.layers.0.mlp.experts.gate_proj": ("model.layers.0.mlp.experts.0.gate_proj.weight", ...)},
    file_bytes={"model-00001-of-00002.safetensors": 4294967296, ...}, fmt=ServingFormat(...)).
    """

    split: StateDictSplit
    sources: dict[str, tuple[str, ...]]  # our state-dict name -> the file tensors it becomes
    file_bytes: dict[str, int]
    fmt: ServingFormat

    @property
    def total_bytes(self) -> int:
        return sum(self.file_bytes.values())


def plan_files(
    model: Transformer, max_shard_bytes: int = MAX_SHARD_BYTES, fmt: ServingFormat | None = None
) -> FilePlan:
    """Plan `model`'s files (in `fmt`, else in the model's own dtype) over meta tensors: no data is
    read, so DTensor parameters of a sharded model plan without any gather."""
    entries = {name: p for name, p in model.state_dict().items() if is_hf_tensor(name, model.args)}
    if not entries:
        raise ValueError("model has no tensors to write")
    fmt = fmt or ServingFormat(dtype=next(iter(entries.values())).dtype)
    meta: dict[str, torch.Tensor] = {}
    sources: dict[str, tuple[str, ...]] = {}
    for name, p in entries.items():
        full = torch.empty(p.shape, dtype=p.dtype, device="meta")  # DTensor.shape is the global one
        outs = [pair for hf_name, t in to_hf_tensors(name, full) for pair in to_serving(hf_name, t, fmt)]
        for out_name, out in outs:
            meta[out_name] = torch.empty(out.shape, dtype=out.dtype, device="meta")  # own storage: own size
        sources[name] = tuple(out_name for out_name, _ in outs)
    split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_bytes)
    file_bytes = {
        file: sum(meta[n].numel() * meta[n].element_size() for n in names)
        for file, names in split.filename_to_tensors.items()
    }
    return FilePlan(split=split, sources=sources, file_bytes=file_bytes, fmt=fmt)


class HFCheckpointWriter:
    """Stream (HF name, tensor) pairs into `path` as safetensors shards + index + config.json.

    The files are planned first (`plan_files`, from shapes alone). Each shard is written as soon as
    its last tensor arrives, so the writer holds about one shard of tensors.

        writer = HFCheckpointWriter(path, model)
        for name, tensor in pairs:          # any order; full tensors, e.g. gathered one at a time
            writer.add(name, tensor)
        writer.finish()                     # checks every planned tensor came, writes index + config

    `fmt` (`asyncrl.model.serving`) plans the files in a serving format; the caller then adds the
    tensors `to_serving` gives. `plan` reuses a plan made before. `files` restricts the writer to
    some of the planned shards (one rank's share; `finish(metadata=False)` then checks only those,
    and one writer writes the index and config.json). `save_shard(path, tensors)` writes a complete
    shard (default: safetensors' `save_file`); a caller may queue it instead, e.g. for a thread.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: Transformer,
        max_shard_bytes: int = MAX_SHARD_BYTES,
        *,
        fmt: ServingFormat | None = None,
        plan: FilePlan | None = None,
        files: Iterable[str] | None = None,
        save_shard: Callable[[Path, dict[str, torch.Tensor]], None] | None = None,
    ) -> None:
        self.path, self.args = Path(path), model.args
        self.plan = plan or plan_files(model, max_shard_bytes, fmt)
        planned = self.plan.split.filename_to_tensors
        mine = set(planned) if files is None else set(files)
        if unknown := mine - set(planned):
            raise ValueError(f"files {sorted(unknown)} are not in the checkpoint plan")
        self._pending = {file: set(planned[file]) for file in sorted(mine)}
        self._buffers: dict[str, dict[str, torch.Tensor]] = {file: {} for file in self._pending}
        self._save_shard = save_shard or _save_shard

    def add(self, name: str, tensor: torch.Tensor) -> None:
        file = self.plan.split.tensor_to_filename.get(name)
        if file is None or (file in self._pending and name not in self._pending[file]):
            raise ValueError(f"tensor {name!r} is not in the checkpoint plan or was added twice")
        if file not in self._pending:
            raise ValueError(f"tensor {name!r} belongs to {file}, which this writer does not write")
        self._pending[file].discard(name)
        self._buffers[file][name] = tensor.detach().contiguous().cpu()
        if not self._pending[file]:
            self._save_shard(self.path / file, self._buffers.pop(file))

    def finish(self, metadata: bool = True) -> None:
        """Check that every tensor of this writer's files came; with `metadata`, write config + index."""
        missing = sorted(name for names in self._pending.values() for name in names)
        if missing:
            raise ValueError(
                f"{self.path}: tensors never added: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            )
        if metadata:
            self.write_metadata()

    def write_metadata(self) -> None:
        """config.json (torch_dtype and quantization_config as in the files) and, if sharded, the index."""
        split, fmt = self.plan.split, self.plan.fmt
        config = self.args.to_hf_config(dtype_name(fmt.dtype))
        config.pop("quantization_config", None)  # the source model's, if it had one, says nothing here
        if quantization := quantization_config_for(split.tensor_to_filename, fmt):
            config["quantization_config"] = quantization
        (self.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _save_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


def save_pretrained(
    model: Transformer, path: str | os.PathLike, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
    """Write config.json and safetensors shards (with an index when more than one)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    writer = HFCheckpointWriter(path, model, max_shard_bytes)
    for name, t in to_hf_state_dict(model).items():
        writer.add(name, t)
    writer.finish()

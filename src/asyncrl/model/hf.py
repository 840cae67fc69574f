"""Hugging Face checkpoints: load a directory into a `Transformer`, save one that transformers loads.

This module owns the HF format: the naming (`is_hf_tensor`, `to_hf_tensors`) and the one streaming
sharded writer (`HFCheckpointWriter`). `save_pretrained` (one process), the trainer's weight
publishing and the rank-0 gathered publish of a sharded model (`asyncrl.distributed.iter_hf_tensors`
feeding the writer) all go through them.

On disk, experts are per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, as on the Hub); in
memory they are stacked. Loading also accepts transformers' fused in-memory layout
(`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]) for convenience.
Every load reads through `asyncrl.model.hf_reader.HFReader`, which maps our names to HF tensors
and reads whole tensors or slices (a sharded model's ranks read only their own slices).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from asyncrl.model.args import ModelArgs, ModelConfigError
from asyncrl.model.compute import drop_fp32_copies
from asyncrl.model.dtypes import dtype_name
from asyncrl.model.hf_reader import HFReader
from asyncrl.model.mtp import PREFIX as MTP_PREFIX
from asyncrl.model.mtp import hf_name as mtp_hf_name
from asyncrl.model.transformer import Transformer

__all__ = [
    "HFCheckpointWriter",
    "HFReader",
    "build_meta_model",
    "check_state_dict",
    "from_pretrained",
    "is_hf_tensor",
    "load_args",
    "load_into",
    "load_state_dict",
    "save_pretrained",
    "to_hf_state_dict",
    "to_hf_tensors",
]

MAX_SHARD_BYTES = 4 * 1024**3


def load_args(path: str | os.PathLike) -> ModelArgs:
    """Parse `path/config.json` into ModelArgs, with errors that name the directory and the key."""
    path = Path(path)
    if not path.is_dir():
        raise ModelConfigError(f"model directory not found: {path}")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelConfigError(f"{path} has no config.json (expected a Hugging Face model directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{cfg_path}: invalid JSON: {e}") from None
    try:
        return ModelArgs.from_hf_config(cfg)
    except (ModelConfigError, TypeError) as e:
        raise ModelConfigError(f"{cfg_path}: {e}") from None


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
    """What a checkpoint fills: parameters and buffers (the routers' score-correction bias, kept MTP tensors)."""
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
    drop_fp32_copies(params.values())


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


class HFCheckpointWriter:
    """Stream (HF name, tensor) pairs into `path` as safetensors shards + index + config.json.

    The shard plan comes first, from shapes alone (`huggingface_hub.split_torch_state_dict_into_shards`
    over meta tensors, so DTensor parameters of a sharded model plan without any gather). Each shard
    is written as soon as its last tensor arrives, so the writer holds about one shard of tensors.

        writer = HFCheckpointWriter(path, model)
        for name, tensor in pairs:          # any order; full tensors, e.g. gathered one at a time
            writer.add(name, tensor)
        writer.finish()                     # checks every planned tensor came, writes index + config
    """

    def __init__(
        self, path: str | os.PathLike, model: Transformer, max_shard_bytes: int = MAX_SHARD_BYTES
    ) -> None:
        self.path, self.args = Path(path), model.args
        meta: dict[str, torch.Tensor] = {}
        for name, p in model.state_dict().items():
            if is_hf_tensor(name, model.args):
                full = torch.empty(p.shape, dtype=p.dtype, device="meta")  # DTensor.shape is the global one
                for hf_name, t in to_hf_tensors(name, full):
                    meta[hf_name] = torch.empty(
                        t.shape, dtype=t.dtype, device="meta"
                    )  # own storage: own size
        if not meta:
            raise ValueError("model has no tensors to write")
        self.dtype = dtype_name(next(iter(meta.values())).dtype)
        self.plan = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_bytes)
        self._pending = {file: set(names) for file, names in self.plan.filename_to_tensors.items()}
        self._buffers: dict[str, dict[str, torch.Tensor]] = {file: {} for file in self._pending}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        file = self.plan.tensor_to_filename.get(name)
        if file is None or name not in self._pending[file]:
            raise ValueError(f"tensor {name!r} is not in the checkpoint plan or was added twice")
        self._pending[file].discard(name)
        self._buffers[file][name] = tensor.detach().contiguous().cpu()
        if not self._pending[file]:
            save_file(self._buffers.pop(file), str(self.path / file), metadata={"format": "pt"})

    def finish(self) -> None:
        missing = sorted(name for names in self._pending.values() for name in names)
        if missing:
            raise ValueError(
                f"{self.path}: tensors never added: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            )
        config = self.args.to_hf_config(self.dtype)
        (self.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.plan.is_sharded:
            index = {"metadata": self.plan.metadata, "weight_map": self.plan.tensor_to_filename}
            (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


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

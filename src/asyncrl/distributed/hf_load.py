"""Sharded start-up: every rank reads only its own slices of a Hugging Face checkpoint.

After `apply_parallelism` on a model built on meta, each parameter and buffer is either a DTensor,
which knows its global shape and which slice this rank holds (dense weights a block of rows over
the FSDP mesh, expert weights a block of experts over `ep` and of rows over `expert_shard`, MTP
tensors a block of rows), or a plain tensor that every rank holds whole (the routers' small
score-correction biases). `load_hf_shards` reads exactly those slices through the model package's
`HFReader`, casts them to the model's dtype and copies them in; no rank ever holds the full model,
nor a full expert stack:

    with HFReader(path, load_args(path)) as reader:
        model = build_meta_model(reader, dtype)           # MTP placeholders from the headers
        apply_parallelism(model, dims, meshes, device_type="cuda")
        model.to_empty(device="cuda")
        model.tie_weights()
        load_hf_shards(model, reader, where=str(path))    # every rank; no collective
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from asyncrl.model import Transformer
from asyncrl.model.hf import HFReader, is_hf_tensor

__all__ = ["load_hf_shards", "local_index"]


def local_index(t: DTensor) -> tuple[slice, ...]:
    """This rank's block of the global tensor: one [start, stop) slice per dim."""
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def load_hf_shards(model: Transformer, reader: HFReader, where: str) -> None:
    """Fill this rank's share of every parameter and buffer of `model` from `reader`.

    Names and full shapes are checked against the checkpoint headers first (the same on every
    rank, so every rank raises alike), naming the file and tensor at fault.
    """
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if is_hf_tensor(n, model.args)}
    reader.check({n: t.shape for n, t in targets.items()}, where=where)
    with torch.no_grad():
        for name, t in targets.items():
            if isinstance(t, DTensor):
                local = t.to_local()
                local.copy_(reader.read(name, local.dtype, local_index(t)))
            else:
                t.copy_(reader.read(name, t.dtype))

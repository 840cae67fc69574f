"""Spawned-process helpers for sharded start-up: each rank reads its own slices of an HF checkpoint.

Workers build the model the way the trainer does (`asyncrl.trainer.scaleout.build_parallel_model`:
meta -> apply_parallelism -> `load_hf_shards`), count the bytes every rank reads from the files, and
compare the gathered result against `from_pretrained` on rank 0. Failures propagate through
torch.multiprocessing with their traceback (`dist_workers.launch`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.config import load_config
from asyncrl.config.trainer import PublishConfig, RLTrainerConfig
from asyncrl.distributed import DistInfo, ParallelDims, gather_to_rank0, save_dcp
from asyncrl.model import Transformer, from_pretrained, load_args
from asyncrl.model.hf import HFReader, is_hf_tensor
from asyncrl.trainer.optim import build_optimizer
from asyncrl.trainer.publish import FilesystemWeightPublisher
from asyncrl.trainer.scaleout import build_parallel_model

_READ = {"bytes": 0}


def _counting_reads() -> None:
    """Count every byte any HFReader of this process takes from a file (this forked process only)."""
    original = HFReader.read_hf

    def read_hf(self, part, index):
        t = original(self, part, index)
        _READ["bytes"] += t.numel() * t.element_size()
        return t

    HFReader.read_hf = read_hf


def _config(path: str, degrees: dict, run_dir: str = "unused", ac: bool = False) -> RLTrainerConfig:
    parallel = degrees | {"activation_checkpointing": ac}
    return load_config(
        RLTrainerConfig, {"model": {"path": path}, "run_dir": run_dir, "max_steps": 1, "parallel": parallel}
    )


def build(rank: int, world_size: int, cfg: RLTrainerConfig) -> tuple[Transformer, int]:
    """The trainer's sharded model and the bytes this rank read to build it."""
    args = load_args(cfg.model.path)
    num_experts = args.num_experts if args.is_moe else 0
    dims = ParallelDims.from_config(cfg.parallel, world_size=world_size, num_experts=num_experts)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    before = _READ["bytes"]
    model, _ = build_parallel_model(cfg, dims, info)
    return model, _READ["bytes"] - before


def _check_against_reference(model: Transformer, ref: dict | None, label: str) -> None:
    for name, t in model.state_dict().items():
        full = gather_to_rank0(t)
        if ref is not None:
            assert torch.equal(full, ref[name]), f"{label}: {name}"
    if ref is not None:
        assert model.state_dict().keys() == ref.keys(), label


def _check_bytes(model: Transformer, num_read: int, degrees: dict, label: str) -> None:
    """A rank reads exactly the bytes of what it holds: about 1/N of the model plus small replicated
    buffers."""
    held = {n: t for n, t in model.state_dict().items() if is_hf_tensor(n, model.args)}
    local = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in held.items()}
    assert num_read == sum(t.numel() for t in local.values()) * 4, label  # fp32 files
    total = sum(t.numel() for t in held.values()) * 4
    replicated = sum(t.numel() for t in held.values() if not isinstance(t, DTensor)) * 4
    shards = dist.get_world_size() // degrees.get("dp_replicate", 1)
    assert num_read <= total / shards * 1.05 + replicated, (label, num_read, total, replicated)
    assert replicated <= 0.01 * total, label  # only the routers' correction biases


def worker_startup(rank: int, world_size: int, model_dirs: dict[str, str], layouts: list[tuple]) -> None:
    """Every (model, layout): the gathered sharded load equals from_pretrained, bit for bit, each
    rank read only its own share of the files, and a forward gives from_pretrained's logits."""
    _counting_reads()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for label, path in model_dirs.items():
        one = from_pretrained(path) if rank == 0 else None
        ref = one.state_dict() if one is not None else None
        with torch.no_grad():
            ref_logits = one(ids).logits if one is not None else None
        for degrees, ac in layouts:
            if degrees.get("ep", 1) > 1 and not load_args(path).is_moe:
                continue
            model, num_read = build(rank, world_size, _config(path, degrees, ac=ac))
            _check_against_reference(model, ref, f"{label} {degrees}")
            _check_bytes(model, num_read, degrees, f"{label} {degrees}")
            with torch.no_grad():  # the shards FSDP gathers for compute are the ones loaded
                logits = model(ids).logits
            if ref_logits is not None:
                torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5, msg=f"{label} {degrees}")


def worker_mtp_publish(rank: int, world_size: int, path: str, run_dir: str, dcp_dir: str) -> None:
    """GLM-5 with its MTP layer at world size 2 (FSDP2 x EP2): MTP tensors are sharded frozen buffers;
    a training step leaves them as they are; publish and DCP carry them (checked by the caller)."""
    model, _ = build(rank, world_size, _config(path, {"dp_shard": 2, "ep": 2}, run_dir))
    mtp = dict(model.mtp.items())  # by HF name
    assert "model.layers.4.eh_proj.weight" in mtp
    assert not any(n.startswith("mtp.") for n, _ in model.named_parameters())
    for name, t in mtp.items():
        assert isinstance(t, DTensor) and t.to_local().shape[0] == -(-t.shape[0] // 2), name
    before = {n: t.to_local().clone() for n, t in mtp.items()}
    optimizer = build_optimizer(model, _config(path, {}).optim)
    ids = torch.randint(0, model.args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
    model(ids).logits.float().square().mean().backward()
    optimizer.step()
    for name, t in model.mtp.items():
        assert torch.equal(t.to_local(), before[name]), name
    info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    cfg = PublishConfig(keep_last=2, dtype="float32", overlap=False)  # the master weights, as they are
    FilesystemWeightPublisher(Path(run_dir), Path(path), cfg, info).publish(model, 1)
    save_dcp(dcp_dir, model)

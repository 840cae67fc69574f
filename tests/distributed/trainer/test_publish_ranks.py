"""Every rank writes its share of a publication, and the files are the bytes one process writes.

tiny-moe under FSDP2 (2 ranks, bf16, background write) and FSDP2 x EP2 (4 ranks, bf16 with FP8
blocks, written in the step), gloo on CPU, with files of at most 300 kB so that every rank gets
some: the published directory must hold exactly the files of a world-size-1 publish, byte for byte,
and each rank must have written files no other rank wrote. About 20 s on 2 busy cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import asyncrl.model.hf as hf
from asyncrl.config.trainer import PublishConfig
from asyncrl.distributed import DistInfo, ParallelDims, apply_parallelism, load_full_state_dict
from asyncrl.model import Transformer, from_pretrained
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.publish import FilesystemWeightPublisher
from helpers import free_port, run_ranks

MAX_SHARD_BYTES = 300_000


def _publish(model, run_dir: Path, model_dir: Path, info: DistInfo, publish: dict) -> None:
    cfg = PublishConfig(max_shard_bytes=MAX_SHARD_BYTES, **publish)
    publisher = FilesystemWeightPublisher(run_dir, model_dir, cfg, info)
    publisher.publish(model, 1)
    publisher.wait()


def _worker(
    rank: int, world_size: int, port: int, model_dir: Path, run_dir: Path, layout: dict, publish: dict
):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        written = []
        real = hf.save_file

        def save(tensors, path, metadata=None):
            written.append(Path(path).name)
            real(tensors, path, metadata=metadata)

        hf.save_file = save
        full = from_pretrained(model_dir)
        dims = ParallelDims.build(world_size=world_size, num_experts=full.args.num_experts, **layout)
        with torch.device("meta"):
            model = Transformer(full.args)
        apply_parallelism(model, dims, dims.build_meshes("cpu"), device_type="cpu")
        model.to_empty(device="cpu")
        model.tie_weights()
        load_full_state_dict(model, full.state_dict() if rank == 0 else None)
        info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
        _publish(model, run_dir, model_dir, info, publish)
        (run_dir / f"rank{rank}.txt").write_text("\n".join(written))
    finally:
        dist.destroy_process_group()


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


@pytest.mark.parametrize(
    ("world_size", "layout", "publish"),
    [
        (2, {"dp_shard": 2}, {"dtype": "bfloat16", "overlap": True}),
        (4, {"dp_shard": 4, "ep": 2}, {"dtype": "bfloat16", "fp8": True, "overlap": False}),
    ],
    ids=["fsdp2-bf16-background", "fsdp4xep2-fp8-in-step"],
)
def test_every_rank_writes_its_share_and_the_files_match_one_process(tmp_path, world_size, layout, publish):
    model_dir = tmp_path / "model"
    init_model("tiny-moe", model_dir, seed=0)
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    _publish(from_pretrained(model_dir), tmp_path / "one", model_dir, one, publish)
    run_dir = tmp_path / "many"
    run_dir.mkdir()
    run_ranks(_worker, world_size, world_size, free_port(), model_dir, run_dir, layout, publish)
    want = _files(weights_dir(tmp_path / "one", 1))
    got = _files(weights_dir(run_dir, 1))
    assert got.keys() == want.keys() and len([f for f in want if f.endswith(".safetensors")]) >= world_size
    for name in want:
        assert got[name] == want[name], name
    per_rank = [
        set(filter(None, (run_dir / f"rank{r}.txt").read_text().split("\n"))) for r in range(world_size)
    ]
    assert all(per_rank), per_rank  # every rank wrote files
    assert (
        sum(map(len, per_rank))
        == len(set().union(*per_rank))
        == sum(f.endswith(".safetensors") for f in want)
    )

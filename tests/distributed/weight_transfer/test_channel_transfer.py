"""A version sent over an update channel is the version the files hold, bit for bit.

tiny-moe served in bf16, or bf16 with block-FP8 linears, gloo on CPU. The trainer is FSDP2 over 2
ranks (each sends only its own shards), HSDP over 2 replicas, FSDP4 x EP2 with experts cut by
expert and by row (slow), or one process; one receiver process assembles what they send. Version 1 goes
dense, version 2 (a small step: most bf16 values unchanged) as a delta and then dense again: each
must equal `load_state_dict` of the same version published as files by one process, and the delta
must have carried fewer bytes. A receiver that dies mid-transfer leaves another server's channel
unaffected (the sender reports that one channel's failure and goes on). About 5 s a case on 2 busy cores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncrl.config.trainer import PublishConfig
from asyncrl.distributed import DistInfo, ParallelDims, apply_parallelism, load_full_state_dict
from asyncrl.model import Transformer, from_pretrained
from asyncrl.model.hf import load_state_dict
from asyncrl.model.serving import ServingFormat, serving_format
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.publish import FilesystemWeightPublisher
from asyncrl.weight_transfer import (
    BucketReceiver,
    BucketSender,
    Channel,
    Rendezvous,
    TransferError,
    as_dtype,
    published_shapes,
)
from helpers import free_port, run_ranks

BUCKET_BYTES = 64 << 10  # many buckets for tiny-moe, and shards split across them
SERVING = torch.bfloat16
TIMEOUT_S = 60.0


def _step(model: Transformer) -> None:
    """A small deterministic update, relative 1e-4: below bf16's resolution for most values."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-4 * p.abs())


def _format(model: Transformer, fp8: bool) -> ServingFormat:
    return serving_format(model, SERVING, fp8=fp8)


def _publish_files(model_dir: Path, run_dir: Path, fp8: bool) -> None:
    """Versions 1 and 2 as files, written by one process."""
    model = from_pretrained(model_dir)
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    cfg = PublishConfig(dtype="bfloat16", fp8=fp8, overlap=False)
    publisher = FilesystemWeightPublisher(run_dir, model_dir, cfg, one)
    for version in (1, 2):
        if version == 2:
            _step(model)
        publisher.publish(model, version)
        publisher.wait()


def _trainer_model(model_dir: Path, num_senders: int, layout: dict) -> Transformer:
    full = from_pretrained(model_dir)
    if num_senders == 1:
        return full
    rank = dist.get_rank()
    dims = ParallelDims.build(world_size=num_senders, num_experts=full.args.num_experts, **layout)
    with torch.device("meta"):
        model = Transformer(full.args)
    apply_parallelism(model, dims, dims.build_meshes("cpu"), device_type="cpu")
    model.to_empty(device="cpu")
    model.tie_weights()
    load_full_state_dict(model, full.state_dict() if rank == 0 else None)
    return model


def _trainer(rank: int, num_senders: int, case: dict, ports: dict, model_dir: Path, out: Path) -> None:
    if num_senders > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
        dist.init_process_group("gloo", rank=rank, world_size=num_senders)
    try:
        model = _trainer_model(model_dir, num_senders, case["layout"])
        channels = {
            name: Channel.join(
                _rdv(port, num_senders), rank=rank, device=torch.device("cpu"), timeout_s=TIMEOUT_S
            )
            for name, port in ports["servers"].items()
        }
        sender = BucketSender(bucket_bytes=BUCKET_BYTES, delta=True)
        fmt = _format(model, case["fp8"])
        sent = {"v1": sender.send(model, fmt, 1, channels)}
        if num_senders > 1:
            step = from_pretrained(model_dir)
            _step(step)
            load_full_state_dict(model, step.state_dict() if rank == 0 else None)
        else:
            _step(model)
        sent["v2"] = sender.send(model, fmt, 2, channels)
        sent["v2_dense"] = sender.send(model, fmt, 2, channels, dense={"a"})
        report = {
            k: {ch: r.__dict__ if not isinstance(r, TransferError) else str(r) for ch, r in v.items()}
            for k, v in sent.items()
        }
        (out / f"sender{rank}.json").write_text(json.dumps(report))
    finally:
        if num_senders > 1:
            dist.destroy_process_group()


def _rdv(port: int, num_senders: int) -> Rendezvous:
    return Rendezvous(host="127.0.0.1", port=port, num_senders=num_senders, world_size=num_senders + 1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _receiver(name: str, num_senders: int, fp8: bool, port: int, model_dir: Path, files: Path) -> None:
    model = from_pretrained(model_dir)
    channel = Channel.join(
        _rdv(port, num_senders), rank=num_senders, device=torch.device("cpu"), timeout_s=TIMEOUT_S
    )
    if name == "dead":
        channel.recv_bucket(0)  # one bucket of version 1, then gone
        os._exit(0)
    receiver = BucketReceiver(channel, published_shapes(model, _format(model, fp8)))
    for version, label in ((1, "dense"), (2, "delta"), (2, "dense again")):
        got_version, state = receiver.receive()
        assert got_version == version
        assert fp8 == any(t.dtype == torch.float8_e4m3fn for t in state.values())
        for dtype in (SERVING, torch.float32):
            want = load_state_dict(weights_dir(files, version), model.args, dtype)
            got = as_dtype(state, dtype)
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(_bits(got[key]), _bits(want[key])), f"v{version} {label}: {key} ({dtype})"


def _run(
    rank: int, num_senders: int, case: dict, ports: dict, model_dir: Path, files: Path, out: Path
) -> None:
    torch.set_num_threads(1)
    if rank < num_senders:
        _trainer(rank, num_senders, case, ports, model_dir, out)
    else:
        name = sorted(ports["servers"])[rank - num_senders]
        _receiver(name, num_senders, case["fp8"], ports["servers"][name], model_dir, files)


@pytest.mark.parametrize(
    ("num_senders", "layout", "fp8"),
    [
        (1, {}, False),
        (2, {"dp_shard": 2}, False),
        (2, {"dp_shard": 2}, True),
        (2, {"dp_replicate": 2, "dp_shard": 1}, False),  # each element sent once, by replica 0
        pytest.param(4, {"dp_shard": 4, "ep": 2}, True, marks=pytest.mark.slow),  # ~25 s
    ],
    ids=["trainer-1", "fsdp2", "fsdp2-fp8", "hsdp2", "fsdp4xep2-fp8"],
)
def test_a_version_over_the_channel_is_the_version_in_the_files(tmp_path, num_senders, layout, fp8):
    model_dir, files, out = tmp_path / "model", tmp_path / "run", tmp_path / "out"
    init_model("tiny-moe", model_dir, seed=0)
    _publish_files(model_dir, files, fp8)
    out.mkdir()
    ports = {"trainer": free_port(), "servers": {"a": free_port(), "dead": free_port()}}
    options = {"fp8": fp8, "layout": layout}
    run_ranks(_run, num_senders + 2, num_senders, options, ports, model_dir, files, out)
    sending = num_senders // layout.get("dp_replicate", 1)  # replicas after the first send nothing
    for rank in range(num_senders):
        sent = json.loads((out / f"sender{rank}.json").read_text())
        assert all("channel rank" in sent[v]["dead"] for v in sent)  # that channel only
        v1, v2, v2_dense = (sent[v]["a"] for v in ("v1", "v2", "v2_dense"))
        if rank >= sending:
            assert v1["num_elements"] == v2["num_bytes"] == 0
            continue
        assert v1["num_changed"] == v1["num_elements"] == v2_dense["num_elements"] > 0
        assert 0 < v2["num_changed"] < v2["num_elements"] // 4
        assert v2["num_bytes"] < v2_dense["num_bytes"] // 2 and v2_dense["num_bytes"] >= v1["num_bytes"]

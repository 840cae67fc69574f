"""The trainer's `DistributedWeightPublisher` over FSDP2 (2 ranks, gloo) and three servers' `ReceiveLoop`s.

Server "steady" takes every version; server "flaky" dies in the middle of version 2; a new
"flaky" (its restart) comes up after that. The run goes on: v2's publication names steady as
having it and flaky as left behind; the restarted server gets v2 whole as soon as it joins, with no
new step; v3, published to disk too (`to_disk`), reaches both as a delta and equals its files bit
for bit on both. The trainer ranks walk the same jobs in the same order throughout (or they would
hang). bf16 serving, tiny-moe. About 15 s on 2 busy cores.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.config.trainer import PublishConfig
from asyncrl.config.weights import DistributedWeightsConfig
from asyncrl.distributed import DistInfo, ParallelDims, apply_parallelism, load_full_state_dict
from asyncrl.model import Transformer, from_pretrained
from asyncrl.model.hf import load_state_dict
from asyncrl.model.serving import serving_format
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.publish_distributed import DistributedWeightPublisher
from asyncrl.transport.weights import TRANSFER_MANIFEST as MANIFEST
from asyncrl.weight_transfer import ReceiveLoop, WeightsEndpoint, as_dtype, published_shapes
from asyncrl.weight_transfer.channel import Channel
from helpers import free_port, run_ranks

SERVING = torch.bfloat16
WORLD_SIZE = 2
ROLES = ("trainer0", "trainer1", "steady", "flaky", "restarted")


def _stepped(model_dir: Path, n: int) -> Transformer:
    """The base model after `n` small deterministic steps (every rank builds the same)."""
    model = from_pretrained(model_dir)
    with torch.no_grad():
        for i in range(n):
            g = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-4 * p.abs())
    return model


def _wait_file(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _trainer(rank: int, ports: dict, model_dir: Path, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        full = from_pretrained(model_dir)
        dims = ParallelDims.build(world_size=WORLD_SIZE, num_experts=full.args.num_experts, dp_shard=2)
        with torch.device("meta"):
            model = Transformer(full.args)
        apply_parallelism(model, dims, dims.build_meshes("cpu"), device_type="cpu")
        model.to_empty(device="cpu")
        model.tie_weights()
        load_full_state_dict(model, full.state_dict() if rank == 0 else None)
        info = DistInfo(rank=rank, world_size=WORLD_SIZE, local_rank=rank, device=torch.device("cpu"))
        weights = DistributedWeightsConfig(
            endpoint=f"127.0.0.1:{ports['store']}", bucket_bytes=1 << 20, timeout_s=10
        )
        cfg = PublishConfig(dtype="bfloat16", keep_last=5)
        publisher = DistributedWeightPublisher(out / "run", model_dir, cfg, weights, info, model, 0)
        _wait_file(out / "steady.v0")  # both servers joined: each version goes to both
        _wait_file(out / "flaky.v0")
        for step in (1, 2, 3):
            if step == 3:
                _wait_file(out / "restarted.v2")  # it joined after v2 and got v2 without a step
            new = _stepped(model_dir, step)
            load_full_state_dict(model, new.state_dict() if rank == 0 else None)
            publisher.publish(model, step, to_disk=step == 3)
            publisher.wait()
        _wait_file(out / "steady.v3")
        _wait_file(out / "restarted.v3")
        publisher.close()
    finally:
        dist.destroy_process_group()


def _server(name: str, label: str, ports: dict, model_dir: Path, out: Path) -> None:
    model = from_pretrained(model_dir)
    shapes = published_shapes(model, serving_format(model, SERVING))
    endpoint = WeightsEndpoint(host="127.0.0.1", port=ports["store"], server=name, timeout_s=10)
    loop = ReceiveLoop(endpoint, expected_shapes=shapes)
    loop.start()
    for version in (0, 1, 2, 3) if label == "steady" else (2, 3):
        staged = loop.wait_staged(version, timeout_s=120)
        assert staged.version == version
        _check(staged.state, version, model_dir, out)
        (out / f"{label}.v{version}").write_text(json.dumps({"num_bytes": staged.num_bytes}))
    loop.close()


def _check(state, version: int, model_dir: Path, out: Path) -> None:
    """Bit-identical to the version's files (v3's) or to one process's serving cast of it."""
    got = as_dtype(state, SERVING)
    if version == 3:
        path = weights_dir(out / "run", 3)
        _wait_file(path / "STABLE")
        want = load_state_dict(path, from_pretrained(model_dir).args, SERVING)
    else:
        want = {k: v.to(SERVING) for k, v in _stepped(model_dir, version).state_dict().items() if k in got}
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), k


def _flaky(ports: dict, model_dir: Path, out: Path) -> None:
    """Takes v0 (on joining) and v1, then dies after the first bucket of v2."""
    real = Channel.recv_bucket

    def recv_bucket(self, src, deadline=None, buffer=None):
        header, payload = real(self, src, deadline, buffer)
        if header.version == 2:
            (out / "flaky.died").write_text("")
            os._exit(0)
        return header, payload

    Channel.recv_bucket = recv_bucket
    model = from_pretrained(model_dir)
    shapes = published_shapes(model, serving_format(model, SERVING))
    endpoint = WeightsEndpoint(host="127.0.0.1", port=ports["store"], server="flaky", timeout_s=10)
    loop = ReceiveLoop(endpoint, expected_shapes=shapes)
    loop.start()
    loop.wait_staged(0, timeout_s=120)
    (out / "flaky.v0").write_text("")
    time.sleep(600)  # until the trainer's v2 ends it


def _run(index: int, ports: dict, model_dir: Path, out: Path) -> None:
    torch.set_num_threads(1)
    role = ROLES[index]
    # each process's transfer log, tagged: pytest shows it when the test fails
    logging.basicConfig(force=True, level=logging.INFO, format=f"{role} %(asctime)s %(name)s: %(message)s")
    if role.startswith("trainer"):
        _trainer(index, ports, model_dir, out)
    elif role == "steady":
        _server("steady", "steady", ports, model_dir, out)
    elif role == "flaky":
        _flaky(ports, model_dir, out)
    else:
        _wait_file(out / "flaky.died")
        _server("flaky", "restarted", ports, model_dir, out)


def test_a_server_lost_mid_version_is_left_behind_and_gets_the_current_version_when_it_rejoins(tmp_path):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    ports = {"trainer": free_port(), "store": free_port()}
    run_ranks(_run, len(ROLES), ports, tmp_path / "model", tmp_path)
    v2 = json.loads((weights_dir(tmp_path / "run", 2) / MANIFEST).read_text())
    assert (v2["transport"], v2["servers"], v2["left_behind"]) == ("distributed", ["steady"], ["flaky"])
    assert "flaky" in v2["errors"]
    assert not (weights_dir(tmp_path / "run", 2) / "model.safetensors").exists()  # a small publication
    assert (weights_dir(tmp_path / "run", 3) / "model.safetensors").exists()  # to_disk: the files
    sizes = {
        name: json.loads((tmp_path / name).read_text())["num_bytes"]
        for name in ("restarted.v2", "restarted.v3")
    }
    assert sizes["restarted.v3"] < sizes["restarted.v2"] / 2  # v2 came whole on joining, v3 as a delta

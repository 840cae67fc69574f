"""Seconds and bytes per policy version: files vs an update channel, dense vs delta (library level).

    python benchmarks/bench_weights.py [--models moe-50m] [--world-sizes 1 2] [--repeats 3] [--write]

One trainer of W processes (FSDP over all of them when W > 1, random weights, gloo, one thread per
process) and one receiving process, all on this machine. Per version, from the trainer's start to
the receiver holding the version as tensors in the serving dtype (bf16):

- files: `FilesystemWeightPublisher` (every rank writes its share, in the step), then the receiver
  reads the directory (`load_state_dict`, what the embedded engine's reload reads);
- channel, dense: `BucketSender` -> `BucketReceiver` over one update channel (asyncrl.weight_transfer);
- channel, delta: the next version after a small step (every weight moved by a Gaussian of
  relative size `--step-rel`), sent as changed elements where that is smaller.

This is the transport alone: no engine is generating, so there is no pause to measure, and the
step is synthetic (the changed fraction of a real run is the demo's to report). Results go to
BENCHMARKS.md under "## Weight transfer (library)" with --write.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.config.trainer import PublishConfig
from asyncrl.distributed import DistInfo, ParallelDims, apply_parallelism
from asyncrl.model import Transformer, preset_args
from asyncrl.model.hf import load_state_dict
from asyncrl.model.serving import serving_format
from asyncrl.run_dir import weights_dir
from asyncrl.trainer.publish import FilesystemWeightPublisher
from asyncrl.weight_transfer import BucketReceiver, BucketSender, Channel, Rendezvous, published_shapes
from report import write_section

SERVING = torch.bfloat16
BUCKET_BYTES = 32 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(preset: str, world_size: int) -> Transformer:
    args = preset_args(preset)
    with torch.device("meta"):
        model = Transformer(args)
    if world_size > 1:
        dims = ParallelDims.build(world_size=world_size, num_experts=args.num_experts)
        apply_parallelism(model, dims, dims.build_meshes("cpu"), device_type="cpu")
    model.to_empty(device="cpu")
    model.tie_weights()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def _step(model: Transformer, rel: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * rel * p.abs())


def _trainer(rank: int, world_size: int, job: dict) -> list[dict]:
    model = _model(job["preset"], world_size)
    fmt = serving_format(model, SERVING)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    publisher = FilesystemWeightPublisher(
        Path(job["run"]), Path(job["tok"]), PublishConfig(dtype="bfloat16", overlap=False, keep_last=1), info
    )
    rdv = Rendezvous(host="127.0.0.1", port=job["port"], num_senders=world_size, world_size=world_size + 1)
    channels = {"s": Channel.join(rdv, rank=rank, device=torch.device("cpu"), timeout_s=300)}
    sender = BucketSender(bucket_bytes=BUCKET_BYTES, delta=True)
    rows = []
    for rep in range(job["repeats"]):
        v = 2 * rep + 1
        t_files = time.time()
        publisher.publish(model, v)
        publisher.wait()
        t_dense = time.time()
        dense = sender.send(model, fmt, v, channels, dense={"s"})["s"]
        _step(model, job["step_rel"])
        t_delta = time.time()
        delta = sender.send(model, fmt, v + 1, channels)["s"]
        rows.append(
            {
                "t_files": t_files,
                "t_dense": t_dense,
                "t_delta": t_delta,
                "dense": vars(dense),
                "delta": vars(delta),
            }
        )
    return rows


def _receiver(world_size: int, job: dict) -> list[dict]:
    with torch.device("meta"):
        meta = Transformer(preset_args(job["preset"]))
    rdv = Rendezvous(host="127.0.0.1", port=job["port"], num_senders=world_size, world_size=world_size + 1)
    receiver = BucketReceiver(
        Channel.join(rdv, rank=world_size, device=torch.device("cpu"), timeout_s=300),
        published_shapes(meta, serving_format(meta, SERVING)),
    )
    rows = []
    for rep in range(job["repeats"]):
        v = 2 * rep + 1
        path = weights_dir(Path(job["run"]), v)
        while not (path / "STABLE").exists():
            time.sleep(0.002)
        load_state_dict(path.resolve(), meta.args, SERVING)
        files_done = time.time()
        receiver.receive()
        dense_done = time.time()
        receiver.receive()
        rows.append({"files_done": files_done, "dense_done": dense_done, "delta_done": time.time()})
    return rows


def _proc(rank: int, world_size: int, job: dict) -> None:
    torch.set_num_threads(1)
    if rank < world_size and world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["dist_port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rows = _trainer(rank, world_size, job) if rank < world_size else _receiver(world_size, job)
    Path(job["out"], f"{rank}.json").write_text(json.dumps(rows))
    if rank < world_size and world_size > 1:
        dist.destroy_process_group()


def run_case(preset: str, world_size: int, repeats: int, step_rel: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp, "tok")
        tok.mkdir()
        job = {
            "preset": preset,
            "run": str(Path(tmp, "run")),
            "tok": str(tok),
            "out": tmp,
            "repeats": repeats,
            "port": _free_port(),
            "dist_port": _free_port(),
            "step_rel": step_rel,
        }
        Path(job["run"]).mkdir()
        mp.start_processes(
            _proc, args=(world_size, job), nprocs=world_size + 1, join=True, start_method="fork"
        )
        senders = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world_size)]
        received = json.loads(Path(tmp, f"{world_size}.json").read_text())
        mb_files = (
            sum(f.stat().st_size for f in weights_dir(Path(job["run"]), 2 * repeats - 1).resolve().iterdir())
            / 1e6
        )
    return _summarise(preset, world_size, senders, received, mb_files)


def _summarise(preset: str, world_size: int, senders: list, received: list, mb_files: float) -> dict:
    def median(key_start: str, key_done: str) -> float:
        return statistics.median(
            received[i][key_done] - min(s[i][key_start] for s in senders) for i in range(len(received))
        )

    def total(kind: str, key: str) -> int:
        return sum(s[-1][kind][key] for s in senders)

    return {
        "model": preset,
        "world_size": world_size,
        "files_s": median("t_files", "files_done"),
        "dense_s": median("t_dense", "dense_done"),
        "delta_s": median("t_delta", "delta_done"),
        "files_mb": mb_files,
        "dense_mb": total("dense", "num_bytes") / 1e6,
        "delta_mb": total("delta", "num_bytes") / 1e6,
        "changed": total("delta", "num_changed") / total("delta", "num_elements"),
    }


def _table(rows: list[dict]) -> str:
    out = [
        "| model | world size | files s | channel dense s | channel delta s | files / dense | "
        "MB files | MB dense | MB delta | changed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['world_size']} | {r['files_s']:.2f} | {r['dense_s']:.2f} | "
            f"{r['delta_s']:.2f} | "
            f"{r['files_s'] / r['dense_s']:.1f}x | {r['files_mb']:.0f} | {r['dense_mb']:.0f} | "
            f"{r['delta_mb']:.1f} | {r['changed']:.1%} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["moe-50m"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-rel", type=float, default=1e-4)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    rows = [run_case(m, w, a.repeats, a.step_rel) for m in a.models for w in a.world_sizes]
    table = _table(rows)
    print(table)
    if a.write:
        load = os.getloadavg()[0]
        body = (
            "## Weight transfer (library)\n\n"
            f"Seconds per version (median of {a.repeats}) from the trainer's start to one receiving process "
            "holding the version as bf16 tensors: files (every trainer rank writes its share, the receiver "
            "reads the directory) vs one update channel (`asyncrl.weight_transfer`, gloo over loopback, "
            f"{BUCKET_BYTES >> 20} MiB buckets), dense, and delta after a synthetic step (each weight moved "
            f"by a Gaussian of relative size {a.step_rel:g}). Random weights, FSDP over the trainer's "
            "processes, one thread each. The transport alone: no engine generates, so no pause is measured.\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, shared (1-min load average "
            f"{load:.1f} at the end), torch {torch.__version__}.\n"
            f"Command: `python benchmarks/bench_weights.py --repeats {a.repeats} --world-sizes "
            f"{' '.join(map(str, a.world_sizes))} --write`\n\n" + table + "\n"
        )
        write_section("## Weight transfer (library)", body)


if __name__ == "__main__":
    main()

"""Scale-out start-up: peak resident memory of each trainer rank while it loads a GLM-5-shaped model.

    python benchmarks/bench_scaleout.py [--preset glm5-350m] [--world-sizes 1 2 4] [--model DIR] [--no-write]

The model comes from `asyncrl init-model --preset glm5-350m` (MLA, DSA indexer, MTP layer, grouped
sigmoid router, first layer dense; fp32 files), written to a temporary directory unless `--model`
names one. Each world size runs under torchrun with gloo on this machine: world size 1 is the
one-process load (`from_pretrained`); larger ones are the trainer's sharded start-up
(`asyncrl.trainer.scaleout.build_parallel_model`) with FSDP over all ranks and with FSDP x EP
(ep = world size), and, for comparison in the same run, the start-up it replaced (rank 0 reads
the whole model, through the same reader, and broadcasts it as shards).

Each rank resets its peak-RSS counter (/proc/self/clear_refs) after imports and process-group
set-up and reports how much its resident set grew: at the peak during start-up (VmHWM) and after
it. The goal is a peak growth of at most 1.3 x (model bytes / world size) + the largest single
tensor (a layer's expert stack). Results go to BENCHMARKS.md under "## Scale-out: start-up memory".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
TITLE = "## Scale-out: start-up memory"
LAYOUTS = {  # name: (world sizes it runs at, [trainer.parallel] of the sharded start-up)
    "one process": ({1}, None),
    "sharded, FSDP": ({2, 4}, {}),
    "sharded, FSDP x EP": ({2, 4}, "ep"),
    "rank 0 + broadcast": ({2, 4}, "broadcast"),
}


# -- one rank (run by torchrun) --------------------------------------------------------------------
def _status(key: str) -> int:
    """A /proc/self/status memory line (kB) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _build(layout: str, model_dir: str, world_size: int):
    from asyncrl.config import load_config
    from asyncrl.config.trainer import RLTrainerConfig
    from asyncrl.distributed import DistInfo, ParallelDims, apply_parallelism, load_full_state_dict
    from asyncrl.model import from_pretrained, load_args
    from asyncrl.model.hf import HFReader, build_meta_model, load_state_dict
    from asyncrl.trainer.scaleout import build_parallel_model

    if layout == "one process":
        return from_pretrained(model_dir)
    args = load_args(model_dir)
    rank = int(os.environ["RANK"])
    info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    kind = LAYOUTS[layout][1]
    parallel = {"ep": world_size} if kind == "ep" else {}
    cfg = load_config(RLTrainerConfig, {"model": {"path": model_dir}, "max_steps": 1, "parallel": parallel})
    dims = ParallelDims.from_config(cfg.parallel, world_size=world_size, num_experts=args.num_experts)
    if kind != "broadcast":
        return build_parallel_model(cfg, dims, info)[0]
    with HFReader(model_dir, args) as reader:
        model = build_meta_model(reader, torch.float32)
    apply_parallelism(model, dims, dims.build_meshes("cpu"), device_type="cpu")
    model.to_empty(device="cpu")
    load_full_state_dict(model, load_state_dict(model_dir, args, torch.float32) if rank == 0 else None)
    return model


def worker(layout: str, model_dir: str, out: Path) -> None:
    from asyncrl.distributed import barrier, init_distributed

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    base = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    model = _build(layout, model_dir, info.world_size)
    seconds = time.perf_counter() - start
    peak, after = _status("VmHWM"), _status("VmRSS")
    state = model.state_dict()
    held = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in state.values())
    record = {
        "rank": info.rank,
        "seconds": seconds,
        "peak": peak - base,
        "after": after - base,
        "held": held,
        "model": sum(t.numel() * t.element_size() for t in state.values()),
        "largest": max(t.numel() * t.element_size() for t in state.values()),
    }
    (out / f"rank{info.rank}.json").write_text(json.dumps(record))
    barrier(info)


# -- the driver --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(layout: str, world_size: int, model_dir: Path, tmp: Path) -> list[dict]:
    out = tmp / f"{layout.replace(' ', '_').replace(',', '')}-{world_size}"
    out.mkdir()
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'benchmarks'}",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world_size),
        "--master-port",
        str(_free_port()),
        str(Path(__file__).resolve()),
        "--worker",
        layout,
        "--model",
        str(model_dir),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def _row(layout: str, world_size: int, ranks: list[dict]) -> str:
    mb = 1024**2
    model, largest = ranks[0]["model"], ranks[0]["largest"]
    share = model / world_size
    goal = 1.3 * share + largest
    peak = max(r["peak"] for r in ranks)
    peaks = " / ".join(f"{r['peak'] / mb:.0f}" for r in ranks)
    held = max(r["held"] for r in ranks)
    after = max(r["after"] for r in ranks)
    secs = max(r["seconds"] for r in ranks)
    ok = "yes" if peak <= goal else "no"
    return (
        f"| {world_size} | {layout} | {share / mb:.0f} | {held / mb:.0f} | {after / mb:.0f} | {peaks} | "
        f"{peak / share:.2f} | {goal / mb:.0f} | {ok} | {secs:.1f} |"
    )


def _size(model_dir: Path) -> str:
    from asyncrl.model import load_args
    from asyncrl.model.mtp import num_mtp_layers

    args = load_args(model_dir)
    return (
        f"{args.num_params() / 1e9:.2f}B parameters + {num_mtp_layers(args)} MTP layer, "
        f"{args.num_experts} experts top-{args.num_experts_per_tok}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="glm5-350m")
    p.add_argument("--model", type=Path, help="an existing model directory (default: init-model --preset)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, str(args.model), args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from asyncrl.tools.init_model import init_model

            model_dir = Path(tmp) / args.preset
            init_model(args.preset, model_dir, seed=0)
        size = _size(model_dir)
        rows = [
            _row(layout, ws, _run(layout, ws, model_dir, Path(tmp)))
            for ws in args.world_sizes
            for layout, (sizes, _) in LAYOUTS.items()
            if ws in sizes
        ]
    header = (
        f"{TITLE}\n\n`python benchmarks/bench_scaleout.py` on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, gloo; model `{args.model or args.preset}` "
        f"({size}, fp32 files and master weights).\nMiB per rank; growth of the resident set over the "
        "process after imports and process-group set-up. Goal: peak <= 1.3 x share + the largest "
        "single tensor.\n\n"
        "| world size | start-up | model / world size | tensors held | growth after | peak growth per rank | "
        "max peak / share | goal | met | seconds |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = header + "\n".join(rows) + "\n"
    print(body)
    if not args.no_write:
        from report import write_section

        write_section(TITLE, body)


if __name__ == "__main__":
    main()

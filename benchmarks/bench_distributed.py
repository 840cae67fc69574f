"""Forward+backward time per packed row under FSDP2, EP, CP on 2 gloo CPU processes vs one process.

    python benchmarks/bench_distributed.py [--steps 5] [--tokens 512] [--no-write]

The baseline is one process running the same model on one row, measured in the same run. On CPU
with gloo this measures the overhead of the parallel machinery (collectives, dispatch, masks),
not the speed-up a GPU cluster would see: each process still computes a full row (FSDP, EP) or
half a row (CP). Results go to BENCHMARKS.md under "## Distributed".
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.distributed import ContextParallelAttention, ParallelDims, apply_parallelism, split_for_cp
from asyncrl.model import Transformer, preset_args
from report import write_section

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "FSDP 2": {"dp_shard": 2},
    "FSDP 2 x EP 2": {"dp_shard": 2, "ep": 2},
    "CP 2": {"dp_shard": 1, "cp": 2},
}


def _model() -> Transformer:
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(0)
    return model


def _row(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    half = tokens // 2
    pos = torch.cat([torch.arange(half), torch.arange(tokens - half)])[None]
    return torch.randint(0, 256, (1, tokens), generator=gen), pos


def _median_seconds(step, steps: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _baseline(tokens: int, steps: int) -> float:
    model, (ids, pos) = _model(), _row(tokens)
    return _median_seconds(lambda: model(ids, pos).logits.float().mean().backward(), steps)


def _fwd_bwd(model, ids, pos, attention):
    def step() -> None:
        model(ids, pos, attention=attention).logits.mean().backward()

    return step


def _worker(rank: int, port: int, tokens: int, steps: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for name, degrees in LAYOUTS.items():
        dims = ParallelDims.build(world_size=2, num_experts=8, **degrees)
        meshes = dims.build_meshes("cpu")
        model = apply_parallelism(_model(), dims, meshes, device_type="cpu")
        ids, pos = _row(tokens)
        attention = None
        if dims.cp_enabled:
            attention = ContextParallelAttention(pos, meshes.world.get_group("cp"))
            ids, pos = (
                split_for_cp(ids, 2, dims.cp_rank(rank), 1),
                split_for_cp(pos, 2, dims.cp_rank(rank), 1),
            )
        seconds = _median_seconds(_fwd_bwd(model, ids, pos, attention), steps)
        if rank == 0:
            results[name] = seconds
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--no-write", action="store_true")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    base = _baseline(ns.tokens, ns.steps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(port, ns.tokens, ns.steps, results), nprocs=2, start_method="fork")
    rows = [f"| 1 process (baseline) | {ns.tokens} | {base * 1e3:.0f} | 1.00x |"]
    for name in LAYOUTS:
        rows.append(f"| {name} | {ns.tokens} | {results[name] * 1e3:.0f} | {results[name] / base:.2f}x |")
    table = (
        "| layout | tokens/row | ms per fwd+bwd (rank 0) | vs baseline |\n|---|---|---|---|\n"
        + "\n".join(rows)
    )
    print(table)
    if not ns.no_write:
        header = (
            "Forward+backward of tiny-moe on one packed row, fp32, 2 gloo processes with 1 thread each, "
            "median of steps; the baseline is one process in the same run. CPU overhead of the parallel "
            "machinery, not a GPU speed-up. Without EP, FSDP all-gathers the experts (most of the weights) "
            "over gloo twice per step and reduce-scatters their gradients; with EP they stay on their rank.\n"
            f"Machine: {platform.machine()} {os.cpu_count()} threads, shared (1-min load average "
            f"{os.getloadavg()[0]:.1f} at the end: expect run-to-run swings of 2x), torch "
            f"{torch.__version__}.\n"
            f"Command: `python benchmarks/bench_distributed.py --steps {ns.steps} --tokens {ns.tokens}`\n\n"
        )
        write_section("## Distributed", f"## Distributed\n\n{header}{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

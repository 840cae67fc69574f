"""Publish seconds and bytes per version: fp32 vs bf16 (vs FP8), one writer vs every rank, world
sizes 1, 2, 4.

    python benchmarks/bench_publish.py [--models moe-50m glm5-0.4b] [--world-sizes 1 2 4] \
        [--repeats 2] [--write]

Each world size runs under torchrun (gloo, CPU, one thread per rank). Every rank builds the model
on meta, shards it with FSDP over all ranks and fills its shards with random values (the bytes are
timed, not the values). Cases:

- one writer: the path before every rank wrote, kept as `asyncrl.distributed.iter_hf_tensors`:
  rank 0 receives every tensor (gathered in fp32) and writes every file, in the step;
- all ranks: `FilesystemWeightPublisher` with `overlap = false` (each rank gathers, in the serving
  dtype where it only casts, and writes its share of the files, in the step), and with
  `overlap = true` (the step only takes the snapshot; "step blocked" is that part, the slowest
  rank's, and "publish s" runs until STABLE).

Files go to a local disk through the page cache (safetensors does not fsync), so "publish s" is
mostly gather + serialisation + memory copies; on a shared filesystem the writes themselves take
longer, and more writers help more. The files are at most `--shard-mb` each (default: an eighth
of the bf16 model, so that 4 ranks have files to share). Results go to BENCHMARKS.md under
"## Publishing" with --write.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.config.trainer import PublishConfig
from asyncrl.distributed import DistInfo, ParallelDims, apply_parallelism, init_distributed, iter_hf_tensors
from asyncrl.model import HFCheckpointWriter, ModelArgs, Transformer, preset_args, torch_dtype
from asyncrl.model.hf import plan_files
from asyncrl.model.serving import serving_format, to_serving
from asyncrl.run_dir import weights_dir
from asyncrl.trainer.publish import FilesystemWeightPublisher, assign_files
from asyncrl.transport import stage_weights
from report import write_section

ROOT = Path(__file__).resolve().parents[1]
# A GLM-5-shaped model of ~0.36B parameters: MLA with a DSA indexer, a first dense layer, then
# sigmoid-routed MoE layers of 16 experts with a shared expert (tiny-glm5's family, widened).
GLM5_04B = replace(
    preset_args("tiny-glm5"),
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=32,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    num_experts=16,
    moe_intermediate_size=512,
    index_n_heads=8,
    index_head_dim=64,
    indexer_types=("full",) * 12,
)
MODELS: dict[str, ModelArgs] = {"moe-50m": preset_args("moe-50m"), "glm5-0.4b": GLM5_04B}
CASES = (  # label, writers, dtype, fp8, overlap
    ("one writer", "one", "float32", False, False),
    ("one writer", "one", "bfloat16", False, False),
    ("all ranks", "all", "float32", False, False),
    ("all ranks", "all", "bfloat16", False, False),
    ("all ranks, overlap", "all", "bfloat16", False, True),
    ("all ranks", "all", "bfloat16", True, False),
)


# -- one torchrun rank ------------------------------------------------------------------------------
def _random_model(args: ModelArgs, info: DistInfo) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    if info.is_distributed:
        dims = ParallelDims.build(world_size=info.world_size, num_experts=args.num_experts)
        apply_parallelism(model, dims, dims.build_meshes("cpu"), device_type="cpu")
    model.to_empty(device="cpu")
    model.tie_weights()
    gen = torch.Generator().manual_seed(info.rank)
    with torch.no_grad():
        for t in model.state_dict().values():
            local = t.to_local() if hasattr(t, "to_local") else t
            local.copy_(torch.randn(local.shape, generator=gen) * 0.02)
    return model


def _one_writer(
    model: Transformer, run_dir: Path, step: int, fmt, max_shard_bytes: int, info: DistInfo
) -> None:
    """Rank 0 receives every full tensor and writes every file (iter_hf_tensors, one at a time)."""
    tensors = iter_hf_tensors(model)
    if info.is_main:
        with stage_weights(run_dir, step, keep_last=1) as tmp:
            writer = HFCheckpointWriter(tmp, model, plan=plan_files(model, max_shard_bytes, fmt))
            for name, t in tensors:
                for out_name, out in to_serving(name, t, fmt):
                    writer.add(out_name, out)
            writer.finish()
    for _ in tensors:
        pass


def _slowest(seconds: float, info: DistInfo) -> float:
    t = torch.tensor([seconds])
    if info.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _case(model, case, run_dir: Path, step: int, shard_bytes: int, info: DistInfo) -> tuple[float, float]:
    """(step blocked s, publish s until STABLE) of one publish, the slowest rank's."""
    _, writers, dtype, fp8, overlap = case
    if info.is_distributed:
        dist.barrier()
    start = time.perf_counter()
    if writers == "one":
        fmt = serving_format(model, torch_dtype(dtype), fp8=fp8)
        _one_writer(model, run_dir, step, fmt, shard_bytes, info)
        blocked = time.perf_counter() - start
    else:
        cfg = PublishConfig(dtype=dtype, fp8=fp8, overlap=overlap, keep_last=1, max_shard_bytes=shard_bytes)
        tokenizer = run_dir / "no-tokenizer"
        tokenizer.mkdir(parents=True, exist_ok=True)
        publisher = FilesystemWeightPublisher(run_dir, tokenizer, cfg, info)
        publisher.publish(model, step)
        blocked = time.perf_counter() - start
        publisher.wait()
        publisher.close()
    total = time.perf_counter() - start
    return _slowest(blocked, info), _slowest(total, info)


def _busiest(sizes: dict[str, int], world_size: int) -> int:
    """Bytes written by the rank with the most, under the publisher's assignment."""
    owner = assign_files(sizes, world_size)
    return max(sum(b for f, b in sizes.items() if owner[f] == r) for r in range(world_size))


def worker(ns: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    args = MODELS[ns.model]
    model = _random_model(args, info)
    results = []
    for i, case in enumerate(CASES):
        run_dir = Path(ns.run_dir) / f"case{i}"
        times = [_case(model, case, run_dir, step, ns.shard_bytes, info) for step in range(1, ns.repeats + 1)]
        if info.is_main:
            published = weights_dir(run_dir, ns.repeats).resolve()
            sizes = {f.name: f.stat().st_size for f in published.iterdir() if f.suffix == ".safetensors"}
            busiest = sum(sizes.values()) if case[1] == "one" else _busiest(sizes, info.world_size)
            results.append(
                {
                    "case": i,
                    "blocked": statistics.median(t[0] for t in times),
                    "total": statistics.median(t[1] for t in times),
                    "bytes": sum(sizes.values()),
                    "files": len(sizes),
                    "busiest": busiest,
                }
            )
        if info.is_distributed:
            dist.barrier()
        if info.is_main:
            shutil.rmtree(run_dir, ignore_errors=True)
    if info.is_main:
        Path(ns.out).write_text(json.dumps(results))
    if info.is_distributed:
        dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------------
def _run(model: str, world_size: int, repeats: int, shard_bytes: int, work: Path) -> list[dict]:
    out = work / f"{model}-{world_size}.json"
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        "--model",
        model,
        "--out",
        str(out),
        "--run-dir",
        str(work / f"{model}-{world_size}"),
        "--repeats",
        str(repeats),
        "--shard-bytes",
        str(shard_bytes),
    ]
    launcher = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world_size),
            "--master-port",
            str(_free_port()),
        ]
        if world_size > 1
        else [sys.executable]
    )
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]),
    }
    subprocess.run([*launcher, *script], check=True, env=env)
    return json.loads(out.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(model: str, args: ModelArgs, world_size: int, results: list[dict]) -> list[str]:
    rows = []
    for r in results:
        label, _, dtype, fp8, overlap = CASES[r["case"]]
        fmt = "bf16 + FP8 blocks" if fp8 else dtype
        blocked = f"{r['blocked']:.2f}" if overlap else "(all)"
        rows.append(
            f"| {model} | {args.num_params() / 1e6:.0f}M | {world_size} | {label} | {fmt} | "
            f"{r['bytes'] / 1e6:.0f} | {r['files']} | {r['busiest'] / 1e6:.0f} | {r['total']:.2f} | "
            f"{blocked} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=2, help="publishes per case (median)")
    p.add_argument("--write", action="store_true", help="write the table to BENCHMARKS.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--shard-bytes", type=int, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        worker(ns)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_publish.") as tmp:
        for model in ns.models:
            args = MODELS[model]
            shard_bytes = args.num_params() * 2 // 8
            for world_size in ns.world_sizes:
                rows += _rows(
                    model, args, world_size, _run(model, world_size, ns.repeats, shard_bytes, Path(tmp))
                )
                print(rows[-1], flush=True)
    table = (
        "| model | params | world size | writers | format | MB per version | files | MB by the busiest rank "
        "| publish s | step blocked s |\n|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    print(table)
    if ns.write:
        header = (
            "Seconds per published version (median of "
            f"{ns.repeats}, the slowest rank's), torchrun with gloo on CPU, one thread per rank, FSDP over "
            "all ranks, random weights, files of at most an eighth of the bf16 model. `publish s` runs until "
            "STABLE; `step blocked s` is what a step waits with `[publish] overlap` (the snapshot), where "
            "the rest overlaps the next step; without overlap the step waits for all of it. One writer: "
            "rank 0 receives (in fp32) and writes everything, the path before every rank wrote; all ranks "
            "gather in the serving dtype where they only cast. Files go through the page cache of a local "
            "disk.\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, shared (1-min load average "
            f"{os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}.\n"
            f"Command: `python benchmarks/bench_publish.py --repeats {ns.repeats} "
            f"--world-sizes {' '.join(map(str, ns.world_sizes))} --write`\n\n"
        )
        write_section("## Publishing", f"## Publishing\n\n{header}{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

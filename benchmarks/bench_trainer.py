"""Trainer throughput: tokens/s and MFU of the RL step on the tiny-moe and moe-50m presets.

    OMP_NUM_THREADS=2 python benchmarks/bench_trainer.py [--presets tiny-moe moe-50m] [--steps 3]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--write]

For each preset it times the full RL step (packing, chunked-LM-head logprobs, loss, backward,
clip, AdamW) on a synthetic batch, with router replay on and off, and a baseline measured in the
same run: a plain forward + backward with full logits and a cross-entropy loss on the same
packed rows. MFU uses the FLOP count in asyncrl.trainer.metrics and a matmul peak measured at the
start of the run on the same device and dtype. `--write` replaces the "## Trainer" section of
BENCHMARKS.md with the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncrl.config.trainer import OptimConfig, ScheduleConfig, TrustRegionLossConfig
from asyncrl.distributed import DistInfo
from asyncrl.model import Transformer, preset_args
from asyncrl.trainer.loss import rl_loss
from asyncrl.trainer.metrics import flops_per_token, measure_matmul_peak
from asyncrl.trainer.optim import build_optimizer, build_scheduler
from asyncrl.trainer.packing import MicroBatch, pack_samples
from asyncrl.trainer.step import StepRunner
from asyncrl.trainer.synthetic import synthetic_batch
from report import write_section

ROOT = Path(__file__).resolve().parents[1]


def _step_runner(model: Transformer, device: torch.device) -> StepRunner:
    opt = build_optimizer(model, OptimConfig(lr=1e-5))
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    return StepRunner(
        model, opt, build_scheduler(opt, ScheduleConfig(), 100), info, max_grad_norm=1.0, chunk_size=1024
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rl_step(runner: StepRunner, mbs: list[MicroBatch], steps: int) -> float:
    cfg = TrustRegionLossConfig()

    def loss_fn(inputs, n):
        return rl_loss(inputs, cfg, n)

    runner.step(mbs, loss_fn, trained_version=1)  # warm-up
    times = []
    for i in range(steps):
        _sync(runner.info.device)
        start = time.perf_counter()
        runner.step(mbs, loss_fn, trained_version=2 + i)
        _sync(runner.info.device)
        times.append(time.perf_counter() - start)
    return min(times)  # best of N: the least disturbed by other processes on a shared machine


def time_plain_fwd_bwd(model: Transformer, mbs: list[MicroBatch], steps: int, device: torch.device) -> float:
    """Baseline: model forward with full logits, token cross-entropy, backward; no optimizer."""
    mbs = [mb.to(device) for mb in mbs]

    def once() -> None:
        model.zero_grad(set_to_none=True)
        for mb in mbs:
            logits = model(mb.input_ids, mb.position_ids).logits[0].float()
            F.cross_entropy(logits, mb.target_ids, reduction="sum").backward()

    once()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        once()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def bench_preset(preset: str, args: argparse.Namespace, peak: float) -> dict[str, float | str]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = Transformer(preset_args(preset))
    model.init_weights(seed=0)
    batch = synthetic_batch(
        model,
        step=1,
        num_samples=args.samples,
        prompt_len=args.prompt_len,
        completion_len=args.completion_len,
    )
    model = model.to(device=device, dtype=dtype)
    row: dict[str, float | str] = {"preset": preset}
    for replay in (True, False):
        mbs = pack_samples(batch.samples, args.seq_len, replay=replay)
        num_tokens = sum(mb.num_tokens for mb in mbs)
        seconds = time_rl_step(_step_runner(model, device), mbs, args.steps)
        mean_context = sum(float((mb.position_ids + 1).sum()) for mb in mbs) / num_tokens
        tps = num_tokens / seconds
        key = "replay" if replay else "no_replay"
        row[f"{key}_tokens_per_s"] = tps
        row[f"{key}_mfu"] = flops_per_token(model.args, mean_context) * tps / peak
    base_s = time_plain_fwd_bwd(
        model, pack_samples(batch.samples, args.seq_len, replay=False), args.steps, device
    )
    row["baseline_tokens_per_s"] = num_tokens / base_s
    row["tokens_per_step"] = float(num_tokens)
    return row


def render(rows: list[dict[str, float | str]], args: argparse.Namespace, peak: float) -> str:
    lines = [
        "## Trainer",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"device {args.device}, {args.dtype}, torch {torch.__version__}.",
        f"Command: `OMP_NUM_THREADS={torch.get_num_threads()} python benchmarks/bench_trainer.py "
        f"--presets {' '.join(args.presets)} --device {args.device} --dtype {args.dtype} --steps "
        f"{args.steps} --samples {args.samples} --prompt-len {args.prompt_len} --completion-len "
        f"{args.completion_len} --seq-len {args.seq_len} --write`",
        f"Measured matmul peak (1024^2 {args.dtype} matmul, same run): {peak / 1e9:.1f} GFLOP/s.",
        f"Batch: {args.samples} samples of ~{args.prompt_len}+{args.completion_len} tokens packed into "
        f"rows of {args.seq_len}; full RL step (default trust-region loss, AdamW).",
        "",
        "| preset | tokens/step | RL step tok/s (replay) | MFU | RL step tok/s (no replay) | MFU "
        "| plain fwd+bwd tok/s (baseline) | RL step / baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = float(r["replay_tokens_per_s"]) / float(r["baseline_tokens_per_s"])
        lines.append(
            f"| {r['preset']} | {int(float(r['tokens_per_step']))} | {float(r['replay_tokens_per_s']):.0f} "
            f"| {float(r['replay_mfu']):.1%} | {float(r['no_replay_tokens_per_s']):.0f} "
            f"| {float(r['no_replay_mfu']):.1%} | {float(r['baseline_tokens_per_s']):.0f} | {ratio:.2f} |"
        )
    lines += [
        "",
        f"Times are the best of {args.steps} steps after a warm-up step (shared machine: load average "
        f"{os.getloadavg()[0]:.1f} at the end of the run, on {os.cpu_count()} cores).",
        "The baseline is a forward with full logits + cross-entropy + backward on the same rows (no "
        "optimizer, no chunking); the RL step adds the chunked LM head with recompute, the loss, "
        "clipping and AdamW. MFU counts 6 x active non-embedding parameters + causal attention per token.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["tiny-moe", "moe-50m"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--write", action="store_true", help="update the Trainer section of BENCHMARKS.md")
    args = p.parse_args()
    peak = measure_matmul_peak(torch.device(args.device), getattr(torch, args.dtype), seconds=1.0)
    rows = [bench_preset(preset, args, peak) for preset in args.presets]
    text = render(rows, args, peak)
    print(text)
    if args.write:
        write_section("## Trainer", text)


if __name__ == "__main__":
    main()

"""Bytes each trainer data rank reads per step, against the whole batch, with per-rank batch parts.

    PYTHONPATH=src python benchmarks/bench_batch_parts.py [--samples 64] [--mean-tokens 2048] [--no-write]

Builds one rollout batch with routed experts of GLM-5's shape ([tokens, 78 layers, top-8], uint8)
and KV versions, writes it through `asyncrl.transport.write_batch` in 1, 2 and 4 parts (the
trainer's data-parallel size), and reads it back with `read_batch_part` for every rank of that
size. Before the split every rank read the whole batch, at any size; the table puts that next to
the bytes a rank reads now (its part and the manifest; every file a rank opens is read whole, so
the count is their sizes, or the header and the rows read when a rank takes a few samples out of a
part) and the read time. Two more rows read at another rank count than the batch was written for,
which re-splits: the 4-part batch at 2 ranks (a resume at another layout) and the 1-part batch at 4
ranks (a standalone orchestrator left at trainer_dp_size = 1). From the measured bytes per token
it extrapolates the reference GLM-5 batch (256 rollouts x 131072 tokens). Results go to
BENCHMARKS.md under "## Per-rank batches".
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from asyncrl.transport import read_batch_part, write_batch
from asyncrl.transport.disk import format_bytes
from asyncrl.wire import RolloutBatch, RolloutSample
from report import write_section

REFERENCE_TOKENS = 256 * 131072  # the reference GLM-5 batch: 256 rollouts of up to 131k tokens
GLM5_LAYERS, GLM5_TOP_K = 78, 8


def _sample(rng: np.random.Generator, n: int, layers: int, top_k: int) -> RolloutSample:
    versions = np.full(n, 4, np.int32)
    return RolloutSample(
        token_ids=rng.integers(0, 154880, n).astype(np.int32),
        loss_mask=np.arange(n) >= n // 4,
        inference_logprobs=-rng.random(n).astype(np.float32),
        advantages=np.full(n, 0.5, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=versions,
        kv_versions=versions - 1,
        routed_experts=rng.integers(0, 256, (n, layers, top_k)).astype(np.uint8),
        reward=float(rng.random()),
        env="swe",
        episode_id=f"ep-{rng.integers(1 << 30)}",
    )


def build_batch(num_samples: int, mean_tokens: int, layers: int, top_k: int) -> RolloutBatch:
    """Samples of log-normal lengths (agentic rollouts: a few long ones carry most tokens)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(mean_tokens) - 0.32, 0.8, num_samples), 64, 8 * mean_tokens)
    samples = [_sample(rng, int(n), layers, top_k) for n in lengths]
    return RolloutBatch(step=1, samples=samples, metrics={})


def read_all_ranks(run_dir: Path, num_ranks: int) -> tuple[list[int], list[float], int]:
    """Bytes read and seconds of every rank's read_batch_part, and the whole batch's bytes."""
    read, seconds = [], []
    for rank in range(num_ranks):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the re-split row warns by design
            share = read_batch_part(run_dir, 1, rank=rank, num_ranks=num_ranks, timeout_s=0)
        seconds.append(time.perf_counter() - start)
        read.append(share.num_bytes_read)
    return read, seconds, share.manifest.num_bytes


def _row(label: str, read: list[int], seconds: list[float], whole: int) -> str:
    return (
        f"| {label} | {format_bytes(whole)} | {format_bytes(max(read))} | {format_bytes(min(read))} | "
        f"{max(read) / whole:.3f} | {max(seconds) * 1e3:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--mean-tokens", type=int, default=2048)
    p.add_argument("--no-write", action="store_true")
    ns = p.parse_args(argv)
    batch = build_batch(ns.samples, ns.mean_tokens, GLM5_LAYERS, GLM5_TOP_K)
    rows, per_token = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for dp in (1, 2, 4):
            run = Path(tmp) / f"dp{dp}"
            write_batch(run, batch, num_parts=dp)
            read, seconds, whole = read_all_ranks(run, dp)
            per_token = whole / batch.num_tokens
            rows.append(_row(f"{dp} | {dp} part(s)", read, seconds, whole))
        read, seconds, whole = read_all_ranks(Path(tmp) / "dp4", 2)
        rows.append(_row("2 | 4 parts (resume at another layout)", read, seconds, whole))
        read, seconds, whole = read_all_ranks(Path(tmp) / "dp1", 4)
        rows.append(_row("4 | 1 part (orchestrator left at 1)", read, seconds, whole))
    table = (
        "| data ranks | batch written in | whole batch | read by the busiest rank | by the lightest | "
        "busiest / whole | read ms (busiest) |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    reference = per_token * REFERENCE_TOKENS
    note = (
        f"Batch: {len(batch.samples)} samples, {batch.num_tokens} tokens, {per_token:.0f} bytes per token on "
        f"disk (routed experts {GLM5_LAYERS} x {GLM5_TOP_K} uint8 = {GLM5_LAYERS * GLM5_TOP_K} of them). "
        "Before the split every rank read the whole batch at any data-rank count (busiest / whole = 1).\n"
        f"The reference GLM-5 batch (256 x 131072 tokens) at this density: {format_bytes(reference)} per "
        f"step; a rank of 8 data ranks reads about {format_bytes(reference / 8)}, of 32 about "
        f"{format_bytes(reference / 32)}, instead of all of it.\n"
    )
    print(table)
    print(note)
    if not ns.no_write:
        header = (
            "Bytes each trainer data rank reads per step (its part of the batch and the manifest) against "
            "the whole batch, through `asyncrl.transport.write_batch` / `read_batch_part` on a local disk.\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, shared (read times are warm page cache "
            "and noisy; bytes are exact).\n"
            f"Command: `PYTHONPATH=src python benchmarks/bench_batch_parts.py --samples {ns.samples} "
            f"--mean-tokens {ns.mean_tokens}`\n\n"
        )
        write_section("## Per-rank batches", f"## Per-rank batches\n\n{header}{table}\n\n{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

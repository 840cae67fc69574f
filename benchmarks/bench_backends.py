"""The same HTTP generation workload against the embedded engine and vLLM; and each one's update pause.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_backends.py [--write]

Both backends run as servers and are driven through the orchestrator's own seam (`HttpBackend`,
`VLLMBackend`): token-id prompts (16-64 tokens), greedy, EOS ignored so that both produce exactly
the requested tokens, at most `--concurrency` requests in flight. Two workloads: fixed output
length (`--fixed-tokens`) and mixed lengths (uniform in [16, `--max-tokens`]). Throughput counts
generated tokens over wall time, after a short warm-up. Servers (`--backends`): `embedded` (float32,
its exact mode), `embedded-bf16` and `vllm` (bfloat16, vLLM's CPU build).

The weight-update pause is measured as the orchestrator's updater drives it: one `update_weights` with
8 long requests in flight, the backend pausing itself for as long as it needs (keep mode). Each
update reports how long generation stalled (`paused_seconds`) and how long the checkpoint read took
(`load_seconds`); the table also gives the update's wall time. On the `--pause-preset` model
(default moe-50m), median of `--updates` updates. vLLM comes from `.venv-vllm` (`bash scripts/setup-vllm.sh`).
With --write the tables replace the `## Backends: embedded vs vLLM` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from asyncrl.client import HttpBackend, VLLMBackend
from asyncrl.config import InferenceConfig
from asyncrl.launcher.vllm import build_vllm_command
from asyncrl.tools.init_model import init_model
from asyncrl.wire import GenerateRequest, UpdateWeightsRequest

SECTION = "## Backends: embedded vs vLLM"
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(kind: str, model: Path, args: argparse.Namespace, log: Path) -> Iterator[str]:
    """One server of `kind` over `model`, in its own process group; yields its URL once healthy."""
    port = _free_port()
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if kind.startswith("embedded"):
        dtype = "bfloat16" if kind == "embedded-bf16" else "float32"
        argv = [
            sys.executable,
            "-m",
            "asyncrl",
            "inference",
            "--model",
            str(model),
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--device",
            "cpu",
            "--max-num-seqs",
            str(args.concurrency),
            "--kv-cache-tokens",
            "65536",
            "--log-level",
            "warning",
        ]
    else:
        cfg = InferenceConfig(
            model=str(model),
            backend="vllm",
            port=port,
            dtype="bfloat16",
            max_num_seqs=args.concurrency,
            max_model_len=1024,
            log_level="warning",
            vllm={"cpu_kv_cache_space_gb": 2},
        )
        command = build_vllm_command(cfg, python=args.vllm_python)
        argv, env = command.argv, env | command.env
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited with {proc.returncode}; log: {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind} server not healthy after 900 s; log: {log}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _backend(kind: str, url: str) -> HttpBackend:
    return (VLLMBackend if kind == "vllm" else HttpBackend)(url, timeout_s=1800)


def workload(n: int, seed: int, lengths: tuple[int, int]) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [
        GenerateRequest(
            prompt_token_ids=[rng.randrange(256) for _ in range(rng.randint(16, 64))],
            max_tokens=rng.randint(*lengths),
            temperature=0.0,
            ignore_eos=True,
            cache_salt=f"bench-{seed}",
        )
        for _ in range(n)
    ]


async def throughput(kind: str, url: str, requests: list[GenerateRequest], concurrency: int) -> float:
    """Generated tokens per second with at most `concurrency` requests in flight."""
    backend = _backend(kind, url)
    gate = asyncio.Semaphore(concurrency)

    async def one(r: GenerateRequest) -> int:
        async with gate:
            return len((await backend.generate(r)).token_ids)

    try:
        await asyncio.gather(*(one(r) for r in workload(8, 99, (8, 8))))  # warm-up
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(r) for r in requests)))
        return tokens / (time.perf_counter() - t0)
    finally:
        await backend.aclose()


async def update_pauses(kind: str, url: str, new_weights: Path, num_updates: int) -> list[dict[str, float]]:
    """Per update with 8 long requests in flight: stall, checkpoint read and wall time (seconds)."""
    backend = _backend(kind, url)
    results = []
    try:
        for version in range(1, num_updates + 1):
            busy = [asyncio.create_task(backend.generate(r)) for r in workload(8, version, (192, 192))]
            await asyncio.sleep(1.0)
            t0 = time.perf_counter()
            out = await backend.update_weights(UpdateWeightsRequest(path=str(new_weights), version=version))
            wall = time.perf_counter() - t0
            results.append({"paused": out.paused_seconds, "load": out.load_seconds, "wall": wall})
            await asyncio.gather(*busy)
    finally:
        await backend.aclose()
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-moe", help="model of the throughput runs")
    p.add_argument("--pause-preset", default="moe-50m", help="model of the update-pause runs")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--fixed-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256, help="mixed lengths: uniform in [16, this]")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--backends", default="embedded,embedded-bf16,vllm")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    return p


def main() -> None:
    args = _parser().parse_args()
    kinds = args.backends.split(",")
    tok_s: dict[tuple[str, str], float] = {}
    pauses: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init_model(args.preset, root / "tput", seed=0)
        init_model(args.pause_preset, root / "pause-v0", seed=0)
        init_model(args.pause_preset, root / "pause-v1", seed=1)
        loads = {
            "fixed": workload(args.requests, 0, (args.fixed_tokens, args.fixed_tokens)),
            "mixed": workload(args.requests, 1, (16, args.max_tokens)),
        }
        for kind in kinds:
            with serve(kind, root / "tput", args, root / f"{kind}-tput.log") as url:
                for name, reqs in loads.items():
                    tok_s[kind, name] = asyncio.run(throughput(kind, url, reqs, args.concurrency))
                    print(f"{kind:8s} {name:5s}: {tok_s[kind, name]:8.1f} tok/s", flush=True)
            with serve(kind, root / "pause-v0", args, root / f"{kind}-pause.log") as url:
                pauses[kind] = asyncio.run(update_pauses(kind, url, root / "pause-v1", args.updates))
                print(f"{kind:8s} update: {pauses[kind]}", flush=True)
    table = format_tables(args, kinds, tok_s, pauses)
    print(table)
    if args.write:
        write_section(REPO / "BENCHMARKS.md", table)


def format_tables(args, kinds, tok_s, pauses) -> str:
    vllm = "vllm" in kinds
    embedded = [k for k in kinds if k != "vllm"]
    rows = [
        "Command: `PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_backends.py --write`; vLLM from "
        "`scripts/setup-vllm.sh`'s venv.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, shared; one run. Model {args.preset}, "
        f"{args.requests} requests, token-id prompts of 16-64 tokens, concurrency {args.concurrency}, "
        "greedy, EOS ignored; `embedded` float32, `embedded-bf16` bfloat16, vLLM 0.32 CPU build bfloat16, "
        "all over HTTP through the orchestrator's backend classes.",
        "",
        f"| workload | {' | '.join(f'{k} tok/s' for k in kinds)} |"
        + "".join(f" {k} / vLLM |" for k in embedded if vllm),
        "|---" * (len(kinds) + 1 + (len(embedded) if vllm else 0)) + "|",
    ]
    for name, what in (
        ("fixed", f"fixed {args.fixed_tokens} tokens"),
        ("mixed", f"mixed 16-{args.max_tokens}"),
    ):
        cells = [f"{tok_s[k, name]:.0f}" for k in kinds]
        ratios = "".join(f" {tok_s[k, name] / tok_s['vllm', name]:.2f}x |" for k in embedded if vllm)
        rows.append(f"| {what} | {' | '.join(cells)} |{ratios}")
    rows += [
        "",
        f"Weight update on {args.pause_preset}, as the orchestrator drives it (one `update_weights`, 8 "
        f"requests in flight, the server pausing itself in keep mode); median of {args.updates}, seconds:",
        "",
        "| backend | generation paused | checkpoint read | update wall time | paused, all updates |",
        "|---|---|---|---|---|",
    ]
    for k in kinds:
        med = {key: statistics.median(p[key] for p in pauses[k]) for key in ("paused", "load", "wall")}
        every = ", ".join(f"{p['paused']:.3f}" for p in pauses[k])
        rows.append(f"| {k} | {med['paused']:.3f} | {med['load']:.3f} | {med['wall']:.3f} | {every} |")
    return "\n".join(rows)


def write_section(path: Path, table: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    body = f"{SECTION}\n\n`benchmarks/bench_backends.py` (docs/inference.md, Backends).\n\n{table}\n"
    section_re = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = section_re.sub(body, text) if section_re.search(text) else text.rstrip() + "\n\n" + body
    path.write_text(text.rstrip() + "\n")


if __name__ == "__main__":
    main()

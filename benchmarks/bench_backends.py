"""The same HTTP generation workload against the embedded engine and vLLM; and each one's update pause.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_backends.py [--write]

Both backends run as servers and are driven through the orchestrator's own seam (`HttpBackend`,
`VLLMBackend`): token-id prompts (16-64 tokens), greedy, EOS ignored so that both produce exactly
the requested tokens, at most `--concurrency` requests in flight. Two workloads: fixed output
length (`--fixed-tokens`) and mixed lengths (uniform in [16, `--max-tokens`]). Throughput counts
generated tokens over wall time, after a short warm-up. Servers (`--backends`): `embedded` (float32,
its exact mode), `embedded-bf16`, `embedded-sdpa` and `embedded-bf16-sdpa` (the same with
`cpu_decode_kernel = false`), `vllm` (bfloat16, vLLM's CPU build) and `vllm-fp32`; with
`--baseline-src DIR` (the `src` of another checkout, e.g. a git worktree of an older commit) also
`baseline` and `baseline-bf16`, the embedded engine of that checkout (added whether `--backends`
names them or not; no server runs twice, and an unknown name is refused). `--repeats N` runs every
server N times, in rounds (one server at a time), and reports each server's median and, for each
ratio, the median of its rounds' ratios (the two servers of a round ran minutes apart at most, so
the machine's drift between rounds moves it less than a ratio of medians), with their quartiles from
4 rounds on. `--interleave` keeps every server up for all rounds and runs each workload on the
servers back to back, odd rounds in reverse order: the two runs of a ratio are then seconds apart,
so the machine's drift moves it less still (the idle servers' CPU during each run is printed, and
its maximum stated under the tables). Every round has its own cache salt. The header gives the CPU,
its ISA and whether it has native bf16 (AVX512_BF16, AMX). A server that fails (does not start, or
dies during a workload) runs no more rounds; the tables keep the runs it completed, with "-" where
it has none, and a note under them says what failed.

The weight-update pause is measured as the orchestrator's updater drives it: one `update_weights` with
8 long requests in flight, the backend pausing itself for as long as it needs (keep mode). Each
update reports how long generation stalled (`paused_seconds`) and how long the checkpoint read took
(`load_seconds`); the table also gives the update's wall time. On the `--pause-preset` model
(default moe-50m), median of `--updates` updates. vLLM comes from `.venv-vllm` (`bash scripts/setup-vllm.sh`).
`--updates 0` skips the pauses. With --write the tables replace the `## Backends: embedded vs vLLM`
section of BENCHMARKS.md (or the `--section` named).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

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


@dataclass(frozen=True)
class Server:
    url: str
    pgid: int  # the server's processes (vLLM's engine core included) form this process group


def cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes of a process group (Linux /proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
                total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def serve(kind: str, model: Path, args: argparse.Namespace, log: Path) -> Iterator[Server]:
    """One server of `kind` over `model`, in its own process group; yields it once healthy."""
    port = _free_port()
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    dtype = "bfloat16" if "bf16" in kind or kind == "vllm" else "float32"
    if not kind.startswith("vllm"):
        if kind.startswith("baseline"):
            env["PYTHONPATH"] = args.baseline_src
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
        if kind.endswith("-sdpa"):
            argv += ["--cpu-decode-kernel", "false"]
    else:
        cfg = InferenceConfig(
            model=str(model),
            backend="vllm",
            port=port,
            dtype=dtype,
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
        yield Server(url=url, pgid=proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _backend(kind: str, url: str) -> HttpBackend:
    return (VLLMBackend if kind.startswith("vllm") else HttpBackend)(url, timeout_s=1800)


def workload(n: int, seed: int, lengths: tuple[int, int], rep: int = 0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [
        GenerateRequest(
            prompt_token_ids=[rng.randrange(256) for _ in range(rng.randint(16, 64))],
            max_tokens=rng.randint(*lengths),
            temperature=0.0,
            ignore_eos=True,
            cache_salt=f"bench-{seed}-{rep}",
        )
        for _ in range(n)
    ]


async def throughput(
    kind: str, server: Server, requests: list[GenerateRequest], concurrency: int, others: Sequence[int] = ()
) -> Rate:
    """Generated tokens per second with at most `concurrency` requests in flight, the server's CPU
    time per token (less sensitive than wall time to other jobs on a shared machine), and the CPU
    time that the idle servers (process groups `others`) took meanwhile, as a share of one core."""
    backend = _backend(kind, server.url)
    gate = asyncio.Semaphore(concurrency)

    async def one(r: GenerateRequest) -> int:
        async with gate:
            return len((await backend.generate(r)).token_ids)

    try:
        await asyncio.gather(*(one(r) for r in workload(8, 99, (8, 8))))  # warm-up
        t0, cpu0 = time.perf_counter(), cpu_seconds(server.pgid)
        idle0 = sum(cpu_seconds(g) for g in others)
        tokens = sum(await asyncio.gather(*(one(r) for r in requests)))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(server.pgid) - cpu0
        idle = sum(cpu_seconds(g) for g in others) - idle0
        return Rate(tok_s=tokens / wall, cpu_ms_per_token=1000 * cpu / tokens, others_cpu_share=idle / wall)
    finally:
        await backend.aclose()


@dataclass(frozen=True)
class Rate:
    tok_s: float
    cpu_ms_per_token: float
    others_cpu_share: float = 0.0


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
    p.add_argument("--baseline-src", help="`src` of another checkout: adds baseline and baseline-bf16")
    p.add_argument("--repeats", type=int, default=1, help="runs of every server, in rounds; median")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="keep every server up for all rounds and run each workload on them back to back",
    )
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    p.add_argument("--section", default=SECTION, help="the BENCHMARKS.md section --write replaces (or adds)")
    return p


KINDS = (
    "embedded",
    "embedded-bf16",
    "embedded-sdpa",
    "embedded-bf16-sdpa",
    "vllm",
    "vllm-fp32",
    "baseline",
    "baseline-bf16",
)


def server_kinds(backends: str, baseline_src: str | None) -> list[str]:
    """The servers of `--backends` in order, each once, and with `--baseline-src` the baseline's two
    (named there or not). Exits naming an unknown server, one named twice, or a baseline without
    `--baseline-src`."""
    kinds = [k.strip() for k in backends.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--backends: unknown server(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        raise SystemExit(f"--backends names {', '.join(twice)} more than once")
    if baseline_src:
        return kinds + [k for k in ("baseline", "baseline-bf16") if k not in kinds]
    if any(k.startswith("baseline") for k in kinds):
        raise SystemExit("--backends: the baseline servers need --baseline-src (the src of another checkout)")
    return kinds


def main() -> None:
    args = _parser().parse_args()
    kinds = server_kinds(args.backends, args.baseline_src)
    if args.baseline_src:
        args.baseline_src = str(Path(args.baseline_src).resolve())
    pauses: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init_model(args.preset, root / "tput", seed=0)
        init_model(args.pause_preset, root / "pause-v0", seed=0)
        init_model(args.pause_preset, root / "pause-v1", seed=1)
        runs, failed = run_rounds(args, kinds, root / "tput", root)
        # a server that failed keeps the rounds it completed (its later rounds did not run)
        ran = {k for k, _ in runs}
        kinds = [k for k in kinds if k in ran]
        for kind in [k for k in kinds if k not in failed] if args.updates else []:
            with serve(kind, root / "pause-v0", args, root / f"{kind}-pause.log") as server:
                pauses[kind] = asyncio.run(update_pauses(kind, server.url, root / "pause-v1", args.updates))
                print(f"{kind:8s} update: {pauses[kind]}", flush=True)
    tok_s = {key: [r.tok_s for r in rates] for key, rates in runs.items()}
    per_cpu_s = {key: [1000 / r.cpu_ms_per_token for r in rates] for key, rates in runs.items()}
    idle = max((r.others_cpu_share for rates in runs.values() for r in rates), default=0.0)
    table = format_tables(args, kinds, tok_s, per_cpu_s, pauses, idle)
    table += "".join(
        f"\n\n`{k}` failed: {why}"
        + ("; the tables have the runs it completed before that" if k in kinds else "")
        for k, why in failed.items()
    )
    print(table)
    if args.write:
        write_section(REPO / "BENCHMARKS.md", table, args.section)


def run_rounds(
    args: argparse.Namespace, kinds: list[str], model: Path, root: Path
) -> tuple[dict[tuple[str, str], list[Rate]], dict[str, str]]:
    """Every server's rate on every workload in each of `args.repeats` rounds, and the servers that
    failed (with why). Without `--interleave` a round starts each server in turn and runs both
    workloads on it; with it, every server stays up for all rounds, each workload runs on the servers
    back to back, and odd rounds take the servers in reverse order (so that a ratio pairs runs
    seconds apart and neither server always goes first)."""
    runs: dict[tuple[str, str], list[Rate]] = {}
    failed: dict[str, str] = {}
    live: dict[str, tuple[contextlib.ExitStack, Server]] = {}

    def server(kind: str) -> Server:
        if kind not in live:
            stack = contextlib.ExitStack()
            live[kind] = (stack, stack.enter_context(serve(kind, model, args, root / f"{kind}-tput.log")))
        return live[kind][1]

    def close(kind: str) -> None:
        if kind in live:
            live.pop(kind)[0].close()

    def fail(kind: str, rep: int, e: RuntimeError) -> None:
        failed[kind] = f"round {rep + 1} of {args.repeats}: {e}"
        print(f"{kind}: {e}\n{_log_tail(root / f'{kind}-tput.log')}", flush=True)
        close(kind)

    try:
        for kind in kinds if args.interleave else []:  # all up before the first run
            try:
                server(kind)
            except RuntimeError as e:  # a server that does not start here (vLLM in fp32, say)
                fail(kind, 0, e)
        for rep in range(args.repeats):
            loads = {  # a fresh cache salt each round: no round reuses an earlier one's prefixes
                "fixed": workload(args.requests, 0, (args.fixed_tokens, args.fixed_tokens), rep),
                "mixed": workload(args.requests, 1, (16, args.max_tokens), rep),
            }
            order = kinds[::-1] if args.interleave and rep % 2 else kinds
            if args.interleave:
                steps = [(k, n) for n in loads for k in order]
            else:
                steps = [(k, n) for k in order for n in loads]
            for i, (kind, name) in enumerate(steps):
                if kind in failed:
                    continue
                others = [s.pgid for k, (_, s) in live.items() if k != kind]
                try:
                    rate = asyncio.run(throughput(kind, server(kind), loads[name], args.concurrency, others))
                except RuntimeError as e:  # a server that does not start or dies
                    fail(kind, rep, e)
                    continue
                runs.setdefault((kind, name), []).append(rate)
                print(
                    f"run {rep}: {kind:13s} {name:5s}: {rate.tok_s:8.1f} tok/s, "
                    f"{rate.cpu_ms_per_token:.3f} CPU ms/token"
                    + (f", idle servers {rate.others_cpu_share:.1%} of a core" if others else ""),
                    flush=True,
                )
                if not args.interleave and (i + 1 == len(steps) or steps[i + 1][0] != kind):
                    close(kind)
    finally:
        for kind in list(live):
            close(kind)
    return runs, failed


def _argv() -> str:
    return " ".join(shlex.quote(a) for a in sys.argv[1:])


def _log_tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def machine_line() -> str:
    """The CPU, its core count and the ISA flags that decide bf16 kernels."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    flags = [torch.backends.cpu.get_cpu_capability()]
    flags += ["AVX512_BF16"] * torch.cpu._is_avx512_bf16_supported()
    flags += ["AMX"] * torch.cpu._is_amx_tile_supported()
    native = "native bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no native bf16"
    return f"{model}, {os.cpu_count()} cores; ISA {' '.join(flags)} ({native}); torch {torch.__version__}"


def format_tables(args, kinds, tok_s, per_cpu_s, pauses, idle_share: float = 0.0) -> str:
    """tok_s, per_cpu_s: each (server, workload)'s rate in every round it ran; idle_share: the most
    CPU that the idle servers took during one run, in cores (interleaved rounds)."""
    if args.interleave:
        rounds = (
            "in interleaved rounds (every server up throughout; each workload ran on the servers back "
            "to back, odd rounds in reverse order; the idle servers took at most "
            f"{idle_share:.1%} of a core during a run)"
        )
    else:
        rounds = "in rounds (each server started for its runs and stopped after them)"
    spread = " (in brackets: the middle half of the rounds' ratios)" if args.repeats >= 4 else ""
    omp = os.environ.get("OMP_NUM_THREADS")
    rows = [
        f"Command: `PYTHONPATH=src {f'OMP_NUM_THREADS={omp} ' if omp else ''}python "
        f"benchmarks/bench_backends.py {_argv()}`; vLLM from `scripts/setup-vllm.sh`'s venv "
        f"(the embedded servers run {torch.get_num_threads()} torch thread(s)).",
        "",
        f"Machine: {machine_line()}; shared. Median of {args.repeats} run(s) of each server, {rounds}; "
        f"a ratio is the median of the rounds' ratios{spread}. "
        f"Model {args.preset}, {args.requests} requests, token-id prompts of 16-64 tokens, concurrency "
        f"{args.concurrency}, greedy, EOS ignored; `-bf16`/`vllm` bfloat16, "
        "`embedded`/`baseline`/`vllm-fp32` "
        "float32, all over HTTP through the orchestrator's backend classes.",
        "",
        "Generated tokens per second (wall time):",
        "",
        *_rate_table(args, kinds, tok_s, "tok/s"),
        "",
        "Generated tokens per CPU second of the server's processes (user + system; other jobs on the "
        "machine inflate it less than wall time):",
        "",
        *_rate_table(args, kinds, per_cpu_s, "tok/CPU-s"),
    ]
    if not pauses:
        return "\n".join(rows)
    rows += [
        "",
        f"Weight update on {args.pause_preset}, as the orchestrator drives it (one `update_weights`, 8 "
        f"requests in flight, the server pausing itself in keep mode); median of {args.updates}, seconds:",
        "",
        "| backend | generation paused | checkpoint read | update wall time | paused, all updates |",
        "|---|---|---|---|---|",
    ]
    for k in [k for k in kinds if k in pauses]:
        med = {key: statistics.median(p[key] for p in pauses[k]) for key in ("paused", "load", "wall")}
        every = ", ".join(f"{p['paused']:.3f}" for p in pauses[k])
        rows.append(f"| {k} | {med['paused']:.3f} | {med['load']:.3f} | {med['wall']:.3f} | {every} |")
    return "\n".join(rows)


def _rate_table(args, kinds: list[str], rounds: dict[tuple[str, str], list[float]], unit: str) -> list[str]:
    """One row per workload: each server's median rate over its rounds, then ratios against vLLM
    (and embedded fp32 against vLLM fp32), bf16 / fp32 and baseline, each the median over the rounds
    both servers ran of that round's ratio."""
    ref = next((k for k in kinds if k.startswith("vllm")), None)
    ratios = [(k, ref) for k in kinds if ref and not k.startswith("vllm")]
    pairs = (
        ("embedded", "vllm-fp32"),  # fp32 against fp32 (the first vLLM server is the reference above)
        ("embedded-bf16", "embedded"),
        ("baseline-bf16", "baseline"),
        ("vllm", "vllm-fp32"),
        ("embedded", "embedded-sdpa"),
        ("embedded-bf16", "embedded-bf16-sdpa"),
    )
    ratios += [(b, f) for b, f in pairs if b in kinds and f in kinds]
    ratios += [
        (k, f"baseline{k[8:]}")
        for k in ("embedded", "embedded-bf16")
        if k in kinds and f"baseline{k[8:]}" in kinds
    ]
    rows = [
        f"| workload | {' | '.join(f'{k} {unit}' for k in kinds)} |"
        + "".join(f" {a} / {b} |" for a, b in ratios),
        "|---" * (len(kinds) + 1 + len(ratios)) + "|",
    ]
    for name, what in (
        ("fixed", f"fixed {args.fixed_tokens} tokens"),
        ("mixed", f"mixed 16-{args.max_tokens}"),
    ):
        cells = [f"{statistics.median(rounds[k, name]):.0f}" if (k, name) in rounds else "-" for k in kinds]
        paired = [
            [x / y for x, y in zip(rounds[a, name], rounds[b, name], strict=False)]
            if (a, name) in rounds and (b, name) in rounds
            else []
            for a, b in ratios
        ]  # a server that failed has its first rounds only: zip pairs them with the other's
        shown = "".join(f" {_ratio(r)} |" for r in paired)
        rows.append(f"| {what} | {' | '.join(cells)} |{shown}")
    return rows


def _ratio(rounds: list[float]) -> str:
    """The median of the rounds' ratios; with 4 rounds or more, also their quartiles."""
    if not rounds:
        return "-"
    if len(rounds) < 4:
        return f"{statistics.median(rounds):.2f}x"
    low, mid, high = statistics.quantiles(rounds, n=4)
    return f"{mid:.2f}x ({low:.2f}-{high:.2f})"


def write_section(path: Path, table: str, section: str = SECTION) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    body = f"{section}\n\n`benchmarks/bench_backends.py` (docs/inference.md, Backends).\n\n{table}\n"
    section_re = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = section_re.sub(body, text) if section_re.search(text) else text.rstrip() + "\n\n" + body
    path.write_text(text.rstrip() + "\n")


if __name__ == "__main__":
    main()

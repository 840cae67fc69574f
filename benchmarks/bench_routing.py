"""Routing over 4 embedded servers: cache_aware vs least_loaded vs random on multi-turn episodes.

    python benchmarks/bench_routing.py [--servers 4] [--groups 48] [--write]

Starts `--servers` embedded servers (tiny-moe, float32, one thread each) and drives them through
the orchestrator's `ServerPool` with each routing mode in turn. The workload is agentic: every
task opens with one of `--system-prompts` shared system prompts, then a long prompt of its own (a
task statement, files); `--group-size` episodes of a task start within `--start-jitter-s` of each
other (a GRPO group whose sandboxes come up), and each runs `--turns` turns, every turn adding the
reply and a tool output (after `--tool-latency-s`, while its KV sits unreferenced) to the prompt.
`--concurrency` groups are in flight at once, and a server's KV pool holds about three episodes:
the KV is under pressure, as it is with long agentic contexts on real servers. Each mode salts its
requests with its own name, so no mode is served blocks another computed, and all modes run on the
same servers in turn.

Reports per mode: the prefix-cache hit rate the orchestrator sees (cached prompt tokens over prompt
tokens, from the responses), the servers' own block hit rate (deltas of their
`asyncrl_prefix_cache_{hits,queries}_total`), the prompt tokens prefilled (not served from the
cache), and throughput: generated tokens per second of wall time, and the servers' CPU time per
turn (what the prefill saved costs, less sensitive to other jobs on a shared machine). The modes
run `--repeats` rounds, interleaved; the table gives medians. `--write` replaces the section
"## Routing: cache-aware vs least-loaded vs random" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from asyncrl.client import build_backends
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.routing import Router
from asyncrl.tools.init_model import init_model
from asyncrl.wire import SamplingParams
from report import write_section

SECTION = "## Routing: cache-aware vs least-loaded vs random"
MODES = ("cache_aware", "least_loaded", "random")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: Path, n: int, args: argparse.Namespace, logs: Path) -> Iterator[tuple[list[str], list[int]]]:
    """`n` embedded servers over `model`, one OpenMP thread each; yields their URLs and pids once healthy."""
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs, urls = [], []
    try:
        for i in range(n):
            port = _free_port()
            argv = [sys.executable, "-m", "asyncrl", "inference", "--model", str(model), "--port", str(port)]
            argv += ["--dtype", "float32", "--device", "cpu", "--log-level", "warning"]
            argv += ["--kv-cache-tokens", str(args.kv_cache_tokens), "--max-num-seqs", "64"]
            with (logs / f"server{i}.log").open("w") as out:
                procs.append(
                    subprocess.Popen(
                        argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server {url} exited with {proc.returncode}; logs in {logs}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server {url} not healthy after 300 s; logs in {logs}")
                time.sleep(0.5)
        yield urls, [proc.pid for proc in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes, all their threads (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (after the name: state, ppid, ...)
    return total / os.sysconf("SC_CLK_TCK")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


@dataclass
class Workload:
    system_prompts: list[list[int]]
    args: argparse.Namespace

    def task_prompt(self, task: int) -> list[int]:
        rng = random.Random(f"task-{task}")
        return [*self.system_prompts[task % len(self.system_prompts)], *_tokens(rng, self.args.user_tokens)]

    async def episode(self, pool: ServerPool, run: str, task: int, member: int) -> tuple[int, int]:
        """One episode of `--turns` turns, salted with `run`; returns (generated tokens, turns)."""
        session = pool.session(f"{run}/{task}/{member}", cache_salt=lambda: run)
        prompt = self.task_prompt(task)
        rng = random.Random(f"{run}-{task}-{member}")
        sampling = SamplingParams(temperature=1.0, max_tokens=self.args.reply_tokens, ignore_eos=True)
        generated = 0
        await asyncio.sleep(rng.uniform(0, self.args.start_jitter_s))  # its sandbox starts
        for _ in range(self.args.turns):
            out = await session.generate(prompt, sampling)
            generated += len(out.token_ids)
            await asyncio.sleep(self.args.tool_latency_s)  # the tool runs; the KV sits unreferenced
            prompt = [*prompt, *out.token_ids, *_tokens(rng, self.args.tool_tokens)]
        pool.end_session(f"{run}/{task}/{member}")
        return generated, self.args.turns


async def _block_counters(urls: list[str]) -> tuple[float, float]:
    """Sum over servers of (prefix-cache block hits, block queries) from their /metrics."""
    hits = queries = 0.0
    async with httpx.AsyncClient(timeout=10) as http:
        for url in urls:
            text = (await http.get(f"{url}/metrics")).text
            hits += float(re.search(r"^asyncrl_prefix_cache_hits_total (\S+)", text, re.M).group(1))
            queries += float(re.search(r"^asyncrl_prefix_cache_queries_total (\S+)", text, re.M).group(1))
    return hits, queries


async def run_mode(
    mode: str, run: str, servers: tuple[list[str], list[int]], work: Workload, args: argparse.Namespace
) -> dict[str, float]:
    """One pass of the workload routed by `mode`, its requests salted with `run`."""
    urls, pids = servers
    router = Router(
        mode, max_extra_requests=args.max_extra_requests, max_extra_kv=args.max_extra_kv, seed=args.seed
    )
    pool = ServerPool(build_backends(urls, timeout_s=1800), router=router)
    await pool.poll_loads()
    poller = asyncio.create_task(pool.load_loop(1.0))
    gate = asyncio.Semaphore(args.concurrency)

    async def group(task: int) -> list[tuple[int, int]]:
        async with gate:
            return await asyncio.gather(*(work.episode(pool, run, task, m) for m in range(args.group_size)))

    hits0, queries0 = await _block_counters(urls)
    t0, cpu0 = time.perf_counter(), cpu_seconds(pids)
    try:
        done = await asyncio.gather(*(group(t) for t in range(args.groups)))
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pids) - cpu0
    hits1, queries1 = await _block_counters(urls)
    stats = pool.stats
    generated = sum(g for grp in done for g, _ in grp)
    turns = sum(t for grp in done for _, t in grp)
    await pool.aclose()
    return {
        "hit_rate": stats.cached_tokens / stats.prompt_tokens,
        "block_hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1),
        "prompt_tokens": stats.prompt_tokens,
        "prefilled": stats.prompt_tokens - stats.cached_tokens,
        "tok_s": generated / wall,
        "turns_s": turns / wall,
        "wall_s": wall,
        "cpu_ms_per_turn": 1000 * cpu / turns,
    }


def machine_line() -> str:
    model = "unknown CPU"
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"
    amx = "AMX" if "amx_tile" in flags else "no AMX"
    return f"{model}, {os.cpu_count()} cores, {isa}, {amx}"


def format_table(results: dict[str, dict[str, float]], args: argparse.Namespace, run: str) -> str:
    """The BENCHMARKS.md section; `run` says how long the run took and how loaded the machine was."""
    base = results["least_loaded"]
    lines = [
        SECTION,
        "",
        f"`{' '.join(['PYTHONPATH=src python benchmarks/bench_routing.py', *sys.argv[1:]])}`: "
        f"{args.servers} embedded servers "
        f"(tiny-moe, float32, one thread and {args.kv_cache_tokens} KV tokens each), driven through the "
        f"orchestrator's `ServerPool`. {args.groups} groups of {args.group_size} episodes, "
        f"{args.concurrency} groups in flight; {args.system_prompts} shared system prompts of "
        f"{args.system_tokens} tokens, "
        f"a {args.user_tokens}-token prompt of each task's own, {args.turns} turns of {args.reply_tokens} "
        f"sampled + {args.tool_tokens} tool tokens ({args.tool_latency_s} s per tool call, episodes "
        f"starting within {args.start_jitter_s} s of their group). "
        f"Machine: {machine_line()}; medians of {args.repeats} "
        "rounds of all modes, interleaved, on a machine shared with other jobs (wall-time throughput is "
        f"noisy; the servers' CPU time per turn much less so). {run}. Run in a working tree of this "
        "repository, not a fresh clone. Goal: cache_aware at least 1.5x the hit rate of least_loaded, "
        "throughput not lower.",
        "",
        "| routing | hit rate (responses) | x least_loaded | block hit rate (servers) | prompt tokens "
        "| prefilled | gen tok/s | x least_loaded | server CPU ms/turn | x least_loaded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {r['hit_rate']:.3f} | {r['hit_rate'] / max(base['hit_rate'], 1e-9):.2f} "
            f"| {r['block_hit_rate']:.3f} | {r['prompt_tokens']:.0f} | {r['prefilled']:.0f} "
            f"| {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f} | {r['cpu_ms_per_turn']:.1f} "
            f"| {r['cpu_ms_per_turn'] / base['cpu_ms_per_turn']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--groups", type=int, default=48, help="tasks; each a group of --group-size episodes")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="groups in flight")
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=1024, help="the task's own prompt after the system one")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--tool-tokens", type=int, default=64)
    p.add_argument("--start-jitter-s", type=float, default=0.5, help="episode starts: uniform in [0, this]")
    p.add_argument("--tool-latency-s", type=float, default=0.5, help="per turn, between reply and next turn")
    p.add_argument("--kv-cache-tokens", type=int, default=4096, help="per server")
    p.add_argument("--seed", type=int, default=0)
    defaults = OrchestratorConfig.model_fields
    p.add_argument("--max-extra-requests", type=int, default=defaults["routing_max_extra_requests"].default)
    p.add_argument("--max-extra-kv", type=float, default=defaults["routing_max_extra_kv"].default)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=2, help="rounds of all modes; the table gives medians")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    return p


def main() -> None:
    args = _parser().parse_args()
    rng = random.Random(args.seed)
    work = Workload([_tokens(rng, args.system_tokens) for _ in range(args.system_prompts)], args)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init_model("tiny-moe", root / "model", seed=0)
        modes = args.modes.split(",")
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        with serve(root / "model", args.servers, args, root) as servers:
            for repeat in range(args.repeats):  # modes interleaved, so that a busy spell hits them alike
                for mode in modes:
                    runs[mode].append(asyncio.run(run_mode(mode, f"{mode}/{repeat}", servers, work, args)))
                    print(mode, repeat, {k: round(v, 3) for k, v in runs[mode][-1].items()}, flush=True)
    results = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    run = (
        f"{time.monotonic() - t0:.0f} s in all; 1-minute load average (this run and other jobs) "
        f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    table = format_table(results, args, run)
    print(table)
    if args.write:
        write_section(SECTION, table)


if __name__ == "__main__":
    main()

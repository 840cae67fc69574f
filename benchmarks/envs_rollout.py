"""Environment-side costs: stitching per turn vs episode length, sandbox start-up, latency-knob tails.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/envs_rollout.py [--write]

Prints a table; `--write` replaces the `## envs` section of BENCHMARKS.md. Ratios compare numbers
measured in the same run (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.config import EnvConfig, LatencyConfig
from asyncrl.envs import (
    ChatTokenizer,
    Environment,
    Reward,
    Rubric,
    ScriptedClient,
    Task,
    TokenPolicy,
    build_env,
    run_episode,
)
from asyncrl.envs.sandbox import Sandbox, probe_isolation
from asyncrl.wire import SamplingParams


class EchoEnv(Environment):
    """N turns of ~40-byte model and env messages: isolates the env-side cost per turn."""

    name = "echo"
    rubric = Rubric(rewards=(Reward(name="one", fn=lambda s: 1.0),))

    def __init__(self, *, seed: int = 0, turns: int = 10) -> None:
        super().__init__(seed=seed)
        self.max_turns = turns

    def task(self, split, index):
        return Task(id=f"echo/{index}", prompt=[{"role": "user", "content": "start"}])

    def reference(self, task):
        return []

    async def respond(self, state, text):
        return [{"role": "user", "content": f"observation {state.num_turns}: all fine so far, go on"}]


def _policy(tok, cfg, replies):
    return TokenPolicy(ScriptedClient(tok, replies), tok, SamplingParams(max_tokens=64), config=cfg)


def bench_stitching(tok: ChatTokenizer) -> list[tuple[str, float, str]]:
    rows = []
    base = None
    for turns in (3, 10, 50, 200):
        env = EchoEnv(turns=turns)
        cfg = EnvConfig(name="echo", max_total_tokens=1 << 20)
        replies = lambda i, _: f"action {i}: looking at the next thing now"  # noqa: E731
        t0 = time.perf_counter()
        ep = asyncio.run(
            run_episode(env, env.task("train", 0), _policy(tok, cfg, replies), config=cfg, episode_id="b")
        )
        per_turn_ms = (time.perf_counter() - t0) / turns * 1e3
        if turns == 3:
            continue  # warm-up: compiles the chat template
        base = base or per_turn_ms
        tokens = ep.samples[0].num_tokens
        rows.append(
            (
                f"stitch: {turns}-turn episode ({tokens} tokens), ms/turn",
                per_turn_ms,
                f"{per_turn_ms / base:.1f}x vs 10 turns",
            )
        )
    return rows


def bench_sandbox(n: int = 20) -> list[tuple[str, float, str]]:
    t0 = time.perf_counter()
    for _ in range(n):
        subprocess.run([sys.executable, "-I", "-S", "-c", "print(1)"], capture_output=True, check=True)
    plain_ms = (time.perf_counter() - t0) / n * 1e3
    box = Sandbox(allow_weak_isolation=True)
    box.write_file("main.py", "print(1)")

    async def runs():
        for _ in range(n):
            result = await box.run_python("main.py")
            assert result.ok, result

    t0 = time.perf_counter()
    asyncio.run(runs())
    box_ms = (time.perf_counter() - t0) / n * 1e3
    box.close()
    boundary = probe_isolation().mode
    return [
        ("sandbox: plain `python -I -S` subprocess, ms/run (baseline)", plain_ms, "1.0x"),
        (f"sandbox: run_python ({boundary}), ms/run", box_ms, f"{box_ms / plain_ms:.1f}x"),
    ]


def bench_latency(tok: ChatTokenizer, n: int = 32) -> list[tuple[str, float, str]]:
    env = build_env("reverse-text")
    cfg = EnvConfig(name="reverse-text", latency=LatencyConfig(median_s=0.02, sigma=1.5, max_s=2.0))

    async def one(i):
        task = env.task("train", i)
        return await run_episode(env, task, _policy(tok, cfg, [task.answer]), config=cfg, episode_id=f"e{i}")

    async def sequential():
        return [await one(i) for i in range(n)]

    async def concurrent():
        return await asyncio.gather(*(one(i) for i in range(n)))

    t0 = time.perf_counter()
    eps = asyncio.run(sequential())
    seq_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    asyncio.run(concurrent())
    conc_s = time.perf_counter() - t0
    walls = sorted(e.metrics["wall_s"] for e in eps)
    tail = walls[-1] / statistics.median(walls)
    return [
        (f"latency knob (median 20 ms, sigma 1.5): {n} episodes sequential, s", seq_s, "1.0x"),
        (f"latency knob: {n} episodes concurrent, s", conc_s, f"{seq_s / conc_s:.1f}x faster"),
        ("latency knob: slowest / median episode wall time", tail, "heavy tail"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        from asyncrl.model.tokenizer import save_byte_tokenizer

        save_byte_tokenizer(d)
        tok = ChatTokenizer.from_pretrained(d)
    rows = bench_stitching(tok) + bench_sandbox() + bench_latency(tok)
    width = max(len(r[0]) for r in rows)
    table = [f"| {'measurement':<{width}} | value | ratio |", f"|{'-' * (width + 2)}|---:|---|"]
    table += [f"| {name:<{width}} | {value:.2f} | {ratio} |" for name, value, ratio in rows]
    print("\n".join(table))
    if args.write:
        _write_section("\n".join(table))


def _write_section(table: str) -> None:
    path = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    machine = (
        f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}, "
        "shared 2-core box"
    )
    section = (
        "## envs\n\n"
        f"Machine: {machine}. Command: `PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/envs_rollout.py "
        "--write`.\n"
        "The scripted client makes generation free, so these are environment-side costs only.\n\n"
        f"{table}\n"
    )
    head, sep, rest = text.partition("## envs\n")
    if sep:
        tail = rest[rest.find("\n## ") + 1 :] if "\n## " in rest else ""
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()

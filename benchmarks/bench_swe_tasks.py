"""The shipped SWE task set: verified row by row, run through the `swe` env by scripted agents, and
(with `--rl`) trained on by a tiny random model.

    bash scripts/setup-swe-tasks.sh                         # once: the tasks' repositories
    PYTHONPATH=src python benchmarks/bench_swe_tasks.py [--tasks examples/swe/tasks.jsonl] [--rl] [--write]

1. `asyncrl swe-tasks --verify` on every row, one at a time (a row's test runs then do not compete
   with each other): a fresh checkout of base_commit, the row's test_cmd on FAIL_TO_PASS +
   PASS_TO_PASS, the reference patch, the same tests again.
2. The `swe` env on every row (eval split = the whole file), as `asyncrl eval-env --agent
   reference` and `--agent noop` run it: each task's reference fix applied through the env's tools
   and graded in its bwrap sandbox (must score 1.0 on every task), and the untouched bug (0).
3. `--rl`: `asyncrl rl @ examples/swe/rl.toml` in a fresh run directory (a tiny-moe model made first
   when missing), timed, and its metrics.jsonl summarised: episodes per minute, tool calls, named
   rewards and sandbox figures per episode, trainer seconds per step.

`--write` replaces the "SWE task set" section of BENCHMARKS.md. Run from the repository root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import EnvConfig
from asyncrl.envs import build_env
from asyncrl.envs.builtin.swe.tasks import read_tasks
from asyncrl.tools.endpoint_eval import evaluate, scripted_agent, summarize
from asyncrl.tools.swe_tasks import verify_tasks
from asyncrl.tools.swe_tasks.verify import verify_report
from report import write_section

RL_CONFIG = "examples/swe/rl.toml"
RL_MODEL = "outputs/swe/base"
RL_RUN = "outputs/swe/bench-rl"


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _verify(tasks_file: str) -> str:
    tasks = read_tasks(tasks_file)
    t0 = time.monotonic()
    verdicts = verify_tasks(tasks, jobs=1, log=_log)
    return f"{verify_report(tasks, verdicts)}\n\n({len(tasks)} rows in {time.monotonic() - t0:.0f} s)"


def _eval_env(tasks_file: str, concurrency: int) -> str:
    rows = [
        "| agent | episodes | in flight | reward mean / min | fail_to_pass | pass_to_pass | grading errors "
        "| test run s (mean) | wall s | episodes/min |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for agent in ("reference", "noop"):
        env = build_env("swe", {"tasks": tasks_file, "eval_tasks": tasks_file})
        num = env.table.size("eval")
        t0 = time.monotonic()
        try:
            episodes = asyncio.run(
                evaluate(
                    env,
                    scripted_agent(agent, env),
                    config=EnvConfig(name="swe"),
                    num=num,
                    concurrency=concurrency,
                )
            )
        finally:
            env.close()
        wall_s, s = time.monotonic() - t0, summarize(episodes)
        _log(f"eval-env --agent {agent}: {json.dumps(s)}")
        rows.append(
            f"| {agent} | {num} | {concurrency} | {s['reward']:.3f} / {s['reward_min']:.3f} "
            f"| {s['rewards/fail_to_pass']:.3f} | {s['rewards/pass_to_pass']:.3f} "
            f"| {s['rewards/grading_error'] * num:.0f} | {s['rewards/test_run_s']:.2f} | {wall_s:.0f} "
            f"| {num / wall_s * 60:.0f} |"
        )
    return "\n".join(rows)


def _run_rl() -> tuple[Path, float]:
    if not Path(RL_MODEL, "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "asyncrl", "init-model", "--preset", "tiny-moe", "--out", RL_MODEL],
            check=True,
        )
    shutil.rmtree(RL_RUN, ignore_errors=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "asyncrl", "rl", "@", RL_CONFIG, "--run_dir", RL_RUN], check=True)
    return Path(RL_RUN), time.monotonic() - t0


def _weighted(records: list[dict], name: str) -> float:
    """The mean over every episode of the run of `env/swe/<name>` (each record holds its step's mean)."""
    n = [r["env/swe/episodes"] for r in records]
    return sum(r.get(f"env/swe/{name}", 0.0) * k for r, k in zip(records, n)) / sum(n)


def _rl_summary(run: Path, wall_s: float) -> str:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    orch = [r for r in records if r["role"] == "orchestrator" and "env/swe/episodes" in r]
    trainer = [r for r in records if r["role"] == "trainer"]
    episodes = sum(r["env/swe/episodes"] for r in orch)
    names = (
        "num_tool_calls",
        "num_turns",
        "resolved",
        "fail_to_pass",
        "pass_to_pass",
        "grading_error",
        "sandbox_start_s",
        "sandbox_warm",
        "test_run_s",
        "wall_s",
        "stop_max_tokens",
    )
    means = {n: _weighted(orch, n) for n in names}
    return (
        f"`asyncrl rl @ {RL_CONFIG}` ({len(trainer)} steps, {wall_s:.0f} s from the launch, servers' start "
        f"included): {episodes:.0f} episodes, {episodes / wall_s * 60:.1f} episodes/min; trainer "
        f"{statistics.median(r['seconds'] for r in trainer):.0f} s per step (median; "
        f"{statistics.median(r['tokens_per_s'] for r in trainer):.0f} tokens/s), which bounds the run "
        "(max_async_steps = 1). Per episode (means of the `env/swe/*` metrics):\n\n"
        "| tool calls | turns | resolved | fail_to_pass | pass_to_pass | grading errors | sandbox start s "
        "| warm starts | test run s | episode wall s | stopped at the token budget |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        f"| {means['num_tool_calls']:.2f} | {means['num_turns']:.2f} | {means['resolved']:.3f} "
        f"| {means['fail_to_pass']:.3f} | {means['pass_to_pass']:.3f} | {means['grading_error']:.3f} "
        f"| {means['sandbox_start_s']:.2f} | {means['sandbox_warm']:.0%} | {means['test_run_s']:.1f} "
        f"| {means['wall_s']:.1f} | {means['stop_max_tokens']:.0%} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="examples/swe/tasks.jsonl")
    parser.add_argument("--concurrency", type=int, default=4, help="episodes in flight in part 2")
    parser.add_argument("--rl", action="store_true", help=f"part 3: {RL_CONFIG}, about 15 min here")
    parser.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    args = parser.parse_args()
    load0, t0 = os.getloadavg()[0], time.monotonic()
    verify = _verify(args.tasks)
    print(verify)
    env_eval = _eval_env(args.tasks, args.concurrency)
    print(env_eval)
    rl = _rl_summary(*_run_rl()) if args.rl else None
    if rl:
        print(rl)
    wall_s, load1 = time.monotonic() - t0, os.getloadavg()[0]
    if args.write:
        machine = f"{platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}"
        command = f"PYTHONPATH=src python benchmarks/bench_swe_tasks.py --tasks {args.tasks}"
        command += f" --concurrency {args.concurrency}{' --rl' if args.rl else ''} --write"
        body = (
            "## SWE task set\n\n"
            f"Machine: {machine}; load average (other jobs on the machine) {load0:.1f} at the start, "
            f"{load1:.1f} at the end. Command: `{command}` ({wall_s:.0f} s), one run. The shipped set "
            "(examples/swe: 24 toolz and 8 inflection tasks, at most 20 PASS_TO_PASS each).\n\n"
            "Every row verified one at a time (`asyncrl swe-tasks --verify`): F2P before = the share of "
            "FAIL_TO_PASS passing at base_commit (the bug must score 0), F2P / P2P after = with the "
            "reference patch (it must score 1); a test run is one row's test_cmd on its FAIL_TO_PASS + "
            "PASS_TO_PASS, pytest's start included.\n\n"
            f"{verify}\n\n"
            "The `swe` env on every row, as `asyncrl eval-env --agent reference|noop --env swe --env-args "
            f'\'{{"tasks": "{args.tasks}", "eval_tasks": "{args.tasks}"}}\' --num 32` runs it: the '
            "reference fix applied through the env's tools and graded in the episode's sandbox, or the "
            "bug left as it is.\n\n"
            f"{env_eval}\n" + (f"\n{rl}\n" if rl else "")
        )
        write_section("## SWE task set", body)


if __name__ == "__main__":
    main()

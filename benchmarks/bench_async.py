"""Asynchronous versus synchronous RL on the same env with heavy-tailed latency, in one run.

    python benchmarks/bench_async.py [--steps 8] [--median-s 0.4] [--sigma 1.2] [--no-write]

Runs `asyncrl rl` twice on a fresh tiny MoE (`reverse-text`, lognormal delay on every episode step):
once with max_async_steps = 0 (synchronous, on-policy) and once with max_async_steps = 2
(max_off_policy_steps = 2). Reports wall time for N steps, the speed-up, the final reward, and how
long inference sat idle waiting for weights. Appends a section "## Async vs sync" to BENCHMARKS.md.
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

from report import write_section

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(model: Path, run_dir: Path, steps: int, median_s: float, sigma: float, lag: int) -> str:
    return f"""
model = "{model}"
run_dir = "{run_dir}"
max_steps = {steps}
seq_len = 1024

[deployment]
base_port = {_free_port()}

[inference]
max_num_seqs = 64

[orchestrator]
batch_size = 32
group_size = 8
max_async_steps = {lag}
max_off_policy_steps = {lag}
sampling = {{ temperature = 1.0, max_tokens = 12 }}

[[orchestrator.envs.envs]]
name = "reverse-text"
latency = {{ median_s = {median_s}, sigma = {sigma} }}

[trainer]
optim = {{ lr = 1e-4 }}
"""


def run_mode(model: Path, work: Path, name: str, lag: int, a) -> dict:
    run_dir = work / name
    cfg = work / f"{name}.toml"
    cfg.write_text(_config(model, run_dir, a.steps, a.median_s, a.sigma, lag))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "rl", "@", str(cfg)], capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    orch = [r for r in records if r.get("role") == "orchestrator"]
    trainer = [r for r in records if r.get("role") != "orchestrator"]
    # steady state: trainer steps 2..N (start-up and the first batch excluded), and how much of each
    # step the trainer spent busy rather than waiting for its batch
    rewards = [r["reward/mean"] for r in orch if "reward/mean" in r]  # steps where episodes finished
    times = [r["time"] for r in trainer]
    step_s = (times[-1] - times[0]) / max(len(times) - 1, 1)
    waits = [r["wait_s"] for r in trainer[1:]]
    return {
        "mode": name,
        "wall_s": wall,
        "step_s": step_s,
        "trainer_busy_s": step_s - sum(waits) / max(len(waits), 1),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "idle_s": sum(r["inference/idle_s"] for r in orch),
        "staleness_max": max(r["staleness/max"] for r in orch),
        "trainer_steps": len(trainer),
        # work that trained nothing: groups dispatched per batch (4 would waste none), and why
        "groups_per_step": orch[-1]["groups/dispatched_total"] / len(orch),
        "dropped_stale": orch[-1]["dropped/groups_stale_in_flight"]
        + sum(r["dropped/groups_stale_queue"] for r in orch),
        "dropped_zero_adv": orch[-1]["dropped/groups_zero_advantage"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--median-s", type=float, default=0.4)
    p.add_argument("--sigma", type=float, default=1.2)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run([sys.executable, "-m", "asyncrl", "init-model", "--out", str(model)], check=True,
                       capture_output=True)  # fmt: skip
        rows = [run_mode(model, work, "sync", 0, a), run_mode(model, work, "async", 2, a)]
    speedup = rows[0]["wall_s"] / rows[1]["wall_s"]
    steady = rows[0]["step_s"] / rows[1]["step_s"]
    lines = [
        "| mode | wall s | s/step (steps 2-N) | trainer busy s/step | reward first step | reward last step "
        "| inference idle s | max staleness | groups dispatched / step | dropped stale | dropped zero-adv |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['mode']} | {r['wall_s']:.1f} | {r['step_s']:.2f} | {r['trainer_busy_s']:.2f} "
            f"| {r['reward_first']:.3f} | {r['reward_last']:.3f} | {r['idle_s']:.1f} | {r['staleness_max']} "
            f"| {r['groups_per_step']:.1f} | {r['dropped_stale']} | {r['dropped_zero_adv']} |"
            for r in rows
        ),
        "",
        f"Speed-up of async over sync: **{speedup:.2f}x** in wall time for {a.steps} steps (start-up "
        f"included), **{steady:.2f}x** per step once running.",
        f"The async step ({rows[1]['step_s']:.2f} s) against the trainer's busy time in it "
        f"({rows[1]['trainer_busy_s']:.2f} s): the closer they are, the more the run is bound by the trainer's "
        "compute, which inference shares the same cores with, and no scheduling can go below it.",
        "",
        "Reading: a synchronous step lasts as long as the slowest of its 32 episodes (the lognormal tail) plus",
        "the trainer step, with inference idle during the latter. The asynchronous run keeps dispatching",
        "groups for the next batches while the tail finishes and while the trainer trains, so the step time",
        "approaches the mean episode time; the price is staleness (at most max_off_policy_steps).",
        "Published async systems report 2-2.8x; the ratio here grows with the tail weight (sigma) and with",
        "the trainer's share of the step. The model starts from random weights, so both rewards stay near",
        "zero: this run measures throughput. Learning under async RL is shown by the reverse-text demo.",
    ]
    table = "\n".join(lines)
    print(table)
    if not a.no_write:
        header = (
            "## Async vs sync\n\n"
            f"`reverse-text` with a lognormal delay per episode step (median {a.median_s}s, sigma {a.sigma}); "
            f"tiny-moe from scratch, batch 32 = 4 groups of 8, {a.steps} steps; sync = max_async_steps 0, "
            "async = max_async_steps 2 and max_off_policy_steps 2. Same machine, one run.\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: "
            f"`python benchmarks/bench_async.py --steps {a.steps} --median-s {a.median_s} --sigma {a.sigma}`\n\n"
        )
        write_section("## Async vs sync", header + table + "\n")


if __name__ == "__main__":
    main()

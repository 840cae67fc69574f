"""Asynchronous versus synchronous RL on the same env with heavy-tailed latency, in one run.

    python benchmarks/bench_async.py [--steps 16] [--repeats 3] [--median-s 0.4] [--sigma 1.2]
                                     [--model DIR | --from-scratch] [--no-write]

Runs `asyncrl rl` on `reverse-text` with a lognormal delay on every episode step, three times per
repeat from the same start model and seed: with max_async_steps = 0 (synchronous, on-policy), with
max_async_steps = 2 (max_off_policy_steps = 2), and async again for 3x the steps, which asks
whether async reaches sync's final reward in less wall time. The start model is, by default, the
reverse-text demo's SFT model, built here the way examples/reverse_text/run.sh builds it (about 2 minutes), so
that the policy learns and "equal final reward" means something: the final weights of both modes
are evaluated on the same 128 held-out tasks. `--model DIR` starts from a model you have,
`--from-scratch` from a random tiny MoE (throughput only; its reward stays near zero).

Reports, per repeat and mode: wall time for N steps, the steady step time, the trainer's busy
time, the training and held-out rewards, staleness and wasted groups; then the speed-ups. Writes
the section "## Async vs sync" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import write_section

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "reverse_text"
ENV_ARGS = '{"min_len": 3, "max_len": 5}'  # the demo's tasks
MAX_TOKENS = 10
EVAL_TASKS = 128
LONG_FACTOR = 3  # async-long runs this many times --steps
# (name, max_async_steps = max_off_policy_steps, steps as a multiple of --steps)
MODES = (("sync", 0, 1), ("async", 2, 1), ("async-long", 2, LONG_FACTOR))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _asyncrl(*args: str, env: dict | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"asyncrl {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def _config(model: Path, run_dir: Path, a, lag: int, seed: int, steps: int) -> str:
    return f"""
model = "{model}"
run_dir = "{run_dir}"
max_steps = {steps}
seq_len = 512
seed = {seed}

[deployment]
base_port = {_free_port()}

[inference]
max_num_seqs = 128

[orchestrator]
batch_size = 32
group_size = 8
max_async_steps = {lag}
max_off_policy_steps = {lag}
sampling = {{ temperature = 1.0, max_tokens = {MAX_TOKENS} }}
advantage = {{ normalize_std = true }}

[[orchestrator.envs.envs]]
name = "reverse-text"
args = {{ min_len = 3, max_len = 5 }}
max_total_tokens = 512
latency = {{ median_s = {a.median_s}, sigma = {a.sigma} }}

[trainer]
optim = {{ lr = 2e-3 }}
publish = {{ keep_last = 2 }}
"""


def start_model(work: Path, a) -> tuple[Path, str]:
    """The model both modes start from, and how it was made."""
    if a.model:
        return Path(a.model), f"the model at `{a.model}`"
    base = work / "base"
    init = ["init-model", "--preset", "tiny-moe", "--out", str(base), "--seed", "0"]
    if a.from_scratch:
        _asyncrl(*init)
        return base, "a random tiny MoE (`asyncrl init-model`), which does not learn in this budget"
    print("[bench_async] building the start model: the reverse-text demo's SFT (about 2 minutes)", flush=True)
    t0 = time.perf_counter()
    _asyncrl(*init, "--init-std", "0.06")
    data = work / "sft.jsonl"
    _asyncrl(
        "sft-data",
        "--env",
        "reverse-text",
        "--num",
        "26000",
        "--out",
        str(data),
        "--corrupt-prob",
        "0.3",
        "--env-args",
        ENV_ARGS,
        "--seed",
        "0",
    )
    run = work / "sft"
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # as run.sh: SFT is deterministic for a thread count
    _asyncrl(
        "sft",
        "@",
        str(DEMO / "sft.toml"),
        "--model.path",
        str(base),
        "--data.path",
        str(data),
        "--run-dir",
        str(run),
        "--seed",
        "0",
        env=env,
    )
    model = max((run / "weights").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    print(f"[bench_async] SFT done in {time.perf_counter() - t0:.0f}s: {model.name}", flush=True)
    return model, f"the reverse-text demo's SFT model (seed 0, {model.name}; run.sh's stages 1-3)"


def evaluate(model: Path, work: Path, label: str) -> float:
    """Sampled (temperature 1) mean reward on the demo's held-out tasks."""
    out = work / "eval.jsonl"
    _asyncrl(
        "eval",
        "--model",
        str(model),
        "--label",
        label,
        "--env",
        "reverse-text",
        "--env-args",
        ENV_ARGS,
        "--num",
        str(EVAL_TASKS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--temperature",
        "1",
        "--json-out",
        str(out),
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    return next(r["reward"] for r in reversed(rows) if r["label"] == label)


def run_mode(model: Path, work: Path, name: str, lag: int, seed: int, steps: int, a) -> dict:
    run_dir = work / f"{name}-{seed}"
    cfg = work / f"{name}-{seed}.toml"
    cfg.write_text(_config(model, run_dir, a, lag, seed, steps))
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
    quarter = max(1, len(rewards) // 4)
    times = [r["time"] for r in trainer]
    step_s = (times[-1] - times[0]) / max(len(times) - 1, 1)
    waits = [r["wait_s"] for r in trainer[1:]]
    final = run_dir / "weights" / f"step_{steps}"
    return {
        "mode": name,
        "seed": seed,
        "steps": steps,
        "wall_s": wall,
        "step_s": step_s,
        "trainer_busy_s": step_s - sum(waits) / max(len(waits), 1),
        "reward_first": sum(rewards[:quarter]) / quarter,
        "reward_last": sum(rewards[-quarter:]) / quarter,
        "heldout": evaluate(final, work, f"{name}-{seed}"),
        "idle_s": sum(r["inference/idle_s"] for r in orch),
        "staleness_max": max(r["staleness/max"] for r in orch),
        # work that trained nothing: groups dispatched per batch (4 would waste none), and why
        "groups_per_step": orch[-1]["groups/dispatched_total"] / len(orch),
        "dropped_stale": orch[-1]["dropped/groups_stale_in_flight"]
        + orch[-1]["dropped/groups_stale_queue"],  # both are run totals
        "dropped_zero_adv": orch[-1]["dropped/groups_zero_advantage"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs, RL seeds 0..R-1")
    p.add_argument("--median-s", type=float, default=0.4)
    p.add_argument("--sigma", type=float, default=1.2)
    start = p.add_mutually_exclusive_group()
    start.add_argument("--model", help="start from this HF model directory instead of building the SFT model")
    start.add_argument("--from-scratch", action="store_true", help="start from a random tiny MoE")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, origin = start_model(work, a)
        start_reward = evaluate(model, work, "start")
        for seed in range(a.repeats):
            for name, lag, factor in MODES:
                print(f"[bench_async] seed {seed}: {name}, {a.steps * factor} steps", flush=True)
                rows.append(run_mode(model, work, name, lag, seed, a.steps * factor, a))
                r = rows[-1]
                print(
                    f"[bench_async]   {r['wall_s']:.0f}s wall, {r['step_s']:.2f} s/step, "
                    f"held-out reward {r['heldout']:.3f}",
                    flush=True,
                )
    by_seed = [{r["mode"]: r for r in rows if r["seed"] == seed} for seed in range(a.repeats)]
    step_ratios = [m["sync"]["step_s"] / m["async"]["step_s"] for m in by_seed]
    wall_ratios = [m["sync"]["wall_s"] / m["async"]["wall_s"] for m in by_seed]
    long_walls = [m["async-long"]["wall_s"] / m["sync"]["wall_s"] for m in by_seed]
    long_gain = [m["async-long"]["heldout"] - m["sync"]["heldout"] for m in by_seed]
    long_steps = a.steps * LONG_FACTOR

    def mean(mode: str, key: str) -> float:
        return statistics.mean(r[key] for r in rows if r["mode"] == mode)

    lines = [
        "| mode | seed | steps | wall s | s/step (steps 2-N) | trainer busy s/step "
        "| training reward, first -> last quarter | held-out reward, final weights | inference idle s "
        "| max staleness | groups dispatched / step | dropped stale | dropped zero-adv |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['mode']} | {r['seed']} | {r['steps']} | {r['wall_s']:.1f} | {r['step_s']:.2f} | "
            f"{r['trainer_busy_s']:.2f} | {r['reward_first']:.3f} -> {r['reward_last']:.3f} | "
            f"{r['heldout']:.3f} | {r['idle_s']:.1f} | {r['staleness_max']} | {r['groups_per_step']:.1f} | "
            f"{r['dropped_stale']} | {r['dropped_zero_adv']} |"
            for r in rows
        ),
        "",
        f"Held-out reward of the start model: {start_reward:.3f}. Final weights, mean over "
        f"{a.repeats} seed(s): sync {mean('sync', 'heldout'):.3f}, async {mean('async', 'heldout'):.3f} "
        f"after {a.steps} steps, async {mean('async-long', 'heldout'):.3f} after {long_steps}.",
        "",
        "Speed-up of async over sync, per seed: "
        + ", ".join(f"{s:.2f}x" for s in step_ratios)
        + f" per step once running (median **{statistics.median(step_ratios):.2f}x**); "
        + ", ".join(f"{w:.2f}x" for w in wall_ratios)
        + f" in wall time for {a.steps} steps, start-up included (median "
        f"**{statistics.median(wall_ratios):.2f}x**).",
        "",
        f"Async for {long_steps} steps against sync for {a.steps}, per seed: wall time "
        + ", ".join(f"{w:.2f}x" for w in long_walls)
        + " of sync's, held-out reward "
        + ", ".join(f"{g:+.3f}" for g in long_gain)
        + " against sync's final.",
    ]
    table = "\n".join(lines)
    print(table)
    if not a.no_write:
        command = f"python benchmarks/bench_async.py --steps {a.steps} --repeats {a.repeats} " + (
            f"--median-s {a.median_s} --sigma {a.sigma}"
            + (" --from-scratch" if a.from_scratch else " --model DIR" if a.model else "")
        )
        header = (
            "## Async vs sync\n\n"
            f"`reverse-text` (the demo's tasks, 3-5 characters) with a lognormal delay per episode step "
            f"(median {a.median_s}s, sigma {a.sigma}), starting from {origin}; batch 32 = 4 groups of 8, "
            f"{a.steps} steps, lr 2e-3; sync = max_async_steps 0, async = max_async_steps 2 and "
            f"max_off_policy_steps 2; async-long is async for {long_steps} steps. Each seed (the RL seed) "
            "runs the three, one after the other. Held-out reward: `asyncrl eval` of the final weights on "
            f"the demo's {EVAL_TASKS} eval tasks, sampled at temperature 1.\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: `{command}`\n\n"
        )
        write_section("## Async vs sync", header + table + "\n")


if __name__ == "__main__":
    main()

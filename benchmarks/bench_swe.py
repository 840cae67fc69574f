"""`swe` env throughput, sandbox start latency, and what a SIGKILLed orchestrator leaves behind.

    PYTHONPATH=src python benchmarks/bench_swe.py [--levels 16 64] [--rounds 2] [--write]

Part 1: a scripted agent that applies the reference fix of the example task `calclib-clamp`
(`asyncrl.envs.builtin.swe.example`: two tool calls, then grading with pytest) runs `rounds x N`
episodes with N in flight, for each level N, through the real rollout loop and sandbox pool
(`max_sandboxes` = N). Reported: episodes per minute, and the sandbox start latency (the time
`setup` waits in `SandboxPool.acquire`) at p50 / p99, with the share of warm starts (a sandbox reset
after an earlier episode, or created ahead).
Part 2: a child process runs the same episodes with 16 in flight and is killed with SIGKILL once
they run; the table counts, under its sandbox root, the processes, mounts, cgroups and run
directories its run left, right after the kill and after a restart (a new pool, whose reaper runs
first).
Part 3: how a checkout of this repository itself (a few hundred files) is made: the env's way
(`GitCheckout`: a git directory sharing the source's objects, then `read-tree -u`), its reset after
an edit, and two alternatives, `git clone --shared` + checkout and a full copy (`cp -a`) of a
checked-out tree; median of `--repeats`, the variants interleaved. `--write` replaces the "SWE env"
section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.config import EnvConfig
from asyncrl.envs import ChatTokenizer, ScriptedClient, TokenPolicy, build_env, run_episode
from asyncrl.envs.builtin.swe.checkout import GitCheckout, GitSource
from asyncrl.envs.builtin.swe.example import write_example
from asyncrl.envs.sandbox_pool import SandboxPool
from asyncrl.envs.sandbox_reaper import mounts_under
from asyncrl.model.tokenizer import save_byte_tokenizer
from asyncrl.wire import SamplingParams
from report import write_section

CFG = EnvConfig(name="swe", max_total_tokens=32768, max_tokens_per_turn=4096, max_tool_output_chars=8000)


def _env(tasks: Path, root: Path, concurrency: int):
    sandbox = {"root": str(root), "max_sandboxes": concurrency, "prewarm": 0}
    return build_env("swe", {"tasks": str(tasks), "eval_tasks": str(tasks), "sandbox": sandbox})


async def _episodes(env, tokenizer: ChatTokenizer, num: int, concurrency: int, on_start=None) -> list:
    task = next(t for t in env.tasks("eval", 2) if t.info["instance_id"] == "calclib-clamp")
    replies = [m["content"] for m in env.reference(task) if m["role"] == "assistant"]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with gate:
            client = ScriptedClient(tokenizer, replies)
            policy = TokenPolicy(client, tokenizer, SamplingParams(max_tokens=4096), config=CFG)
            if on_start is not None:
                on_start(i)
            return await run_episode(env, task, policy, config=CFG, episode_id=f"ep-{i}")

    return await asyncio.gather(*(one(i) for i in range(num)))


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def measure(
    tasks: Path, tokenizer: ChatTokenizer, concurrency: int, rounds: int, root: Path
) -> dict[str, float]:
    env = _env(tasks, root, concurrency)
    try:
        t0 = time.monotonic()
        episodes = asyncio.run(_episodes(env, tokenizer, rounds * concurrency, concurrency))
        wall = time.monotonic() - t0
    finally:
        env.close()
    failed = [e for e in episodes if e.error or e.reward != 1.0]
    assert not failed, (failed[0].error, failed[0].rewards)
    starts = [e.rewards["sandbox_start_s"] for e in episodes]
    return {
        "concurrency": concurrency,
        "episodes": len(episodes),
        "wall_s": wall,
        "per_min": 60 * len(episodes) / wall,
        "start_p50_ms": 1000 * _percentile(starts, 0.5),
        "start_p99_ms": 1000 * _percentile(starts, 0.99),
        "warm": statistics.fmean(e.rewards["sandbox_warm"] for e in episodes),
        "test_p50_s": _percentile([e.rewards["test_run_s"] for e in episodes], 0.5),
    }


def _child(tasks: Path, root: Path, tok_dir: Path) -> None:
    """The orchestrator-like process of part 2: episodes with 16 in flight until it is killed."""
    env = _env(tasks, root, 16)
    started: set[int] = set()

    def on_start(i: int) -> None:
        started.add(i)
        if len(started) == 16:
            print("running", flush=True)

    asyncio.run(_episodes(env, ChatTokenizer.from_pretrained(tok_dir), 10_000, 16, on_start))


def _sandbox_processes(root: Path) -> set[int]:
    """Processes of sandboxes under `root`: bwrap calls name their run directory; cgroups list the rest."""
    needle = f"{root}/run-".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                pass
    for run in root.glob("run-*"):
        for group in (run / "cgroups").read_text().split() if (run / "cgroups").exists() else []:
            for procs in Path(group).rglob("cgroup.procs"):
                found |= {int(p) for p in procs.read_text().split()}
    return found


def _census(root: Path) -> dict[str, int]:
    runs = [p for p in root.iterdir() if p.name.startswith("run-")]
    return {
        "processes": len(_sandbox_processes(root)),
        "mounts": len(mounts_under(root)),
        "cgroups": sum(Path(g).is_dir() for r in runs for g in (r / "cgroups").read_text().split()),
        "dirs": len(runs),
    }


def kill_and_restart(tasks: Path, tok_dir: Path, root: Path) -> list[tuple[str, dict[str, int]]]:
    cmd = [sys.executable, __file__, "--child", str(tasks), str(root), str(tok_dir)]
    child = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "running"
    for _ in range(300):  # until sandbox commands (tool calls, test runs) are in flight
        before = _census(root)
        if before["processes"] >= 4:
            break
        time.sleep(0.1)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    time.sleep(0.5)  # the kernel finishes the sandboxes' PID namespaces
    after_kill = _census(root)
    SandboxPool(root=root).close()  # a restart: the reaper runs first, then the new run ends cleanly
    return [
        ("running (16 in flight)", before),
        ("after kill -9", after_kill),
        ("after restart", _census(root)),
    ]


def checkout_latency(work: Path, repeats: int) -> list[tuple[str, float]]:
    """ms to get a pristine tree of this repository at HEAD, four ways."""
    repo = Path(__file__).resolve().parents[1]
    source = GitSource.open(repo, import_dir=work)
    commit = source.resolve(["HEAD"])["HEAD"]
    checkout = GitCheckout(source=source, commit=commit)
    counter = iter(range(10**6))

    def fresh() -> tuple[Path, Path]:
        base = work / f"c{next(counter)}"
        (base / "work").mkdir(parents=True)
        (base / "private").mkdir()
        return base / "work", base / "private"

    tree, private = fresh()
    checkout.create(tree, private)
    num_files = len(source.files(commit))

    def reset() -> None:
        (tree / "README.md").write_text("edited")
        checkout.reset(tree, private)

    def clone() -> None:
        dest = work / f"clone{next(counter)}"
        subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(repo), str(dest)], check=True)
        subprocess.run(["git", "-C", str(dest), "checkout", "-q", commit], check=True)

    def copy() -> None:
        subprocess.run(["cp", "-a", str(tree), str(work / f"copy{next(counter)}")], check=True)

    variants = {
        f"GitCheckout.create ({num_files} files)": lambda: checkout.create(*fresh()),
        "GitCheckout.reset after an edit": reset,
        "git clone --shared + checkout": clone,
        "cp -a of a checked-out tree": copy,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # interleaved, so that load on a shared machine hits every variant alike
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - t0))
    return [(name, statistics.median(ms)) for name, ms in times.items()]


def _tables(
    levels: list[dict[str, float]],
    census: list[tuple[str, dict[str, int]]],
    checkouts: list[tuple[str, float]],
) -> str:
    rows = [
        "| in flight | episodes | wall s | episodes/min | start p50 ms | start p99 ms | warm starts "
        "| test run p50 s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in levels:
        rows.append(
            f"| {m['concurrency']} | {m['episodes']} | {m['wall_s']:.1f} | {m['per_min']:.0f} | "
            f"{m['start_p50_ms']:.1f} | {m['start_p99_ms']:.1f} | {100 * m['warm']:.0f}% | "
            f"{m['test_p50_s']:.2f} |"
        )
    rows += ["", "| stage | processes | mounts | cgroups | run dirs |", "|---|---:|---:|---:|---:|"]
    for stage, c in census:
        rows.append(f"| {stage} | {c['processes']} | {c['mounts']} | {c['cgroups']} | {c['dirs']} |")
    rows += ["", "| checkout of this repository | ms (median) |", "|---|---:|"]
    rows += [f"| {name} | {ms:.0f} |" for name, ms in checkouts]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=2, help="episodes per level = rounds x level")
    parser.add_argument("--repeats", type=int, default=5, help="runs per checkout variant (part 3)")
    parser.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*map(Path, args.child))
        return
    load, t0 = [os.getloadavg()[0]], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-swe-") as tmp:
        work = Path(tmp)
        tasks = write_example(work / "example")
        save_byte_tokenizer(work / "tok")
        tokenizer = ChatTokenizer.from_pretrained(work / "tok")
        levels = [measure(tasks, tokenizer, n, args.rounds, work / f"sandboxes-{n}") for n in args.levels]
        census = kill_and_restart(tasks, work / "tok", work / "sandboxes-kill")
        checkouts = checkout_latency(work / "checkouts", args.repeats)
    load.append(os.getloadavg()[0])
    table = _tables(levels, census, checkouts)
    print(table)
    if args.write:
        machine = f"{platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}"
        body = (
            "## SWE env\n\n"
            f"Machine: {machine}; load average (other jobs on the machine) {load[0]:.1f} at the start, "
            f"{load[1]:.1f} at the end. Command: `PYTHONPATH=src python benchmarks/bench_swe.py --levels "
            f"{' '.join(map(str, args.levels))} --rounds {args.rounds} --repeats {args.repeats} --write` "
            f"({time.monotonic() - t0:.0f} s), one run. The env's built-in example task `calclib-clamp` "
            "(`asyncrl.envs.builtin.swe.example`), which measures the pool rather than the tasks; the "
            'shipped task set is in "SWE task set" below.\n\n'
            "A scripted agent applies the reference fix (two tool calls), then the grader runs the task's "
            "tests (pytest) in the episode's bwrap sandbox; `max_sandboxes` = episodes in flight. Start "
            "latency: the time `setup` waits for a pristine sandbox.\n\n"
            f"{table}\n"
        )
        write_section("## SWE env", body)


if __name__ == "__main__":
    main()

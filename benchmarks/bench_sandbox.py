"""Per-call overhead of the sandbox (bwrap boundary + guard) against a plain subprocess.

    PYTHONPATH=src python benchmarks/bench_sandbox.py --calls 30 [--write]

Both run the same trivial snippet with the same interpreter (`python -I -S`), sequentially, N calls
each, interleaved in rounds so that load on a shared machine hits both alike. `--write` replaces
the "Sandbox" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time

from asyncrl.envs.sandbox import Sandbox, SandboxLimits, probe_isolation
from report import write_section

SNIPPET = "print(sum(range(1000)))\n"


async def _plain(path: str) -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert out == b"499500\n", out
    return time.perf_counter() - t0


async def _sandboxed(box: Sandbox) -> float:
    t0 = time.perf_counter()
    result = await box.run_python("snippet.py")
    assert result.ok and result.stdout == "499500\n", result
    return time.perf_counter() - t0


async def measure(num_calls: int, rounds: int = 3) -> dict[str, float]:
    """ms/call of each variant (median over rounds of the mean over calls)."""
    box = Sandbox(limits=SandboxLimits(wall_s=30.0), allow_weak_isolation=True)
    box.write_file("snippet.py", SNIPPET)
    per_round: dict[str, list[float]] = {"plain": [], "sandbox": []}
    try:
        for _ in range(rounds):
            n = max(num_calls // rounds, 1)
            per_round["plain"].append(sum([await _plain(str(box.path("snippet.py"))) for _ in range(n)]) / n)
            per_round["sandbox"].append(sum([await _sandboxed(box) for _ in range(n)]) / n)
    finally:
        box.close()
    return {k: 1000 * sorted(v)[len(v) // 2] for k, v in per_round.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    args = parser.parse_args()
    iso = probe_isolation()
    ms = asyncio.run(measure(args.calls))
    ratio = ms["sandbox"] / ms["plain"]
    rows = [
        "| variant | ms/call | ratio |",
        "|---|---:|---:|",
        f"| plain `python -I -S` subprocess | {ms['plain']:.1f} | 1.0x |",
        f"| Sandbox.run_python ({iso.mode}: {iso.detail}) | {ms['sandbox']:.1f} | {ratio:.1f}x |",
    ]
    table = "\n".join(rows)
    print(table)
    if args.write:
        machine = f"{platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}"
        body = (
            "## Sandbox\n\n"
            f"Machine: {machine}. Command: `PYTHONPATH=src python benchmarks/bench_sandbox.py "
            f"--calls {args.calls} --write`.\nThe same trivial snippet, {args.calls} sequential calls each; "
            "the sandbox column includes the audit-hook guard, rlimits and output collection.\n\n"
            f"{table}\n"
        )
        write_section("## Sandbox", body)


if __name__ == "__main__":
    main()

"""The shipped SWE task set, verified: tasks per repository, how many the reference fix solves, and
how long a task's test run takes.

    bash scripts/setup-swe-tasks.sh                         # once: the tasks' repositories
    PYTHONPATH=src python benchmarks/bench_swe_tasks.py [--tasks examples/swe/tasks.jsonl] [--write]

Runs `asyncrl swe-tasks --verify` on every row, one at a time (a row's test runs then do not
compete with each other): a fresh checkout of base_commit, the row's test_cmd on FAIL_TO_PASS +
PASS_TO_PASS, the reference patch, the same tests again. Run from the repository root (rows name
their repositories relative to it). `--write` replaces the "SWE task set" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from asyncrl.envs.builtin.swe.tasks import read_tasks
from asyncrl.tools.swe_tasks import verify_tasks
from asyncrl.tools.swe_tasks.verify import verify_report
from report import write_section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="examples/swe/tasks.jsonl")
    parser.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    args = parser.parse_args()
    tasks = read_tasks(args.tasks)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    verdicts = verify_tasks(tasks, jobs=1, log=lambda line: print(line, file=sys.stderr, flush=True))
    wall_s, load1 = time.monotonic() - t0, os.getloadavg()[0]
    table = verify_report(tasks, verdicts)
    print(table)
    if args.write:
        machine = f"{platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}"
        body = (
            "## SWE task set\n\n"
            f"Machine: {machine}; load average {load0:.1f} at the start, {load1:.1f} at the end (other jobs "
            f"shared the cores). Command: `PYTHONPATH=src python benchmarks/bench_swe_tasks.py --tasks "
            f"{args.tasks} --write` ({wall_s:.0f} s).\n"
            "Every row of the task file verified one at a time: F2P before = the share of FAIL_TO_PASS "
            "passing at base_commit (the bug must score 0), F2P / P2P after = with the reference patch "
            "(it must score 1); a test run is one row's test_cmd on its FAIL_TO_PASS + PASS_TO_PASS "
            "(at most 20 here), pytest's start included.\n\n"
            f"{table}\n"
        )
        write_section("## SWE task set", body)


if __name__ == "__main__":
    main()

"""`asyncrl swe-tasks`: make SWE-bench-form tasks from a Python repository, check them, or rebuild
the repositories a committed task file names.

    asyncrl swe-tasks --repo DIR --out TASKS.jsonl [--max-tasks 30] [--seed 0] [--jobs 2]
    asyncrl swe-tasks --verify TASKS.jsonl [--jobs 2] [--name NAME]
    asyncrl swe-tasks --rebuild TASKS.jsonl --repo DIR [--name NAME]   # only the rows NAME__...

Making tasks runs DIR's test suite, mutates the functions that passing tests run and keeps the
mutants that make some of them fail (docs/envs.md, "SWE tasks"). Each task's repository is
written to `--repo-out` (default: `<OUT's directory>/<OUT's stem>-repos/<instance_id>`); rows name
it relative to OUT's directory when it lies under it (the rule of every task file: relative paths
are taken from the file's directory), else by its absolute path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.envs.builtin.swe.tasks import DEFAULT_TEST_CMD, SweTask, SweTaskError, read_tasks, write_tasks
from asyncrl.tools.swe_tasks.generate import GenerateConfig, GenerateError, GenerateStats, generate
from asyncrl.tools.swe_tasks.mutate import OPERATORS
from asyncrl.tools.swe_tasks.repo import GitError, rebuild_task_repos
from asyncrl.tools.swe_tasks.verify import verify_report, verify_tasks

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl swe-tasks",
        description="Make SWE-bench-form tasks from a Python repository by mutating covered functions.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, help="make tasks from --repo; write the rows (JSONL) here")
    mode.add_argument("--verify", type=Path, metavar="TASKS", help="check every row: bug fails, fix passes")
    mode.add_argument(
        "--rebuild", type=Path, metavar="TASKS", help="recreate the rows' repositories from --repo"
    )
    p.add_argument("--repo", type=Path, help="the repository (or directory) to make tasks from; only read")
    p.add_argument(
        "--repo-out", type=Path, help="where the task repositories go (default: OUT's stem + -repos)"
    )
    p.add_argument(
        "--name",
        help="instance ids start with NAME__ (default: --repo's directory name); --verify/--rebuild: "
        "only those rows",
    )
    add = _with_default(p)
    add("--max-tasks", type=int, default=30)
    add("--seed", type=int, default=0, help="the order in which functions and mutants are tried")
    add("--jobs", type=int, default=1, help="test runs in parallel")
    add("--test-cmd", default=DEFAULT_TEST_CMD, help="run from the checkout root; {tests}: the test ids")
    add("--max-pass-to-pass", type=int, default=50, help="PASS_TO_PASS tests per task (0: all)")
    add("--max-per-function", type=int, default=1, help="tasks made from one function")
    add("--max-tries-per-function", type=int, default=6, help="mutants tried on one function")
    add("--operators", default=",".join(OPERATORS), help="mutation operators, comma-separated")
    add("--timeout-s", type=float, default=60.0, help="per test run (a mutant's tests; a verify run)")
    add("--baseline-timeout-s", type=float, default=900.0, help="the whole suite, traced")
    return p


def _with_default(p: argparse.ArgumentParser) -> Callable[..., None]:
    """`add_argument` that shows the default in the help."""

    def add(*names: str, help: str = "", **kwargs: Any) -> None:
        p.add_argument(*names, help=f"{help} (default: %(default)s)".lstrip(), **kwargs)

    return add


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _make(args: argparse.Namespace) -> int:
    if args.repo is None:
        raise GenerateError("--out makes tasks from a repository: pass --repo DIR")
    repo_out = args.repo_out or args.out.parent / f"{args.out.stem}-repos"
    cfg = GenerateConfig(
        repo=args.repo,
        repo_out=repo_out,
        name=args.name or args.repo.resolve().name,
        max_tasks=args.max_tasks,
        seed=args.seed,
        jobs=args.jobs,
        test_cmd=args.test_cmd,
        max_pass_to_pass=args.max_pass_to_pass,
        max_per_function=args.max_per_function,
        max_tries_per_function=args.max_tries_per_function,
        operators=tuple(o.strip() for o in args.operators.split(",") if o.strip()),
        timeout_s=args.timeout_s,
        baseline_timeout_s=args.baseline_timeout_s,
    )
    tasks, stats = generate(cfg, log=_log)
    write_tasks(args.out, tasks)
    _log(_summary(tasks, stats))
    _log(f"wrote {len(tasks)} tasks to {args.out}, their repositories under {repo_out}")
    _log(f"check them: asyncrl swe-tasks --verify {args.out}")
    return 0 if tasks else 1


def _summary(tasks: list[SweTask], stats: GenerateStats) -> str:
    tried = sum(stats.outcomes.values())
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(stats.outcomes.items()))
    by_op = defaultdict(int)
    for t in tasks:
        by_op[t.mutation.get("operator", "?")] += 1
    ops = ", ".join(f"{k} {v}" for k, v in sorted(by_op.items()))
    runs = stats.mutant_run_s
    median = f"{statistics.median(runs):.2f}" if runs else "-"
    return (
        f"{len(tasks)} tasks in {stats.wall_s:.0f} s: baseline {stats.num_passing}/{stats.num_tests} tests "
        f"passing ({stats.baseline_s:.1f} s traced); {stats.num_functions} covered functions with "
        f"{stats.num_mutants} mutants; {tried} tried ({outcomes}); median mutant test run {median} s\n"
        f"tasks by operator: {ops or '-'}"
    )


def _named(tasks: list[SweTask], name: str | None) -> list[SweTask]:
    """The rows made from the repository `name` (instance ids `name__...`); all rows without a name."""
    chosen = [t for t in tasks if name is None or t.instance_id.startswith(f"{name}__")]
    if not chosen:
        raise SweTaskError(f"no row's instance_id starts with {name}__")
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.out is not None:
            return _make(args)
        if args.rebuild is not None:
            if args.repo is None:
                raise GenerateError("--rebuild needs --repo DIR: the original files the tasks were made from")
            rebuild_task_repos(_named(read_tasks(args.rebuild), args.name), args.repo, log=_log)
            return 0
        tasks = _named(read_tasks(args.verify), args.name)
        verdicts = verify_tasks(tasks, jobs=args.jobs, timeout_s=args.timeout_s, log=_log)
        print(verify_report(tasks, verdicts))
        bad = [v for v in verdicts if not v.ok]
        _log(f"{len(verdicts) - len(bad)} of {len(verdicts)} tasks verified")
        return 1 if bad else 0
    except (GenerateError, SweTaskError, GitError) as e:
        print(f"asyncrl swe-tasks: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

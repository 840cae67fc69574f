"""Checking task rows the way the `swe` env scores them: the buggy state must score 0 on
FAIL_TO_PASS and the reference patch 1.0 on FAIL_TO_PASS and PASS_TO_PASS.

For each row: a fresh checkout of `base_commit`, `test_patch` applied, the row's `test_cmd` on
FAIL_TO_PASS + PASS_TO_PASS (each outcome from the env's report plugin: passed or xfailed counts
as passing); then `patch` applied and the same tests again. A row passes when no FAIL_TO_PASS test
passes before, every PASS_TO_PASS test passes before, and every test passes after. The tests run
on the host (no sandbox) with the row's venv, or the interpreter running asyncrl.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from asyncrl.envs.builtin.swe.grading import PASSING, fraction_passing
from asyncrl.envs.builtin.swe.tasks import SweTask
from asyncrl.tools.swe_tasks.repo import GitError, checkout, git
from asyncrl.tools.swe_tasks.runner import TestRunner

__all__ = ["Verdict", "verify_report", "verify_task", "verify_tasks"]


@dataclass(frozen=True, kw_only=True)
class Verdict:
    instance_id: str
    problems: tuple[str, ...]  # empty: the row is sound
    f2p_before: float  # fraction of FAIL_TO_PASS passing at base_commit (must be 0)
    f2p_after: float  # ... with the patch (must be 1)
    p2p_before: float  # fraction of PASS_TO_PASS passing at base_commit (must be 1)
    p2p_after: float
    run_s: tuple[float, ...]  # wall time of each test run (before, after)

    @property
    def ok(self) -> bool:
        return not self.problems


def _apply(work: Path, diff: str, what: str) -> str | None:
    if not diff.strip():
        return None
    try:
        git("apply", "--whitespace=nowarn", "-", cwd=work, input=diff)
    except GitError as e:
        return f"{what} does not apply: {e}"
    return None


def verify_task(task: SweTask, *, timeout_s: float = 300.0) -> Verdict:
    """Score the row's buggy state and its reference fix."""
    python = task.venv / "bin" / "python" if task.venv else None
    runner = TestRunner(task.test_cmd, timeout_s=timeout_s, python=python)
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-swe-verify-") as tmp:
            return _verify_in(Path(tmp) / "checkout", task, runner)
    finally:
        runner.close()


def _verify_in(work: Path, task: SweTask, runner: TestRunner) -> Verdict:
    ids = [*task.fail_to_pass, *task.pass_to_pass]
    verdict = Verdict(
        instance_id=task.instance_id,
        problems=(),
        f2p_before=0.0,
        f2p_after=0.0,
        p2p_before=0.0,
        p2p_after=0.0,
        run_s=(),
    )
    if not task.repo.exists():
        return _with(
            verdict,
            f"repo {task.repo} does not exist (a relative repo is taken from the tasks file's directory)",
        )
    try:
        checkout(task.repo, task.base_commit, work)
    except (GitError, OSError) as e:
        return _with(verdict, f"cannot check out {task.base_commit} of {task.repo}: {e}")
    problem = _apply(work, task.test_patch, "test_patch")
    if problem:
        return _with(verdict, problem)
    before = runner.run(work, ids)
    problem = _apply(work, task.patch, "patch")
    if problem:
        return _with(verdict, problem)
    after = runner.run(work, ids)
    b = dict.fromkeys(ids, "missing") | before.outcomes
    a = dict.fromkeys(ids, "missing") | after.outcomes
    verdict = Verdict(
        instance_id=task.instance_id,
        problems=(),
        f2p_before=fraction_passing(task.fail_to_pass, b),
        f2p_after=fraction_passing(task.fail_to_pass, a),
        p2p_before=fraction_passing(task.pass_to_pass, b),
        p2p_after=fraction_passing(task.pass_to_pass, a),
        run_s=(before.run.wall_s, after.run.wall_s),
    )
    problems = [f"FAIL_TO_PASS {t} passes before the patch" for t in task.fail_to_pass if b[t] in PASSING]
    problems += [
        f"PASS_TO_PASS {t} is {b[t]} before the patch" for t in task.pass_to_pass if b[t] not in PASSING
    ]
    problems += [f"{t} is {a[t]} after the patch" for t in ids if a[t] not in PASSING]
    problems += [
        f"a test run timed out after {runner.timeout_s:.0f} s" for r in (before, after) if r.run.timed_out
    ]
    return _with(verdict, *problems)


def _with(verdict: Verdict, *problems: str) -> Verdict:
    return Verdict(**{**verdict.__dict__, "problems": verdict.problems + problems})


def verify_tasks(
    tasks: Sequence[SweTask], *, jobs: int = 1, timeout_s: float = 300.0, log: Callable[[str], None] = print
) -> list[Verdict]:
    """Every row, `jobs` at a time; one line of progress per row."""

    def one(task: SweTask) -> Verdict:
        return verify_task(task, timeout_s=timeout_s)

    verdicts: list[Verdict] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for verdict in pool.map(one, tasks):
            verdicts.append(verdict)
            runs = " + ".join(f"{s:.1f}" for s in verdict.run_s)
            status = "ok" if verdict.ok else "FAILED: " + "; ".join(verdict.problems[:3])
            log(
                f"[{len(verdicts):>3}/{len(tasks)}] {verdict.instance_id}: {status}"
                + (f" ({runs} s)" if runs else "")
            )
    return verdicts


def verify_report(tasks: list[SweTask], verdicts: list[Verdict]) -> str:
    """A table per repository name (the instance id's prefix): tasks, verified, scores, run times."""
    groups: dict[str, list[Verdict]] = defaultdict(list)
    for task, verdict in zip(tasks, verdicts):
        groups[task.instance_id.split("__", 1)[0]].append(verdict)
    head = (
        "| repository | tasks | verified | F2P before | F2P after | P2P after | test run s (median / max) |"
    )
    rows = [head, "|---|---|---|---|---|---|---|"]
    for name, vs in sorted(groups.items()):
        runs = [s for v in vs for s in v.run_s] or [0.0]
        rows.append(
            f"| {name} | {len(vs)} | {sum(v.ok for v in vs)} | "
            f"{statistics.mean(v.f2p_before for v in vs):.3f} | "
            f"{statistics.mean(v.f2p_after for v in vs):.3f} | "
            f"{statistics.mean(v.p2p_after for v in vs):.3f} | {statistics.median(runs):.2f} / "
            f"{max(runs):.2f} |"
        )
    return "\n".join(rows)

"""Audit a finished run directory: every step exactly once, and no rollout group lost.

What "0 samples lost" means here. The orchestrator draws groups from one task stream; a group's
index is its position in it, and `rollouts/step_n/orchestrator.safetensors` (written atomically
with batch n) lists the groups of batch n and the groups dropped since batch n-1 with a reason.
For a run of N steps, the audit checks:

- rollouts/ holds step_1 .. step_N, each with its batch and orchestrator checkpoint, and no more;
- metrics.jsonl has exactly one trainer line and one orchestrator line per step 1..N, and the
  trainer line of step n trained as many samples as batch n holds;
- every group index below the final checkpoint's `next_index` is in exactly one of: a batch (whole,
  so all its samples), a drop record (stale in flight, stale in the queue, no samples: counted in
  metrics), or the final buffer / in-flight list (sampled but not needed: the run ended). An index
  in none of them, or in two, is a lost or duplicated group;
- the samples of batch n come from the tasks of the groups its checkpoint names.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.orchestrator.checkpoint import STATE_FILE, load_state
from asyncrl.run_dir import batch_dir
from asyncrl.transport.metrics import read_metrics
from asyncrl.transport.rollouts import batch_steps, read_batch

_TASK_INDEX = re.compile(r"/train/(\d+)/v\d+/\d+$")


@dataclass
class Audit:
    steps: list[int]
    num_groups: int  # groups dispatched (task stream length)
    trained: dict[int, int] = field(default_factory=dict)  # group index -> step
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> number of groups
    leftover: int = 0  # buffered or in flight when the run ended
    problems: list[str] = field(default_factory=list)

    def check(self) -> None:
        assert not self.problems, "audit failed:\n  " + "\n  ".join(self.problems)


def audit_run(
    run_dir: str | Path, max_steps: int, *, roles: tuple[str, ...] = ("trainer", "orchestrator")
) -> Audit:
    """Collect every problem of `run_dir` against the rules above (call `.check()` to assert).

    `roles`: whose metrics lines to check (orchestrator tests with a fake trainer: orchestrator only).
    """
    run_dir = Path(run_dir)
    steps = batch_steps(run_dir)
    expected = list(range(1, max_steps + 1))
    problems = [] if steps == expected else [f"rollouts/ holds steps {steps}, expected {expected}"]
    for role in roles:
        seen = [r["step"] for r in read_metrics(run_dir, role)]
        if sorted(seen) != expected:
            dup = sorted(s for s, n in Counter(seen).items() if n > 1)
            problems.append(f"metrics.jsonl {role} steps {sorted(seen)}: expected {expected} (twice: {dup})")
    trainer_samples = {r["step"]: r.get("num_samples") for r in read_metrics(run_dir, "trainer")}
    placed: dict[int, list[str]] = {}
    audit = Audit(steps=steps, num_groups=0, problems=problems)
    state = None
    for step in steps:
        path = batch_dir(run_dir, step) / STATE_FILE
        if not path.is_file():
            problems.append(f"{path} missing")
            continue
        state = load_state(path)
        batch = read_batch(run_dir, step, timeout_s=0)
        if step in trainer_samples and trainer_samples[step] not in (None, len(batch.samples)):
            problems.append(
                f"step {step}: trainer trained {trainer_samples[step]} samples, batch has "
                f"{len(batch.samples)}"
            )
        for index in state.trained:
            placed.setdefault(index, []).append(f"batch {step}")
            audit.trained[index] = step
        for index, reason in state.dropped:
            placed.setdefault(index, []).append(f"dropped ({reason}) before batch {step}")
            audit.dropped[reason] = audit.dropped.get(reason, 0) + 1
        from_samples = {int(m[1]) for s in batch.samples if (m := _TASK_INDEX.search(s.episode_id))}
        if from_samples and from_samples != set(state.trained):
            problems.append(
                f"batch {step}: samples from groups {sorted(from_samples)}, checkpoint says "
                f"{sorted(state.trained)}"
            )
    if state is None:
        problems.append("no orchestrator checkpoint at all")
        return audit
    for g in state.buffered:
        placed.setdefault(g.index, []).append("buffered at the end")
    for ref in state.in_flight:
        placed.setdefault(ref.index, []).append("in flight at the end")
    audit.leftover = len(state.buffered) + len(state.in_flight)
    audit.num_groups = state.next_index
    for index in range(state.next_index):
        where = placed.pop(index, [])
        if len(where) != 1:
            problems.append(
                f"group {index}: "
                f"{'lost (in no batch, drop record or final checkpoint)' if not where else ', '.join(where)}"
            )
    if placed:
        problems.append(f"groups beyond the task stream ({state.next_index}): {sorted(placed)}")
    return audit

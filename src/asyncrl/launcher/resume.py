"""`asyncrl rl ... --resume`: continue a run in its run directory after a crash or a kill.

What each process continues from (docs/orchestrator.md, "Checkpoints and resume"):

- the trainer from its newest complete checkpoint c (`checkpoints/step_c/`), retraining batches
  c+1.. from `rollouts/` (never regenerating them); from scratch if it has none;
- the orchestrator from the checkpoint written with its newest batch B (`rollouts/step_B/`);
- the inference servers from the newest published weights up to c (the orchestrator loads them
  at start).

Before any child starts, the weights published after c are retracted (`weights/step_n`, n > c,
deleted): the trainer publishes those versions again, and no server may stamp tokens n while it
holds the pre-crash v_n, which the retrained v_n equals only in deterministic fp32. And
`metrics.jsonl` loses the lines of steps that will be redone (trainer steps after c; orchestrator
steps after B, which cannot exist but a torn line can; evals of versions after c, which are
published again), so every step appears once in the finished file. Both happen only here, while
no process runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.config.rl import ResolvedRL
from asyncrl.run_dir import latest_checkpoint_step
from asyncrl.transport.metrics import drop_metrics_after
from asyncrl.transport.rollouts import batch_steps
from asyncrl.transport.weights import retract_weights_after, stable_steps

__all__ = ["ResumePlan", "check_fresh_run_dir", "plan_resume"]


@dataclass(frozen=True, kw_only=True)
class ResumePlan:
    resolved: ResolvedRL  # the configs with the resume settings filled in
    trainer_step: int  # last step the trainer's checkpoint holds (0: from scratch)
    last_batch: int  # newest batch on disk (0: none)
    num_dropped_lines: int  # metrics.jsonl lines of steps that will be redone
    retracted: list[int]  # published weights after trainer_step, deleted (to be published again)

    def describe(self) -> str:
        t, b = self.trainer_step, self.last_batch
        trainer = f"trainer from checkpoint step {t}" if t else "trainer from the base model (no checkpoint)"
        if b > t:
            trainer += f", retraining batches {t + 1}..{b} from rollouts/"
        weights = ""
        if self.retracted:
            first, last = self.retracted[0], self.retracted[-1]
            span = f"v{first}" if first == last else f"v{first}..v{last}"
            weights = f"published weights {span} retracted; "
        return (
            f"resuming: {trainer}; orchestrator after batch {b}; {weights}"
            f"{self.num_dropped_lines} metrics line(s) of redone steps removed"
        )


def check_fresh_run_dir(run_dir: str | Path) -> None:
    """A run without --resume must not start over the batches of another one."""
    steps = batch_steps(run_dir)
    if steps:
        raise ConfigError(
            f"{run_dir} already holds a run (rollouts/step_{steps[0]}..step_{steps[-1]}): continue it "
            "with `asyncrl rl ... --resume`, or pick a new run_dir"
        )


def plan_resume(resolved: ResolvedRL, *, dry_run: bool = False) -> ResumePlan:
    """Resume settings for every process, and metrics.jsonl cut back to what they continue from
    (unless `dry_run`: then nothing on disk changes)."""
    run_dir = Path(resolved.orchestrator.run_dir)
    trainer_step = latest_checkpoint_step(run_dir) or 0
    batches = batch_steps(run_dir)
    last_batch = batches[-1] if batches else 0
    if trainer_step > last_batch:
        raise ConfigError(
            f"{run_dir}: the trainer's checkpoint is at step {trainer_step} but rollouts/ ends at batch "
            f"{last_batch}; the run directory is inconsistent (were rollouts deleted?)"
        )
    trainer = resolved.trainer.model_copy(
        update={"resume": False, "resume_step": trainer_step or None}
    )  # resume_step, not resume: no checkpoint at all is a valid state (killed before the first one)
    orchestrator = resolved.orchestrator.model_copy(update={"resume": True})
    # eval lines of retracted versions go too: those versions are published and evaluated again
    keep = {"trainer": trainer_step, "orchestrator": last_batch, "eval": trainer_step}
    retracted = [s for s in stable_steps(run_dir) if s > trainer_step]  # the complete ones, to report
    dropped = 0
    if not dry_run:
        dropped = drop_metrics_after(run_dir, keep)
        retract_weights_after(run_dir, trainer_step)
    return ResumePlan(
        resolved=ResolvedRL(inference=resolved.inference, orchestrator=orchestrator, trainer=trainer),
        trainer_step=trainer_step,
        last_batch=last_batch,
        num_dropped_lines=dropped,
        retracted=retracted,
    )

"""kill -9 each process of a short reverse-text run at chosen points; `--resume` finishes it, losing nothing.

After every scenario the audit (audit.py) must find steps 1..N exactly once in rollouts/ and in
metrics.jsonl (trainer and orchestrator), and every dispatched group trained once or dropped with
a reason. The trainer checkpoints every 2 steps, so a trainer killed after step 1 or in step 3
resumes from an older state and retrains batches from disk.
"""

from __future__ import annotations

import pytest

from asyncrl.transport.rollouts import batch_dir, read_batch
from integration.faults.audit import audit_run
from integration.faults.runs import MAX_STEPS

pytestmark = pytest.mark.slow


def _trainer_done(run, step):
    return lambda: any(r["step"] == step for r in run.lines("trainer"))


def _batch_written(run, step):
    return lambda: batch_dir(run.run_dir, step).is_dir()


# (victim, what to wait for before the kill, description)
KILL_POINTS = {
    "trainer-after-step-1": ("trainer", _trainer_done, 1),  # no checkpoint yet: retrains from v0
    "trainer-in-step-3": ("trainer", _batch_written, 3),  # checkpoint 2: retrains 3 from disk
    "orchestrator-after-batch-2": ("orchestrator", _batch_written, 2),
    "launcher-after-step-2": ("launcher", _trainer_done, 2),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_kill_then_resume_loses_nothing(make_run, point):
    victim, condition, step = KILL_POINTS[point]
    run = make_run()
    run.start()
    run.wait_for(condition(run, step), f"{point}")
    batches_before = {s: read_batch(run.run_dir, s, timeout_s=0).samples[0].episode_id
                      for s in range(1, step + 1) if batch_dir(run.run_dir, s).is_dir()}  # fmt: skip
    run.kill(victim)
    code, _, err = run.finish(timeout_s=120)
    assert code != 0
    if victim != "launcher":
        assert f"process '{victim}' was killed by SIGKILL" in err, err[-2000:]
    run.wait_all_gone()

    run.start(resume=True)
    code, out, err = run.finish()
    assert code == 0, err[-3000:]
    assert "asyncrl rl: resuming:" in out
    audit = audit_run(run.run_dir, MAX_STEPS)
    audit.check()
    for s, episode in batches_before.items():  # batches written before the kill were kept, not redone
        assert read_batch(run.run_dir, s, timeout_s=0).samples[0].episode_id == episode
    assert (run.run_dir / "checkpoints" / f"step_{MAX_STEPS}").is_dir()


def test_a_killed_inference_server_is_restarted_and_the_run_loses_nothing(make_run):
    run = make_run()
    run.start()
    run.wait_for(_batch_written(run, 1), "batch 1")
    run.kill("inference-0")
    code, _, err = run.finish()
    assert code == 0, err[-3000:]
    assert "process 'inference-0' was killed by SIGKILL; restarting (1/3)" in err
    log = (run.run_dir / "logs" / "orchestrator.log").read_text()
    assert "healthy again, back in rotation" in log
    audit_run(run.run_dir, MAX_STEPS).check()

"""kill -9 each process of a short reverse-text run at chosen points; `--resume` finishes it, losing nothing.

After every scenario the audit (audit.py) must find steps 1..N exactly once in rollouts/ and in
metrics.jsonl (trainer and orchestrator), and every dispatched group trained once or dropped with
a reason. The trainer checkpoints every 2 steps, so a trainer killed after step 1 or in step 3
resumes from an older state and retrains batches from disk. A trainer killed right after
publishing v3 (checkpoint 2) must leave no server holding that pre-crash v3 after the resume.
"""

from __future__ import annotations

import re
import signal

import pytest

from asyncrl.run_dir import batch_dir, weights_dir
from asyncrl.trainer.checkpoint import latest_checkpoint_step
from asyncrl.transport.rollouts import batch_steps, read_batch
from asyncrl.transport.weights import STABLE_MARKER, stable_steps
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
    batches_before = {
        s: read_batch(run.run_dir, s, timeout_s=0).samples[0].episode_id
        for s in range(1, step + 1)
        if batch_dir(run.run_dir, s).is_dir()
    }
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


_LOADED = re.compile(r"weights v(\d+) \((\S+)\) loaded on")


def _orchestrator_log(run) -> list[str]:
    return (run.run_dir / "logs" / "orchestrator.log").read_text().splitlines()


def _publications(run) -> dict[int, str]:
    """version -> the directory behind weights/step_n (one publication)."""
    return {v: str(weights_dir(run.run_dir, v).resolve()) for v in stable_steps(run.run_dir)}


def _loads(run, skip: int) -> list[tuple[int, str]]:
    """(version, publication) of each weight update the orchestrator logged after its first `skip` lines."""
    return [(int(m[1]), m[2]) for line in _orchestrator_log(run)[skip:] if (m := _LOADED.search(line))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kill_after_publish_before_checkpoint_then_no_server_holds_the_pre_crash_weights(make_run, dtype):
    """Killed after publishing v3, with checkpoint 2: the retrained v3 equals the pre-crash one only
    in deterministic fp32. The resumed trainer is held (SIGSTOP) until the orchestrator has loaded
    weights into the fresh server, as a slow trainer start would be. Every load after the resume
    must name a publication of the run that goes on (v2 from before the kill, v3 and v4 retrained),
    and every token stamped 3 or later must come from servers holding the retrained weights.
    Synchronous (max_async_steps 0), so batch 4 is sampled only under v3."""
    run = make_run(
        **{"inference.dtype": dtype, "trainer.model.dtype": dtype, "orchestrator.max_async_steps": "0"}
    )
    run.start()
    run.wait_for((weights_dir(run.run_dir, 3) / STABLE_MARKER).is_file, "v3 published", poll_s=0.01)
    run.kill("trainer")
    assert run.finish(timeout_s=120)[0] != 0
    run.wait_all_gone()
    assert latest_checkpoint_step(run.run_dir) == 2, "killed too late to test this point: checkpoint 4 exists"
    before, written, skip = _publications(run), set(batch_steps(run.run_dir)), len(_orchestrator_log(run))

    run.start(resume=True)
    run.wait_for(lambda: run.is_running("trainer"), "the resumed trainer", poll_s=0.01)
    run.signal("trainer", signal.SIGSTOP)
    run.wait_for(lambda: _loads(run, skip), "the orchestrator's first weight update")
    run.signal("trainer", signal.SIGCONT)
    code, out, err = run.finish()
    assert code == 0, err[-3000:]
    assert "published weights v3 retracted" in out
    audit_run(run.run_dir, MAX_STEPS).check()
    after, loads = _publications(run), _loads(run, skip)
    assert after[3] != before[3] and loads[0][0] == 2
    assert all(path == (before if v <= 2 else after)[v] for v, path in loads), (loads, before, after)
    for step in set(batch_steps(run.run_dir)) - written:  # sampled after the resume
        samples = read_batch(run.run_dir, step, timeout_s=0).samples
        stamped = {int(v) for s in samples for v in s.policy_versions[s.loss_mask]}
        assert {v for v in stamped if v > 2} <= {v for v, _ in loads}, (step, stamped, loads)

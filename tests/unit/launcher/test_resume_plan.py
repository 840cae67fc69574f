"""`asyncrl rl --resume` planning: which step each process continues from, and metrics.jsonl cut back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.rl import RLConfig
from asyncrl.launcher.resume import check_fresh_run_dir, plan_resume
from asyncrl.transport.metrics import MetricsWriter, read_metrics
from asyncrl.transport.rollouts import write_batch
from asyncrl.transport.weights import stable_steps, stage_weights
from asyncrl.wire import RolloutBatch, RolloutSample


def _resolved(run_dir):
    cfg = {"model": "m", "run_dir": str(run_dir), "max_steps": 6, "seq_len": 2048}
    return load_config(RLConfig, cfg).resolve()


def _batch(step: int) -> RolloutBatch:
    n = 4
    sample = RolloutSample(
        token_ids=np.ones(n, np.int32),
        loss_mask=np.ones(n, bool),
        inference_logprobs=np.zeros(n, np.float32),
        advantages=np.zeros(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.zeros(n, np.int32),
    )
    return RolloutBatch(step=step, samples=[sample])


def _checkpoint(run_dir, step: int) -> None:
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")  # what marks a complete DCP checkpoint


def test_resume_continues_each_process_from_its_own_state_and_cuts_redone_lines(tmp_path):
    for step in (1, 2, 3, 4):
        write_batch(tmp_path, _batch(step))
    _checkpoint(tmp_path, 2)
    trainer, orchestrator = MetricsWriter(tmp_path, "trainer"), MetricsWriter(tmp_path, "orchestrator")
    evals = MetricsWriter(tmp_path, "eval")
    for step in (1, 2, 3, 4):
        orchestrator.write(step, {})
    for step in (1, 2, 3):
        trainer.write(step, {"loss": 0.1})
    for version in (0, 2, 3):
        evals.write(version, {"version": version})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"role": "trainer", "st')  # torn by the kill
    plan = plan_resume(_resolved(tmp_path))
    assert (plan.trainer_step, plan.last_batch) == (2, 4)
    assert plan.resolved.trainer.resume_step == 2 and plan.resolved.orchestrator.resume
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")] == [1, 2]  # 3 will be retrained
    assert [r["step"] for r in read_metrics(tmp_path, "orchestrator")] == [1, 2, 3, 4]
    assert [r["version"] for r in read_metrics(tmp_path, "eval")] == [0, 2]  # v3 is published again
    assert plan.num_dropped_lines == 3
    assert "retraining batches 3..4" in plan.describe()
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_resume_without_a_trainer_checkpoint_retrains_from_the_base_model(tmp_path):
    write_batch(tmp_path, _batch(1))
    MetricsWriter(tmp_path, "trainer").write(1, {})
    plan = plan_resume(_resolved(tmp_path), dry_run=True)
    assert plan.trainer_step == 0 and plan.resolved.trainer.resume_step is None
    assert not plan.resolved.trainer.resume
    assert len(read_metrics(tmp_path, "trainer")) == 1  # dry run: nothing on disk changes


def test_weights_published_after_the_trainer_checkpoint_are_retracted_before_anything_starts(tmp_path):
    for step in (1, 2, 3, 4):
        write_batch(tmp_path, _batch(step))
        with stage_weights(tmp_path, step) as tmp:
            (tmp / "model.safetensors").write_bytes(b"pre-crash")
    _checkpoint(tmp_path, 2)  # killed after publishing v4, before checkpointing step 3 or 4

    plan = plan_resume(_resolved(tmp_path), dry_run=True)
    assert plan.retracted == [3, 4] and stable_steps(tmp_path) == [1, 2, 3, 4]  # dry run: only says so
    plan = plan_resume(_resolved(tmp_path))
    assert "published weights v3..v4 retracted" in plan.describe()
    assert stable_steps(tmp_path) == [1, 2]  # servers start from v2; v3, v4 come from the retrained trainer
    left = [p.name for p in (tmp_path / "weights").iterdir()]
    assert not [n for n in left if "step_3" in n or "step_4" in n]  # nor their directories


def test_a_checkpoint_past_the_last_batch_is_an_error(tmp_path):
    write_batch(tmp_path, _batch(1))
    _checkpoint(tmp_path, 3)
    with pytest.raises(ConfigError, match="checkpoint is at step 3 but rollouts/ ends at batch 1"):
        plan_resume(_resolved(tmp_path))


def test_a_fresh_run_over_an_existing_one_is_refused(tmp_path):
    check_fresh_run_dir(tmp_path)  # empty: fine
    write_batch(tmp_path, _batch(1))
    with pytest.raises(ConfigError, match="--resume"):
        check_fresh_run_dir(tmp_path)

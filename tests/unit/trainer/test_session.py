"""The end of a step and resume: a checkpoint keeps its step's metrics line, which a trainer killed
between the checkpoint and the line writes when it resumes, once."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.model import from_pretrained
from asyncrl.run_dir import checkpoint_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.checkpoint import checkpoint_metrics, latest_checkpoint_step
from asyncrl.trainer.metrics import MetricsLogger
from asyncrl.trainer.rl import run_rl
from asyncrl.trainer.synthetic import synthetic_batch
from asyncrl.transport import write_batch
from asyncrl.transport.metrics import read_metrics


class _Killed(Exception):
    """Stands for a SIGKILL at the point it is raised."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-moe"
    init_model("tiny-moe", path, seed=0)
    return path


def _run_dir(model_dir, tmp_path):
    """Batches 1 and 2 on disk."""
    model = from_pretrained(model_dir)
    for step in (1, 2):
        batch = synthetic_batch(model, step=step, num_samples=2, prompt_len=4, completion_len=8, seed=step)
        write_batch(tmp_path, batch)
    return tmp_path


def _cfg(model_dir, run_dir, **overrides) -> RLTrainerConfig:
    base = {
        "model": {"path": str(model_dir)},
        "run_dir": str(run_dir),
        "max_steps": 2,
        "seq_len": 32,
        "checkpoint": {"interval": 1},
        "batch_timeout_s": 0.5,
        "peak_flops": 1e11,
    }
    return load_config(RLTrainerConfig, base | overrides)


def _killed_before_the_line_of(step: int, monkeypatch) -> list[dict]:
    """Make the trainer die when it logs `step` (after its checkpoint); returns what it would have logged."""
    lost: list[dict] = []
    log = MetricsLogger.log

    def dying_log(self, record):
        if record["step"] == step:
            lost.append(json.loads(json.dumps(record)))
            raise _Killed
        log(self, record)

    monkeypatch.setattr(MetricsLogger, "log", dying_log)
    return lost


def _without_header(line: dict) -> dict:
    return {k: v for k, v in line.items() if k not in ("role", "time")}


def test_a_kill_between_checkpoint_and_line_is_logged_once_on_resume(
    model_dir, tmp_path, monkeypatch, capsys
):
    run_dir = _run_dir(model_dir, tmp_path)
    lost = _killed_before_the_line_of(2, monkeypatch)
    with pytest.raises(_Killed):
        run_rl(_cfg(model_dir, run_dir))
    monkeypatch.undo()
    assert latest_checkpoint_step(run_dir) == 2
    assert [r["step"] for r in read_metrics(run_dir, "trainer")] == [1]
    capsys.readouterr()

    assert run_rl(_cfg(model_dir, run_dir, resume=True)) == []  # nothing left to train
    lines = read_metrics(run_dir, "trainer")
    assert [r["step"] for r in lines] == [1, 2]
    # json.dumps compares NaN metrics (a step without stale tokens) as equal too
    assert json.dumps(_without_header(lines[1])) == json.dumps(lost[0])
    assert lost[0]["publish_s"] > 0 and "wait_s" in lost[0]  # the record is complete when stored
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("asyncrl trainer: CPU ")  # the start-up line
    assert out[1].startswith("step 2 | loss ")

    run_rl(_cfg(model_dir, run_dir, resume=True))  # resumed again: the line is there now
    assert read_metrics(run_dir, "trainer") == lines


def test_a_resume_after_the_line_was_written_adds_no_line(model_dir, tmp_path):
    run_dir = _run_dir(model_dir, tmp_path)
    run_rl(_cfg(model_dir, run_dir))
    lines = read_metrics(run_dir, "trainer")
    assert [r["step"] for r in lines] == [1, 2]
    assert json.dumps(checkpoint_metrics(run_dir, 2)) == json.dumps(_without_header(lines[1]))
    run_rl(_cfg(model_dir, run_dir, resume=True))
    run_rl(_cfg(model_dir, run_dir, resume_step=1, max_steps=1))
    assert read_metrics(run_dir, "trainer") == lines


def test_a_checkpoint_without_a_metrics_record_still_resumes(model_dir, tmp_path, monkeypatch):
    run_dir = _run_dir(model_dir, tmp_path)
    _killed_before_the_line_of(2, monkeypatch)
    with pytest.raises(_Killed):
        run_rl(_cfg(model_dir, run_dir))
    monkeypatch.undo()
    (checkpoint_dir(run_dir, 2) / "metrics.json").unlink()
    assert checkpoint_metrics(run_dir, 2) is None
    assert run_rl(_cfg(model_dir, run_dir, resume=True)) == []
    assert [r["step"] for r in read_metrics(run_dir, "trainer")] == [1]


def test_cpu_start_up_line_names_the_isa_and_the_kernels_the_steps_take():
    import torch

    from asyncrl.model import cpu_norm, cpu_scores
    from asyncrl.model.compute import cpu_kernels
    from asyncrl.trainer.session import _cpu_kernels_line

    kernels = cpu_kernels()
    assert _cpu_kernels_line(torch.float32) == f"CPU {kernels.isa}; {cpu_norm.note()}"
    bf16 = _cpu_kernels_line(torch.bfloat16)
    blocked = kernels.native_bf16 and not kernels.amx  # where bf16 training takes the blocked attention
    assert bf16.endswith(f"; blocked causal attention, {cpu_scores.note()}") == blocked

"""A checkpoint step's metrics line is written before its checkpoint: a kill between the two must
not leave a run whose resume skips the step and never logs it."""

from __future__ import annotations

from types import SimpleNamespace

import asyncrl.trainer.session as session_module
from asyncrl.trainer.session import TrainSession


def test_a_checkpoint_steps_metrics_line_is_written_before_the_checkpoint(monkeypatch, tmp_path):
    events = []
    session = object.__new__(TrainSession)
    session.cfg = SimpleNamespace(
        max_steps=10,
        run_dir=tmp_path,
        checkpoint=SimpleNamespace(interval=2, keep_last=2),
        publish=SimpleNamespace(interval=1),
    )
    session.publisher = SimpleNamespace(
        publish=lambda model, step, to_disk: events.append(("publish", step)),
        wait=lambda: events.append(("wait", None)),
    )
    session.model = session.info = None
    session.step_runner = SimpleNamespace(optimizer=None, scheduler=None)
    session.logger = SimpleNamespace(log=lambda record: events.append(("log", record["step"])))
    session.step_metrics = lambda step, result: {"step": step}
    monkeypatch.setattr(session_module, "save_checkpoint", lambda *a: events.append(("checkpoint", a[1])))
    session.end_step(1, result=None)
    session.end_step(2, result=None)
    assert events == [
        ("publish", 1),
        ("log", 1),
        ("publish", 2),
        ("wait", None),
        ("log", 2),
        ("checkpoint", 2),
    ]

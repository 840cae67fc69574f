"""RUN/metrics.jsonl: one writer, every line opens with role, step and time."""

from __future__ import annotations

import json

import pytest

from asyncrl.run_dir import metrics_file
from asyncrl.transport import MetricsWriter


def test_lines_of_both_roles_share_one_schema(tmp_path):
    MetricsWriter(tmp_path, "trainer").write(1, {"step": 1, "loss": 0.5})
    MetricsWriter(tmp_path, "orchestrator").write(1, {"reward/mean": 0.25})
    lines = [json.loads(x) for x in metrics_file(tmp_path).read_text().splitlines()]
    assert [list(r)[:3] for r in lines] == [["role", "step", "time"]] * 2
    assert [(r["role"], r["step"]) for r in lines] == [("trainer", 1), ("orchestrator", 1)]
    assert lines[0]["loss"] == 0.5 and lines[1]["reward/mean"] == 0.25
    assert all(isinstance(r["time"], float) and r["time"] > 1e9 for r in lines)


@pytest.mark.parametrize("metrics", [{"role": "x"}, {"time": 1.0}, {"step": 2}])
def test_metrics_cannot_override_the_header(tmp_path, metrics):
    with pytest.raises(ValueError, match="the writer owns role, step, time"):
        MetricsWriter(tmp_path, "trainer").write(1, metrics)
    assert not metrics_file(tmp_path).exists()


def test_write_missing_writes_a_step_only_once_per_role(tmp_path):
    trainer = MetricsWriter(tmp_path, "trainer")
    MetricsWriter(tmp_path, "orchestrator").write(2, {"reward/mean": 0.25})  # another role's step 2
    assert trainer.write_missing(2, {"loss": 0.5})["loss"] == 0.5
    assert trainer.write_missing(2, {"loss": 0.75}) is None
    lines = [json.loads(x) for x in metrics_file(tmp_path).read_text().splitlines()]
    assert [(r["role"], r["step"]) for r in lines] == [("orchestrator", 2), ("trainer", 2)]
    assert lines[1]["loss"] == 0.5

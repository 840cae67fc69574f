"""The run directory's layout: every path of a run, by name (docs/architecture.md, "Run directory")."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl import run_dir as layout


def test_every_path_of_a_run_directory():
    run = Path("outputs/run")
    assert layout.config_file(run, "trainer") == run / "configs" / "trainer.toml"
    assert layout.configs_dir(run) == run / "configs"
    assert layout.log_file(run, "inference-0") == run / "logs" / "inference-0.log"
    assert layout.logs_dir(run) == run / "logs"
    assert layout.batch_dir(run, 3) == run / "rollouts" / "step_3"
    assert layout.rollouts_root(run) == run / "rollouts"
    assert layout.weights_dir(run, 3) == run / "weights" / "step_3"
    assert layout.weights_root(run) == run / "weights"
    assert layout.weights_keep_file(run) == run / "weights" / "keep.json"
    assert layout.checkpoint_dir(run, 3) == run / "checkpoints" / "step_3"
    assert layout.checkpoints_root(run) == run / "checkpoints"
    assert layout.metrics_file(run) == run / "metrics.jsonl"
    assert layout.eval_file(run) == run / "eval.jsonl"
    assert layout.report_dir(run) == run / "report"
    assert layout.tensorboard_dir(run) == run / "tensorboard"
    assert layout.sbatch_file(run) == run / "slurm.sbatch"


def test_a_run_directory_may_be_a_string():
    assert layout.batch_dir("outputs/run", 12) == Path("outputs/run/rollouts/step_12")


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step_0", 0),
        ("step_12", 12),
        ("step_", None),
        ("step_1a", None),
        (".step_3.ab12", None),
        ("latest", None),
    ],
)
def test_step_of_reads_only_step_directory_names(name, step):
    assert layout.step_of(name) == step


def test_step_name_and_step_of_round_trip():
    assert [layout.step_of(layout.step_name(n)) for n in (0, 1, 250)] == [0, 1, 250]


def test_steps_in_lists_step_directories_in_order_and_only_complete_ones_with_a_marker(tmp_path):
    root = layout.weights_root(tmp_path)
    assert layout.steps_in(root) == []  # no directory yet
    for name in ("step_10", "step_2", ".step_3.ab12", "step_x", "notes"):
        (root / name).mkdir(parents=True)
    (root / "step_2" / "STABLE").touch()
    assert layout.steps_in(root) == [2, 10]
    assert layout.steps_in(root, marker="STABLE") == [2]

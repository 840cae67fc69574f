"""Shared set-up of the fault-injection suite: one tiny base model per session, runs to break (runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.tools.init_model import init_model
from integration.faults.runs import Run


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "model"
    init_model("tiny-moe", path, seed=0)
    return path


@pytest.fixture
def make_run(base_model, tmp_path):
    runs: list[Run] = []

    def make(**overrides: str) -> Run:
        runs.append(Run(base_model, tmp_path / f"run{len(runs)}", **overrides))
        return runs[-1]

    yield make
    for run in runs:
        run.stop()

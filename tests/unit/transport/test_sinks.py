"""Metric sinks: W&B (offline) and TensorBoard mirror metrics.jsonl lines; a failing sink is dropped."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.sinks import SinksConfig
from asyncrl.transport.sinks import Sinks, build_sinks, scalars

_RECORDS = [
    {"role": "orchestrator", "step": 2, "time": 1.0, "reward/mean": 0.5, "note": "x"},
    {"role": "trainer", "step": 1, "time": 2.0, "loss": 0.25, "skipped": False, "grad_norm": float("nan")},
    {"role": "trainer", "step": 2, "time": 3.0, "loss": 0.125, "skipped": False},
    {"role": "eval", "step": 2, "time": 4.0, "version": 2, "eval/rt/pass@4": 0.75},
]


def test_scalars_prefix_the_role_once_and_keep_finite_numbers_only():
    assert scalars(_RECORDS[0]) == {"orchestrator/reward/mean": 0.5}
    assert scalars(_RECORDS[1]) == {"trainer/loss": 0.25, "trainer/skipped": 0.0}
    assert scalars(_RECORDS[3]) == {"eval/version": 2.0, "eval/rt/pass@4": 0.75}  # not eval/eval/...


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_writes_an_event_file_with_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = build_sinks(SinksConfig(tensorboard={"enabled": True}), tmp_path)
    for record in _RECORDS:
        sinks.log(record)
    sinks.close()
    (event_file,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(event_file)).Reload()
    assert set(acc.Tags()["tensors"]) == {
        "trainer/loss",
        "trainer/skipped",
        "orchestrator/reward/mean",
        "eval/version",
        "eval/rt/pass@4",
    }
    loss = [(e.step, float(e.tensor_proto.float_val[0])) for e in acc.Tensors("trainer/loss")]
    assert loss == [(1, 0.25), (2, 0.125)]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_wandb_offline_run_dir_holds_the_logged_keys(tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = build_sinks(SinksConfig(wandb={"enabled": True, "mode": "offline", "project": "t"}), tmp_path)
    assert [s.name for s in sinks.sinks] == ["wandb"]
    for record in _RECORDS:
        sinks.log(record)
    sinks.close()
    import wandb

    wandb.teardown()  # stops wandb's service process, which flushes the run file
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert _logged(data, "trainer/loss") == {0.25, 0.125}
    assert _logged(data, "trainer/step") == {1, 2}
    assert _logged(data, "orchestrator/reward/mean") == {0.5}
    assert _logged(data, "orchestrator/step") == {2}
    assert _logged(data, "eval/rt/pass@4") == {0.75} and _logged(data, "eval/step") == {2}
    assert b"trainer/grad_norm" not in data  # NaN is left out


def _logged(data: bytes, key: str) -> set[float]:
    """Values of `key` in an offline .wandb file: each history item is protobuf `key` then field 16
    (`value_json`, tag bytes 0x82 0x01) with a one-byte length. wandb has no Python reader of these files."""
    out = set()
    for m in re.finditer(re.escape(key.encode()) + rb"\x82\x01", data):
        n = data[m.end()]
        out.add(json.loads(data[m.end() + 1 : m.end() + 1 + n]))
    return out


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, record) -> None:
        self.calls += 1
        raise OSError("disk full")

    def close(self) -> None:
        raise AssertionError("a dropped sink is not closed")


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.records: list = []

    def log(self, record) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def test_a_failing_sink_is_reported_once_and_switched_off(capsys):
    broken, recorder = _Broken(), _Recorder()
    sinks = Sinks([broken, recorder])
    for record in _RECORDS:
        sinks.log(record)
    sinks.close()
    assert broken.calls == 1 and recorder.records == _RECORDS
    err = capsys.readouterr().err
    assert err.count("metrics sink 'broken' failed (OSError: disk full)") == 1


def test_enabling_a_sink_whose_package_is_missing_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(
        ConfigError,
        match=r"sinks.wandb.enabled = true but the 'wandb' package is not installed; "
        r"pip install 'asyncrl\[wandb\]'",
    ):
        load_config(SinksConfig, ["--wandb.enabled", "true"])
    assert not load_config(SinksConfig, ["--wandb.project", "p"]).any_enabled  # off: no package needed

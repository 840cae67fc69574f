"""Metric sinks that mirror RUN/metrics.jsonl lines to Weights & Biases and TensorBoard.

    sinks = build_sinks(cfg.sinks, run_dir)      # from a `SinksConfig`; empty when none is enabled
    sinks.log({"role": "trainer", "step": 3, "time": ..., "loss": 0.41})
    sinks.close()

Every numeric metric of a line becomes `<role>/<metric>` at x = `step` (an eval line's metrics
are named `eval/...` already and keep their names). The trainer and the
orchestrator write their lines out of step order relative to each other (the orchestrator runs
ahead), so each role gets its own step axis in W&B (`<role>/step`). A sink never stops a run: the
first error it raises is printed once, and that sink is switched off; metrics.jsonl is unaffected.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config.sinks import SinksConfig, TensorBoardSinkConfig, WandbSinkConfig
from asyncrl.run_dir import tensorboard_dir
from asyncrl.transport.metrics import HEADER_KEYS

__all__ = ["MetricSink", "Sinks", "TensorBoardSink", "WandbSink", "build_sinks", "scalars"]


class MetricSink(Protocol):
    name: str

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numeric metrics as `<role>/<metric>` (booleans count as 0/1); a metric
    already under its role's name keeps it (`eval/reverse-text/pass@4`, not `eval/eval/...`)."""
    role = record["role"]
    out = {}
    for key, value in record.items():
        if key in HEADER_KEYS or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        out[key if key.startswith(f"{role}/") else f"{role}/{key}"] = float(value)
    return out


class WandbSink:
    """One W&B run per run directory; files under RUN/wandb/."""

    name = "wandb"

    def __init__(self, cfg: WandbSinkConfig, run_dir: Path) -> None:
        import wandb  # the [wandb] extra; SinksConfig checked it is installed

        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_dir.resolve().name,
            dir=str(run_dir),
            mode=cfg.mode,
        )
        self._roles: set[str] = set()

    def log(self, record: Mapping[str, Any]) -> None:
        role = record["role"]
        if role not in self._roles:
            self._run.define_metric(f"{role}/step")
            self._run.define_metric(f"{role}/*", step_metric=f"{role}/step")
            self._roles.add(role)
        self._run.log(scalars(record) | {f"{role}/step": int(record["step"])})

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """Event files in `log_dir` (default RUN/tensorboard), one scalar series per metric."""

    name = "tensorboard"

    def __init__(self, cfg: TensorBoardSinkConfig, run_dir: Path) -> None:
        from tensorboard.summary import Writer  # the [tensorboard] extra; torch-free

        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else tensorboard_dir(run_dir)
        self._writer = Writer(str(self.log_dir))

    def log(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, step, wall_time=record.get("time"))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Sinks:
    """Fans each metrics line out to the enabled sinks; a failing sink is reported once and dropped."""

    def __init__(self, sinks: list[MetricSink] | None = None) -> None:
        self.sinks = list(sinks or [])

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, record: Mapping[str, Any]) -> None:
        for sink in list(self.sinks):
            self._guard(sink, sink.log, record)

    def close(self) -> None:
        for sink in list(self.sinks):
            self._guard(sink, sink.close)
        self.sinks = []

    def _guard(self, sink: MetricSink, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a mirror of metrics.jsonl must never stop training
            self.sinks.remove(sink)
            _report(sink.name, e)


def _report(name: str, error: Exception) -> None:
    print(
        f"asyncrl: metrics sink '{name}' failed ({type(error).__name__}: {error}); it is switched off, "
        "RUN/metrics.jsonl keeps every metric",
        file=sys.stderr,
        flush=True,
    )


def build_sinks(cfg: SinksConfig | None, run_dir: str | Path) -> Sinks:
    """The sinks `cfg` enables; one that fails to start is reported and left out."""
    sinks: list[MetricSink] = []
    if cfg is None:
        return Sinks()
    run_dir = Path(run_dir)
    for enabled, factory, name in (
        (cfg.wandb.enabled, lambda: WandbSink(cfg.wandb, run_dir), "wandb"),
        (cfg.tensorboard.enabled, lambda: TensorBoardSink(cfg.tensorboard, run_dir), "tensorboard"),
    ):
        if not enabled:
            continue
        try:
            sinks.append(factory())
        except Exception as e:  # e.g. wandb online without a login: the run goes on without it
            _report(name, e)
    return Sinks(sinks)

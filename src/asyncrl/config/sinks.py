"""Optional metric sinks: Weights & Biases and TensorBoard, fed from RUN/metrics.jsonl.

`RUN/metrics.jsonl` stays the source of truth; a sink only mirrors its lines. Switch one on in the
`[sinks]` table of an `asyncrl rl` or `asyncrl sft` config::

    [sinks.wandb]
    enabled = true
    project = "reverse-text"
    mode = "offline"            # no network; `wandb sync RUN/wandb/offline-run-*` later

    [sinks.tensorboard]
    enabled = true              # event files in RUN/tensorboard (`tensorboard --logdir RUN/tensorboard`)

Each needs its package: `pip install 'asyncrl[wandb]'` or `pip install 'asyncrl[tensorboard]'`.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig

__all__ = ["SinksConfig", "TensorBoardSinkConfig", "WandbSinkConfig"]


def _require(package: str, extra: str, key: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"{key}.enabled = true but the '{package}' package is not installed; "
            f"pip install 'asyncrl[{extra}]' (or set {key}.enabled = false)"
        )


class WandbSinkConfig(BaseConfig):
    """Mirror every metrics line to a Weights & Biases run (keys `<role>/<metric>`)."""

    enabled: bool = Field(False, description="log metrics to Weights & Biases (needs the [wandb] extra)")
    project: str = Field("asyncrl", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user); unset = your default")
    name: str | None = Field(None, description="W&B run name; unset = the run directory's name")
    mode: Literal["online", "offline"] = Field(
        "online", description="'offline' writes RUN/wandb/ only (upload later with `wandb sync`)"
    )

    @model_validator(mode="after")
    def _check_package(self) -> WandbSinkConfig:
        if self.enabled:
            _require("wandb", "wandb", "sinks.wandb")
        return self


class TensorBoardSinkConfig(BaseConfig):
    """Mirror every metrics line to TensorBoard event files (tags `<role>/<metric>`)."""

    enabled: bool = Field(False, description="write TensorBoard event files (needs the [tensorboard] extra)")
    log_dir: str | None = Field(None, description="event file directory; unset = RUN/tensorboard")

    @model_validator(mode="after")
    def _check_package(self) -> TensorBoardSinkConfig:
        if self.enabled:
            _require("tensorboard", "tensorboard", "sinks.tensorboard")
        return self


class SinksConfig(BaseConfig):
    """Where metrics go besides RUN/metrics.jsonl (always written)."""

    wandb: WandbSinkConfig = Field(default_factory=WandbSinkConfig)
    tensorboard: TensorBoardSinkConfig = Field(default_factory=TensorBoardSinkConfig)

    @property
    def any_enabled(self) -> bool:
        return self.wandb.enabled or self.tensorboard.enabled

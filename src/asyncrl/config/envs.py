"""Config schema for choosing environments, weighting them, and bounding their episodes.

Example (TOML)::

    [envs]
    seed = 0

    [[envs.envs]]
    name = "reverse-text"            # a registered name, or any importable "package.module:factory"
    weight = 3.0
    args = { min_len = 3, max_len = 8 }

    [[envs.envs]]
    name = "calculator"
    max_turns = 4
    latency = { median_s = 0.5, sigma = 1.5 }   # heavy-tailed (lognormal) delay on every env step

    [[envs.envs]]
    name = "swe-lite"                # runs model-written code in the bubblewrap sandbox
    # allow_weak_isolation = true: accept the guard alone where bwrap cannot run
    args = { wall_s = 20.0, allow_weak_isolation = false }
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from asyncrl.config.base import BaseConfig

__all__ = ["EnvConfig", "EnvsConfig", "LatencyConfig"]


class LatencyConfig(BaseConfig):
    """Lognormal sleep before every environment step (tool calls or the env's reply).

    delay = min(max_s, median_s * exp(sigma * N(0, 1))): the median is `median_s`, and a larger
    `sigma` gives a heavier tail. `median_s = 0` turns the knob off.
    """

    median_s: float = Field(0.0, ge=0.0, description="median delay; 0 = off")
    sigma: float = Field(1.0, ge=0.0, le=5.0, description="lognormal sigma: larger = heavier tail")
    max_s: float = Field(60.0, gt=0.0, description="cap of one delay")

    @property
    def enabled(self) -> bool:
        return self.median_s > 0.0


class EnvConfig(BaseConfig):
    """One environment in the mix, with its constructor arguments and episode bounds."""

    name: str = Field(min_length=1, description="registered name or 'package.module:factory'")
    label: str | None = Field(None, description="name in metrics and samples; defaults to `name`")
    weight: float = Field(1.0, gt=0.0, description="relative sampling weight in the mixture")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the env factory")
    max_turns: int | None = Field(None, ge=1, description="model turns per episode; None = the env's default")
    max_total_tokens: int = Field(
        2048,
        ge=2,
        description="prompt + completion tokens per episode; at most the trainer's seq_len and the "
        "servers' context limit (checked at start)",
    )
    max_tokens_per_turn: int | None = Field(None, ge=1, description="None = the sampling params' max_tokens")
    deadline_s: float | None = Field(None, gt=0.0, description="wall-clock limit of one episode")
    tool_timeout_s: float = Field(
        30.0, gt=0.0, description="limit of one tool call; an error goes to the model"
    )
    max_tool_output_chars: int = Field(4000, ge=16, description="longer tool output is truncated")
    latency: LatencyConfig = Field(default_factory=LatencyConfig, description="simulated env-step latency")
    stitching: Literal["strict", "bridge"] = Field(
        "strict",
        description="strict: a completion whose text does not re-encode to its ids starts a new sample; "
        "bridge: keep the sampled ids and append the template's tokens after them (see docs/envs.md)",
    )


class EnvsConfig(BaseConfig):
    """The environment mixture. Task generation is deterministic under `seed`."""

    envs: list[EnvConfig] = Field(
        default_factory=lambda: [EnvConfig(name="reverse-text")],
        min_length=1,
        description="the environments, one [[envs.envs]] table each",
    )
    seed: int = Field(0, description="seed of every environment's task generation")

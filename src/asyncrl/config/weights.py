"""`[weights]` of an `asyncrl rl` config: how each policy version reaches the inference servers.

    [weights]
    transport = "distributed"     # "filesystem" (default): files in RUN/weights/step_n
    bucket_bytes = 268435456      # distributed: payload bytes of one bucket
    delta = true                  # distributed: send only changed serving values when smaller
    timeout_s = 120               # distributed: one server's whole transfer

docs/weights-transfer.md describes the distributed transport: one process group per server
(the trainer's ranks and the server's workers), fixed-size buckets from the trainer's shards.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig

__all__ = ["MAX_BUCKET_BYTES", "MIN_BUCKET_BYTES", "WeightsConfig"]

MIN_BUCKET_BYTES = 1 << 20  # below this the per-bucket header and round trip dominate
MAX_BUCKET_BYTES = 1 << 31  # a delta's positions are int32 within a piece
_DISTRIBUTED_ONLY = ("bucket_bytes", "delta", "timeout_s")


class WeightsConfig(BaseConfig):
    """The weight transport. Example: WeightsConfig(transport="distributed", bucket_bytes=64 << 20)."""

    transport: Literal["filesystem", "distributed"] = Field(
        "filesystem",
        description="filesystem: the trainer writes RUN/weights/step_n and every server reads it; "
        "distributed: buckets over a process group per server, straight from the trainer's shards",
    )
    bucket_bytes: int = Field(
        256 << 20,
        ge=MIN_BUCKET_BYTES,
        le=MAX_BUCKET_BYTES,
        description="distributed: payload bytes of one bucket (the staging memory of one send)",
    )
    delta: bool = Field(
        True,
        description="distributed: send only the elements whose serving value changed (positions + "
        "values) when that is smaller than the dense bucket",
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        description="distributed: one server's whole transfer; past it the server keeps its "
        "old weights and leaves the rotation",
    )

    @model_validator(mode="after")
    def _check(self) -> WeightsConfig:
        unused = [key for key in _DISTRIBUTED_ONLY if key in self.model_fields_set]
        if self.transport == "filesystem" and unused:
            raise ValueError(
                f"sets {', '.join(unused)}, which only the distributed transport reads; "
                'set transport = "distributed" or remove them'
            )
        return self

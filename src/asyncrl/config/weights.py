"""`[weights]` of an `asyncrl rl` config: how each policy version reaches the inference servers.

    [weights]
    transport = "distributed"     # "filesystem" (default): files in RUN/weights/step_n
    bucket_bytes = 268435456      # payload bytes of one bucket
    delta = true                  # send only changed serving values when smaller
    timeout_s = 120               # one server's whole transfer
    endpoint = "10.0.0.1:29700"   # host:port of the run's control store; asyncrl rl picks one

Each transport takes only its own keys (a discriminated union on `transport`): `bucket_bytes`
under `transport = "filesystem"` is an error that says which transport reads it.
docs/weights-transfer.md describes the distributed transport: one process group per server
(the trainer's ranks and the server's workers), fixed-size buckets from the trainer's shards.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from asyncrl.config.base import BaseConfig

__all__ = [
    "MAX_BUCKET_BYTES",
    "MIN_BUCKET_BYTES",
    "DistributedWeightsConfig",
    "FilesystemWeightsConfig",
    "WeightsConfig",
]

MIN_BUCKET_BYTES = 1 << 20  # below this the per-bucket header and round trip dominate
MAX_BUCKET_BYTES = 1 << 31  # a delta's positions are int32 within a piece


class FilesystemWeightsConfig(BaseConfig):
    """The trainer writes RUN/weights/step_n (docs/trainer.md) and every server reads it."""

    transport: Literal["filesystem"] = Field(
        "filesystem", description="filesystem: files in RUN/weights/step_n; distributed: process groups"
    )


class DistributedWeightsConfig(BaseConfig):
    """Buckets over a process group per server, straight from the trainer's shards.
    Example: DistributedWeightsConfig(transport="distributed", bucket_bytes=64 << 20)."""

    transport: Literal["distributed"] = Field(
        "distributed", description="filesystem: files in RUN/weights/step_n; distributed: process groups"
    )
    bucket_bytes: int = Field(
        256 << 20,
        ge=MIN_BUCKET_BYTES,
        le=MAX_BUCKET_BYTES,
        description="payload bytes of one bucket (the staging memory of one send)",
    )
    delta: bool = Field(
        True,
        description="send only the elements whose serving value changed (positions + values) when that "
        "is smaller than the dense bucket",
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        description="one server's whole transfer; past it the server keeps its old weights and leaves "
        "the rotation",
    )
    endpoint: str | None = Field(
        None,
        description="host:port of the run's control store, hosted by trainer rank 0 (servers and the "
        "other trainer ranks connect to it); unset: `asyncrl rl` uses [deployment] host and a free port",
    )

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return value
        host, sep, port = value.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"must be host:port with a port in 1..65535, got {value!r}")
        return value


def _default_transport(table: Any) -> Any:
    """A [weights] table without `transport` is the filesystem's."""
    if isinstance(table, dict) and "transport" not in table:
        return {"transport": "filesystem", **table}
    return table


WeightsConfig = Annotated[
    FilesystemWeightsConfig | DistributedWeightsConfig,
    Field(discriminator="transport"),
    BeforeValidator(_default_transport),
]

"""Where a server reaches the run's weights control store (`control`), and its name there.

Plain data, no torch: the launcher builds endpoints for its children without importing the
transfer machinery.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

__all__ = ["ENV_ENDPOINT", "ENV_INSTANCE", "ENV_SERVER", "ENV_TIMEOUT", "EndpointError", "WeightsEndpoint"]

ENV_ENDPOINT = "ASYNCRL_WEIGHTS_ENDPOINT"  # host:port of the control store
ENV_SERVER = "ASYNCRL_WEIGHTS_SERVER"  # the server's name on it
ENV_TIMEOUT = "ASYNCRL_WEIGHTS_TIMEOUT_S"  # one transfer's deadline
ENV_INSTANCE = "ASYNCRL_WEIGHTS_INSTANCE"  # shared by the receiving ranks of one server start


class EndpointError(ValueError):
    """A weights endpoint that cannot be parsed (a flag or an environment variable)."""


@dataclass(frozen=True, kw_only=True)
class WeightsEndpoint:
    """Where a server reaches the run's control store, and its name there. Example:
    WeightsEndpoint(host="127.0.0.1", port=29700, server="server0", timeout_s=120.0).
    `instance` is needed only by servers with several receiving ranks (vLLM workers): the same
    string on every rank of one start of the server, another on its next start."""

    host: str
    port: int
    server: str
    timeout_s: float = 120.0  # one transfer, first bucket to last ack
    instance: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise EndpointError(f"weights endpoint port must be 1..65535, got {self.port}")
        if not self.server or "/" in self.server:
            raise EndpointError(
                f"weights endpoint server name must be non-empty without '/': {self.server!r}"
            )
        if self.timeout_s <= 0:
            raise EndpointError(f"weights endpoint timeout_s must be > 0, got {self.timeout_s}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, address: str, server: str, **kwargs) -> WeightsEndpoint:
        """From "host:port" (a flag's value) and the server's name."""
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise EndpointError(f"weights endpoint must be host:port, got {address!r}")
        return cls(host=host, port=int(port), server=server, **kwargs)

    def to_env(self) -> dict[str, str]:
        """The environment variables `from_env` reads (for processes a server spawns)."""
        env = {ENV_ENDPOINT: self.address, ENV_SERVER: self.server, ENV_TIMEOUT: str(self.timeout_s)}
        return env | ({ENV_INSTANCE: self.instance} if self.instance else {})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WeightsEndpoint | None:
        """The endpoint in `env` (default: os.environ), or None when it names none."""
        env = os.environ if env is None else env
        if ENV_ENDPOINT not in env:
            return None
        if ENV_SERVER not in env:
            raise EndpointError(f"{ENV_ENDPOINT} is set but {ENV_SERVER} (this server's name) is not")
        extra = {"timeout_s": float(env[ENV_TIMEOUT])} if ENV_TIMEOUT in env else {}
        return cls.parse(env[ENV_ENDPOINT], env[ENV_SERVER], instance=env.get(ENV_INSTANCE, ""), **extra)

    def with_server(self, server: str) -> WeightsEndpoint:
        return replace(self, server=server)

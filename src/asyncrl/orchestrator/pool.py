"""Inference servers as one pool: session-sticky routing, least-loaded placement, health and failover.

The pool holds one `InferenceBackend` (asyncrl.client) per server and never speaks HTTP itself:
it routes over whatever backends it is given (`asyncrl.client.build_backends` builds them from
URLs, for asyncrl's servers or vLLM's).

Every turn of an episode goes to the server that served its first turn, so the episode reuses its
prefix cache. New sessions go to the healthy server with the fewest requests in flight. A server
that fails at the transport level (connection refused, timeout, 5xx) leaves the rotation; the
failing call raises `ServerUnavailable`, and the dispatcher re-runs that episode elsewhere. A
background task probes `/health` and re-admits the server when it answers again.

    pool = ServerPool(build_backends(["http://127.0.0.1:8000", "http://127.0.0.1:8001"]))
    client = pool.session("episode-17")        # an asyncrl.client InferenceClient (a RequestClient)
    response = await client.generate(prompt_ids, sampling, cache_salt="3")
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from asyncrl.client import InferenceBackend, InferenceError, RequestClient, ServerUnavailable
from asyncrl.wire import GenerateRequest, GenerateResponse

__all__ = ["NoHealthyServer", "Server", "ServerPool"]

_T = TypeVar("_T")

log = logging.getLogger(__name__)


class NoHealthyServer(ServerUnavailable):
    """Every server is out of rotation."""


@dataclass
class Server:
    backend: InferenceBackend
    healthy: bool = True
    in_flight: int = 0
    num_failures: int = 0

    @property
    def url(self) -> str:
        return self.backend.url


@dataclass
class PoolStats:
    """Token counters since the last `take()`, for per-step metrics."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    requests: int = 0
    since: float = field(default_factory=time.monotonic)

    def take(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.since, 1e-9)
        out = {
            "inference/prefix_cache_hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
            "inference/tokens_per_s": self.generated_tokens / elapsed,
            "inference/requests": float(self.requests),
        }
        self.__init__()
        return out


class ServerPool:
    def __init__(self, backends: Sequence[InferenceBackend]) -> None:
        if not backends:
            raise ValueError("ServerPool needs at least one inference server")
        self.servers = [Server(backend=b) for b in backends]
        self._sessions: dict[str, Server] = {}
        self.stats = PoolStats()

    # -- routing -------------------------------------------------------------------------------
    def session(
        self, session_id: str, *, cache_salt: Callable[[], str] | None = None, count: bool = True
    ) -> RequestClient:
        """The `InferenceClient` of one episode: all its turns go to one server.

        `cache_salt`, when given, is called as each request is sent and its answer becomes the
        request's salt (the dispatcher's: the policy version the servers hold at that moment).
        `count = False` leaves its tokens out of `stats` (an eval's requests: routed like the
        others, but not part of the training metrics).
        """
        if cache_salt is None:
            return RequestClient(functools.partial(self.generate, session_id, count=count))

        async def send(request: GenerateRequest) -> GenerateResponse:
            salted = request.model_copy(update={"cache_salt": cache_salt()})
            return await self.generate(session_id, salted, count=count)

        return RequestClient(send)

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def _pick(self, session_id: str) -> Server:
        server = self._sessions.get(session_id)
        if server is not None and server.healthy:
            return server
        healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            raise NoHealthyServer(f"no healthy inference server among {[s.url for s in self.servers]}")
        server = min(healthy, key=lambda s: s.in_flight)
        self._sessions[session_id] = server
        return server

    def mark_down(self, server: Server, reason: str) -> None:
        if server.healthy:
            log.warning("inference server %s out of rotation: %s", server.url, reason)
        server.healthy = False
        server.num_failures += 1
        for sid in [sid for sid, s in self._sessions.items() if s is server]:
            del self._sessions[sid]

    @property
    def healthy_servers(self) -> list[Server]:
        return [s for s in self.servers if s.healthy]

    # -- requests ------------------------------------------------------------------------------
    async def generate(
        self, session_id: str, request: GenerateRequest, *, count: bool = True
    ) -> GenerateResponse:
        server = self._pick(session_id)
        server.in_flight += 1
        try:
            out = await server.backend.generate(request)
        except ServerUnavailable as e:
            self.mark_down(server, str(e))
            raise
        finally:
            server.in_flight -= 1
        if not count:
            return out
        self.stats.requests += 1
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        self.stats.cached_tokens += out.num_cached_tokens
        self.stats.generated_tokens += len(out.token_ids)
        return out

    async def call_all(
        self, call: Callable[[InferenceBackend], Awaitable[_T]]
    ) -> dict[str, _T | InferenceError]:
        """`call` every healthy server at once (admin calls); failures are returned, not raised."""
        servers = self.healthy_servers

        async def one(s: Server) -> _T | InferenceError:
            try:
                return await call(s.backend)
            except InferenceError as e:
                return e

        results = await asyncio.gather(*(one(s) for s in servers))
        return {s.url: r for s, r in zip(servers, results, strict=True)}

    async def health_loop(
        self, interval_s: float, before_readmit: Callable[[Server], Awaitable[bool]] | None = None
    ) -> None:
        """Forever: probe servers out of rotation and re-admit those that answer /health.

        `before_readmit` (the weight updater's) brings a restarted server to the current policy
        version first; the server stays out if it returns False.
        """
        while True:
            await asyncio.sleep(interval_s)
            for server in self.servers:
                if server.healthy:
                    continue
                if not await server.backend.health(min(interval_s * 2, 5.0)):
                    continue
                if before_readmit is not None and not await before_readmit(server):
                    continue
                log.warning("inference server %s healthy again, back in rotation", server.url)
                server.healthy = True

    async def wait_ready(self, timeout_s: float) -> None:
        """Block until every server answers /health, or raise naming the ones that don't."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.servers)
        while pending:
            pending = [s for s in pending if not await s.backend.health(2.0)]
            if pending and time.monotonic() > deadline:
                raise ServerUnavailable(
                    f"inference servers not healthy after {timeout_s:.0f}s: {[s.url for s in pending]}"
                )
            if pending:
                await asyncio.sleep(0.5)

    async def aclose(self) -> None:
        await asyncio.gather(*(s.backend.aclose() for s in self.servers))

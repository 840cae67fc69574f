"""Inference servers as one pool: routing (asyncrl.orchestrator.routing), health, failover, in-flight cap.

The pool holds one `InferenceBackend` (asyncrl.client) per server and never speaks HTTP itself:
it routes over whatever backends it is given (`asyncrl.client.build_backends` builds them from
URLs, for asyncrl's servers or vLLM's).

Each generation request goes where its `Router` says: by default to the server that holds the
longest run of its prompt's leading KV blocks, then its session's server (an episode's turns stay
where its KV lives), then the least loaded, within a bound on imbalance. A background task polls
each server's `/metrics` (`load_loop`): its queue and KV usage feed the routing and the adaptive
in-flight cap (asyncrl.orchestrator.concurrency), its block size the prefix hashes. With a
`gateway` (an external router given by URL) every generation request goes there instead, and the
router places it; admin calls (pause, update_weights, weights, health) always go to each server
directly, through `call_all` or a server's own backend.

A server that fails at the transport level (connection refused, timeout, 5xx) leaves the rotation;
the failing call raises `ServerUnavailable`, and the dispatcher re-runs that episode elsewhere. A
background task probes `/health` and re-admits the server when it answers again.

    pool = ServerPool(build_backends(["http://127.0.0.1:8000", "http://127.0.0.1:8001"]))
    client = pool.session("episode-17")        # an asyncrl.client InferenceClient (a RequestClient)
    response = await client.generate(prompt_ids, sampling, cache_salt="3")
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from asyncrl.client import InferenceBackend, InferenceError, RequestClient, ServerUnavailable
from asyncrl.orchestrator.concurrency import AdaptiveCap, InFlightGate
from asyncrl.orchestrator.load import parse_metrics
from asyncrl.orchestrator.routing import Router, Server
from asyncrl.wire import GenerateRequest, GenerateResponse, UpdateWeightsResponse

if TYPE_CHECKING:
    from asyncrl.config.orchestrator import OrchestratorConfig

__all__ = ["NoHealthyServer", "Server", "ServerPool"]

_T = TypeVar("_T")

log = logging.getLogger(__name__)


class NoHealthyServer(ServerUnavailable):
    """Every server is out of rotation."""


@runtime_checkable
class FollowsWeightLoads(Protocol):
    """A gateway whose requests must hear of weight loads it did not drive (`VLLMBackend`: its salt
    epoch and context floor move with the loads, which it otherwise drives itself)."""

    def weights_loaded_behind(self, version: int) -> None: ...


@dataclass
class PoolStats:
    """Token counters since the last `take()`, for per-step metrics; the in-flight cap when there is one."""

    cap: AdaptiveCap | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    requests: int = 0
    since: float = field(default_factory=time.monotonic)

    def take(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.since, 1e-9)
        out = {
            "inference/prefix_hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
            "inference/tokens_per_s": self.generated_tokens / elapsed,
            "inference/requests": float(self.requests),
        }
        if self.cap is not None:
            out["inference/in_flight_cap"] = float(self.cap.value)
        self.__init__(cap=self.cap)
        return out


class ServerPool:
    def __init__(
        self,
        backends: Sequence[InferenceBackend],
        *,
        router: Router | None = None,
        cap: AdaptiveCap | None = None,
        gateway: InferenceBackend | None = None,
    ) -> None:
        """`router`: how requests are placed (default cache-aware); `cap`: the adaptive in-flight cap
        (None: none); `gateway`: an external router that takes every generation request instead."""
        if not backends:
            raise ValueError("ServerPool needs at least one inference server")
        self.servers = [Server(backend=b) for b in backends]
        self.router = router or Router()
        self.gateway = gateway
        self._gate = InFlightGate(cap) if cap is not None else None
        self._sessions: dict[str, Server] = {}
        self.stats = PoolStats(cap=cap)

    @classmethod
    def from_config(
        cls, cfg: OrchestratorConfig, backends: Sequence[InferenceBackend], gateway: InferenceBackend | None
    ) -> ServerPool:
        """The pool `cfg` describes: its routing mode and bound, its concurrency cap."""
        router = Router(
            "least_loaded" if cfg.router_url else cfg.routing,
            max_extra_requests=cfg.routing_max_extra_requests,
            max_extra_kv=cfg.routing_max_extra_kv,
            seed=cfg.seed,
        )
        c = cfg.concurrency
        cap = None
        if c.adaptive:
            cap = AdaptiveCap(
                min_requests=c.min_requests, max_requests=c.max_requests, target_kv_usage=c.target_kv_usage
            )
        return cls(backends, router=router, cap=cap, gateway=gateway)

    # -- routing -------------------------------------------------------------------------------
    def session(
        self, session_id: str, *, cache_salt: Callable[[], str] | None = None, count: bool = True
    ) -> RequestClient:
        """The `InferenceClient` of one episode: its turns stay on its server unless the router
        finds that server overloaded or another holding more of the prompt (see `Router.choose`).

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

    def _pick(self, session_id: str, hashes: list[bytes]) -> Server:
        healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            raise NoHealthyServer(f"no healthy inference server among {[s.url for s in self.servers]}")
        sticky = self._sessions.get(session_id)
        server = self.router.choose(healthy, sticky if sticky in healthy else None, hashes)
        self._sessions[session_id] = server
        return server

    def mark_down(self, server: Server, reason: str) -> None:
        if server.healthy:
            log.warning("inference server %s out of rotation: %s", server.url, reason)
        server.healthy = False
        server.num_failures += 1
        server.load = None
        server.prefix.clear()  # a server that comes back may have restarted with an empty cache
        for sid in [sid for sid, s in self._sessions.items() if s is server]:
            del self._sessions[sid]

    @property
    def healthy_servers(self) -> list[Server]:
        return [s for s in self.servers if s.healthy]

    # -- requests ------------------------------------------------------------------------------
    async def generate(
        self, session_id: str, request: GenerateRequest, *, count: bool = True
    ) -> GenerateResponse:
        async with self._gate.slot() if self._gate is not None else contextlib.nullcontext():
            if self.gateway is not None:
                out = await self.gateway.generate(request)
            else:
                out = await self._generate_routed(session_id, request)
        if not count:
            return out
        self.stats.requests += 1
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        self.stats.cached_tokens += out.num_cached_tokens
        self.stats.generated_tokens += len(out.token_ids)
        return out

    async def _generate_routed(self, session_id: str, request: GenerateRequest) -> GenerateResponse:
        hashes = self.router.hashes(request)
        server = self._pick(session_id, hashes)
        self.router.sent(server, hashes)
        server.in_flight += 1
        try:
            out = await server.backend.generate(request)
        except ServerUnavailable as e:
            self.mark_down(server, str(e))
            raise
        finally:
            server.in_flight -= 1
        self.router.answered(server, request, out, hashes)
        return out

    async def poll_loads(self, timeout_s: float = 5.0) -> None:
        """Read every healthy server's `/metrics` once: routing's loads and block size, the cap."""
        servers = self.healthy_servers

        async def one(s: Server):
            try:
                return parse_metrics(await asyncio.wait_for(s.backend.metrics(), timeout_s))
            except (InferenceError, TimeoutError) as e:
                log.debug("metrics of %s unread: %s", s.url, e)
                return None

        loads = await asyncio.gather(*(one(s) for s in servers))
        for server, load in zip(servers, loads, strict=True):
            server.load, server.in_flight_at_poll = load, server.in_flight
        self.router.observe(servers)
        if self._gate is not None:
            self._gate.cap.update([s.load for s in servers])
            self._gate.wake()

    async def load_loop(self, interval_s: float) -> None:
        """Forever: `poll_loads` every `interval_s` (in the background: never per request)."""
        while True:
            await self.poll_loads(timeout_s=max(2 * interval_s, 2.0))
            await asyncio.sleep(interval_s)

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
        loaded = [r.version for r in results if isinstance(r, UpdateWeightsResponse)]
        if loaded and isinstance(self.gateway, FollowsWeightLoads):
            self.gateway.weights_loaded_behind(min(loaded))
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
        """Block until every server (and the gateway) answers /health, or raise naming those that don't."""
        deadline = time.monotonic() + timeout_s
        pending = [*self.servers, *([Server(backend=self.gateway)] if self.gateway is not None else [])]
        while pending:
            pending = [s for s in pending if not await s.backend.health(2.0)]
            if pending and time.monotonic() > deadline:
                raise ServerUnavailable(
                    f"inference servers not healthy after {timeout_s:.0f}s: {[s.url for s in pending]}"
                )
            if pending:
                await asyncio.sleep(0.5)

    async def aclose(self) -> None:
        gateway = [self.gateway.aclose()] if self.gateway is not None else []
        await asyncio.gather(*(s.backend.aclose() for s in self.servers), *gateway)

"""Adaptive concurrency: how many requests the pool keeps in flight, following the servers' free KV.

Each metrics poll gives, per server, its running requests r and the fraction u of its KV blocks
they hold. r * target / u is then how many requests of that size it can run at the target usage;
the cap is the sum over servers, moved at most 2x per poll (one poll's gauges are noisy) and kept
within [min_requests, max_requests]. A server that reports no KV usage, or runs nothing, gives no
evidence of pressure and counts as max_requests. Long episodes (many KV blocks each) thus lower
the cap before the servers preempt and recompute, and short ones raise it until KV is used.

    cap = AdaptiveCap(min_requests=4, max_requests=256, target_kv_usage=0.9)
    cap.update([ServerLoad(num_running=10, kv_usage=0.9)])   # -> 128 (halved at most), then 10
    async with gate.slot(): ...                               # waits while `cap.value` are in flight
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Sequence

from asyncrl.orchestrator.load import ServerLoad

__all__ = ["AdaptiveCap", "InFlightGate"]


class AdaptiveCap:
    """The in-flight cap, re-estimated from the servers' loads at each metrics poll."""

    def __init__(self, *, min_requests: int, max_requests: int, target_kv_usage: float) -> None:
        if not 1 <= min_requests <= max_requests:
            raise ValueError(f"need 1 <= min_requests ({min_requests}) <= max_requests ({max_requests})")
        self.min_requests, self.max_requests = min_requests, max_requests
        self.target_kv_usage = target_kv_usage
        self.value = max_requests

    def _server_cap(self, load: ServerLoad | None) -> float:
        if load is None or load.kv_usage is None or load.kv_usage <= 0 or load.num_running <= 0:
            return float(self.max_requests)
        return load.num_running * self.target_kv_usage / load.kv_usage

    def update(self, loads: Sequence[ServerLoad | None]) -> int:
        """The new cap from the healthy servers' loads (no server: unchanged)."""
        if not loads:
            return self.value
        estimate = int(sum(self._server_cap(load) for load in loads))
        step_bounded = min(max(estimate, self.value // 2), 2 * self.value)
        self.value = min(max(step_bounded, self.min_requests), self.max_requests)
        return self.value


class InFlightGate:
    """Admits a request while fewer than `cap.value` are in flight; the others wait to be woken.

    Waiters are futures of the running loop, made as they wait, so a gate outlives the event loop
    it first ran in.
    """

    def __init__(self, cap: AdaptiveCap) -> None:
        self.cap = cap
        self.num_in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        while self.num_in_flight >= self.cap.value:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1
            self.wake()

    def wake(self) -> None:
        """Let as many waiters try again as there are free slots (after a release or a cap change)."""
        free = self.cap.value - self.num_in_flight
        for waiter in list(self._waiters)[: max(free, 0)]:
            if not waiter.done():
                waiter.set_result(None)

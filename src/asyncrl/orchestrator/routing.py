"""Which server a request goes to: cache-aware, least-loaded or random placement over the pool's servers.

Cache-aware routing keys a request's prompt the way the engines key their prefix cache: full
blocks of `block_size` tokens, each hash chained on the one before, the first one on the
request's `cache_salt`. (The engines also key blocks by the weights they were computed with; the
orchestrator's salt is the policy version, so it moves with every update too.) Per server the
router keeps the hashes of what it sent there recently, the prompt and then the completion, in
an LRU map no larger than the server's KV pool. Among the servers that are not overloaded (see
`Router.choose`) the request goes to the one holding the longest run of its leading blocks, then
to its session's server, then to the least loaded. The map is approximate: a server may have
evicted a block the router still lists, which costs a recomputation, never a wrong answer.

    router = Router("cache_aware", max_extra_requests=8, max_extra_kv=0.5)
    hashes = router.hashes(request)
    server = router.choose(pool.healthy_servers, None, hashes)
    router.sent(server, hashes); ...; router.answered(server, request, response, hashes)
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from asyncrl.client import InferenceBackend
from asyncrl.orchestrator.load import ServerLoad
from asyncrl.wire import GenerateRequest, GenerateResponse

__all__ = ["DEFAULT_BLOCK_SIZE", "PrefixIndex", "Router", "Server", "prefix_hashes"]

# Both backends' default; a server's own block size replaces it from its first metrics poll.
DEFAULT_BLOCK_SIZE = 16
# Hashes kept per server until a poll reports its KV pool size.
_DEFAULT_INDEX_BLOCKS = 1 << 16


def prefix_hashes(
    token_ids: list[int], block_size: int, cache_salt: str | None, known: list[bytes] | None = None
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, extending `known` (those of a prefix)."""
    hashes = list(known or [])
    ids = np.asarray(token_ids, dtype=np.int64)
    parent = hashes[-1] if hashes else hashlib.blake2b(b"salt:" + (cache_salt or "").encode()).digest()
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashlib.blake2b(parent + ids[i * block_size : (i + 1) * block_size].tobytes()).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """The block hashes one server was sent recently, least recently used first; at most `capacity`."""

    def __init__(self, capacity: int = _DEFAULT_INDEX_BLOCKS) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, this server holds."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()


@dataclass(eq=False)
class Server:
    """One server of the pool: its backend, rotation state, and what routing knows of it."""

    backend: InferenceBackend
    healthy: bool = True
    in_flight: int = 0
    num_failures: int = 0
    load: ServerLoad | None = None  # its gauges at the last metrics poll
    in_flight_at_poll: int = 0  # this pool's requests on it at that poll
    prefix: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def num_requests(self) -> int:
        """Requests on the server: its last reported queue, moved by what this pool sent or got since."""
        if self.load is None:
            return self.in_flight
        reported = self.load.num_running + self.load.num_waiting
        return max(self.in_flight, int(reported) + self.in_flight - self.in_flight_at_poll)

    @property
    def kv_usage(self) -> float:
        return (self.load.kv_usage or 0.0) if self.load is not None else 0.0


class Router:
    """Chooses a server per request, and remembers (cache_aware) which prefixes each one holds."""

    def __init__(
        self,
        mode: str = "cache_aware",
        *,
        max_extra_requests: int = 8,
        max_extra_kv: float = 0.5,
        seed: int = 0,
    ) -> None:
        if mode not in ("cache_aware", "least_loaded", "random"):
            raise ValueError(f"unknown routing mode {mode!r}: use 'cache_aware', 'least_loaded' or 'random'")
        self.mode = mode
        self.max_extra_requests, self.max_extra_kv = max_extra_requests, max_extra_kv
        self.block_size = DEFAULT_BLOCK_SIZE
        self._rng = random.Random(seed)

    def choose(self, healthy: list[Server], sticky: Server | None, hashes: list[bytes]) -> Server:
        """The server for a request whose prompt `hashes` are those of `self.hashes(request)`;
        `sticky` is its session's server (None: a new session, or one whose server failed).

        least_loaded and random keep a session on its server and place a new one on the server with
        the fewest of this pool's requests in flight, or a random one. cache_aware first finds the
        least loaded server (fewest requests, then lowest KV usage) and drops every server with more
        than `max_extra_requests` requests or a KV usage more than `max_extra_kv` above its. Of
        those left it takes the one holding the most leading blocks of the prompt, then the sticky
        one, then the one with the fewest requests, then the lowest KV usage, then the one holding
        the fewest blocks (so distinct prefixes spread over idle servers).
        """
        assert healthy, "choose() needs a healthy server"
        if self.mode != "cache_aware":
            if sticky is not None and sticky.healthy:
                return sticky
            if self.mode == "random":
                return self._rng.choice(healthy)
            return min(healthy, key=lambda s: s.in_flight)
        least = min(healthy, key=lambda s: (s.num_requests, s.kv_usage))
        eligible = [
            s
            for s in healthy
            if s.num_requests <= least.num_requests + self.max_extra_requests
            and s.kv_usage <= least.kv_usage + self.max_extra_kv
        ]
        return max(
            eligible,
            key=lambda s: (s.prefix.match(hashes), s is sticky, -s.num_requests, -s.kv_usage, -len(s.prefix)),
        )

    def hashes(self, request: GenerateRequest) -> list[bytes]:
        """The prompt's block hashes (none outside cache_aware, which alone reads them)."""
        if self.mode != "cache_aware":
            return []
        return prefix_hashes(request.prompt_token_ids, self.block_size, request.cache_salt)

    def sent(self, server: Server, hashes: list[bytes]) -> None:
        """A request went to `server`: its prompt's blocks will be cached there."""
        server.prefix.add(hashes)

    def answered(
        self, server: Server, request: GenerateRequest, response: GenerateResponse, hashes: list[bytes]
    ) -> None:
        """The completion's blocks are cached there too (but its last token, which never ran forward)."""
        if self.mode != "cache_aware" or len(response.token_ids) < 2:
            return
        tokens = [*request.prompt_token_ids, *response.token_ids[:-1]]
        server.prefix.add(prefix_hashes(tokens, self.block_size, request.cache_salt, hashes)[len(hashes) :])

    def observe(self, servers: list[Server]) -> None:
        """After a metrics poll: size each server's index to its KV pool; adopt the servers' block size."""
        for server in servers:
            if server.load is not None and server.load.num_blocks:
                server.prefix.capacity = server.load.num_blocks
        sizes = {s.load.block_size for s in servers if s.load is not None and s.load.block_size}
        if sizes and self.block_size not in sizes:
            self.block_size = min(sizes)
            for server in servers:  # hashes of another block size never match again
                server.prefix.clear()

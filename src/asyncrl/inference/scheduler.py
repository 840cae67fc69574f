"""Continuous-batching scheduler: which tokens of which sequences run in the next engine step.

Each step has a token budget. Running sequences go first (a decode costs one token, an unfinished
prefill continues in chunks), then waiting ones are admitted while budget and `max_num_seqs`
allow, after reusing whatever prefix the cache holds. When the KV pool cannot grow a running
sequence, the latest-admitted one is preempted: its blocks are released (full ones stay in the
prefix cache) and it goes back to the front of the queue, to be recomputed later. A sequence is
never truncated.

A request's blocks are hashed under the weights epoch of its admission (`weights_epoch`, bumped by
the engine on every weight load): a request running across an update keeps its own blocks, while
requests admitted after it never match blocks computed by the old weights. A prefix-cache hit
also hands the request the oldest weights version recorded in the blocks it reuses
(`Request.context_version`); the engine folds in the version of each step that runs it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncrl.inference.block_pool import BlockPool, hash_blocks
from asyncrl.inference.request import Request

__all__ = ["ScheduledSeq", "Scheduler"]


@dataclass(frozen=True, kw_only=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) run now


class Scheduler:
    def __init__(
        self, pool: BlockPool, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.pool, self.block_size = pool, block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.weights_epoch = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, admit: bool = True) -> list[ScheduledSeq]:
        """Pick this step's work. With admit=False only already running sequences advance."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, n):
                break  # `req` itself was preempted: nothing after it is left either
            batch.append(ScheduledSeq(request=req, num_new_tokens=n))
            budget -= n
            i += 1
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            n = self._admit(self.waiting[0], budget)
            if n == 0:
                break
            req = self.waiting.popleft()
            self.running.append(req)
            batch.append(ScheduledSeq(request=req, num_new_tokens=n))
            budget -= n
        return batch

    def commit(self, req: Request, num_new_tokens: int) -> None:
        """After a forward: the new tokens are in the cache; publish newly filled blocks."""
        req.num_computed_tokens += num_new_tokens
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_hashed_blocks:
            return
        req.block_hashes = hash_blocks(
            req.all_token_ids[: num_full * self.block_size],
            self.block_size,
            req.cache_salt,
            req.block_hashes,
            req.weights_epoch,
        )
        for b in range(req.num_hashed_blocks, num_full):
            self.pool.register(req.block_ids[b], req.block_hashes[b], req.context_version)
        req.num_hashed_blocks = num_full

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.release(req.block_ids)
        req.set_blocks([])

    def _reserve(self, req: Request, n: int) -> bool:
        """Grow `req`'s blocks to hold n more tokens, preempting from the back. False if `req` was."""
        while not self._grow(req, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        req.block_ids.extend(blocks)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.release(req.block_ids)
        req.set_blocks([])
        req.num_computed_tokens, req.num_hashed_blocks = 0, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, req: Request, budget: int) -> int:
        """Reuse cached prefix blocks and reserve blocks for the first chunk. Returns its size
        (0: no room)."""
        bs = self.block_size
        tokens = req.all_token_ids
        if req.weights_epoch != self.weights_epoch:  # new, or preempted across a weight load
            req.block_hashes, req.weights_epoch = [], self.weights_epoch
        req.block_hashes = hash_blocks(tokens, bs, req.cache_salt, req.block_hashes, req.weights_epoch)
        # At least the last token must run through the model to produce logits.
        lookup = req.block_hashes[: (len(tokens) - 1) // bs]
        cached = self.pool.match_prefix(lookup)
        n = min(len(tokens) - len(cached) * bs, budget)
        fresh = self.pool.allocate(-(-(len(cached) * bs + n) // bs) - len(cached))
        if fresh is None:
            self.pool.release(cached)
            return 0
        req.set_blocks(cached + fresh)
        req.note_kv_version(self.pool.oldest_kv_version(cached))
        req.num_computed_tokens = len(cached) * bs
        req.num_hashed_blocks = len(cached)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
            self.pool.record_lookup(len(lookup), len(cached))
        return n

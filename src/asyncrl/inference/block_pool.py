"""Bookkeeping of the paged KV cache: free blocks, refcounts, and the automatic prefix cache.

A full block is identified by a hash chain: h_i = blake2b(h_{i-1} || token ids of block i), with
h_{-1} = blake2b(weights epoch || cache_salt). Equal prefixes under different salts never share a
block, and neither do prefixes computed by different weights: the engine's weights epoch counts
weight loads, so after an update no request (salted or not) is served KV of the old weights.
A block whose refcount drops to zero keeps its contents and its hash, and sits in an LRU list
from which it can be revived by a later hit or evicted when a fresh block is needed. A cached block
also records the oldest weights version in the KV it holds or attended over (`kv_version`), so a
request that reuses it takes that version on as its own context version.

The pool knows nothing about tensors; `kv_cache.KVCache` holds the buffers that block ids index.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

__all__ = ["BlockPool", "hash_blocks"]


def _digest(parent: bytes, token_ids: list[int]) -> bytes:
    data = parent + np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def hash_blocks(
    token_ids: list[int], block_size: int, cache_salt: str | None, known: list[bytes], weights_epoch: int = 0
) -> list[bytes]:
    """Hashes of every full block of `token_ids`, extending the already computed chain `known`."""
    key = weights_epoch.to_bytes(8, "little") + ("salt:" + (cache_salt or "")).encode()
    root = hashlib.blake2b(key, digest_size=16).digest()
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(_digest(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


class BlockPool:
    """Allocates KV blocks; caches full blocks by hash; evicts unreferenced cached blocks LRU-first."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_kv_version: list[int | None] = [None] * num_blocks  # of hashed blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never-hashed blocks (a stack)
        self._lru: OrderedDict[int, None] = OrderedDict()  # hashed blocks with refcount 0, oldest first
        self._by_hash: dict[bytes, int] = {}
        self.num_queries = 0  # prompt blocks looked up
        self.num_hits = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Take a reference on the longest run of cached blocks matching `hashes` from the start."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            self._ref(block)
            blocks.append(block)
        return blocks

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count an admitted request's prefix lookup in the hit-rate statistics."""
        self.num_queries += num_queried
        self.num_hits += num_hit

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (refcount 1), evicting cached ones if needed; None when there are too few."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                del self._by_hash[self.block_hash[block]]
                self.block_hash[block], self.block_kv_version[block] = None, None
            self.refcount[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per block. Released in reverse, so a prefix's tail is evicted first."""
        for block in reversed(blocks):
            self.refcount[block] -= 1
            assert self.refcount[block] >= 0, f"block {block} released twice"
            if self.refcount[block] == 0:
                if self.block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._lru[block] = None

    def register(self, block: int, block_hash: bytes, kv_version: int | None = None) -> None:
        """Make a just-filled block findable by its hash (unless an equal block is already cached).

        kv_version: the oldest weights version that computed this block's KV or any KV it attended over.
        """
        if (
            not self.enable_prefix_caching
            or block_hash in self._by_hash
            or self.block_hash[block] is not None
        ):
            return
        self._by_hash[block_hash] = block
        self.block_hash[block] = block_hash
        self.block_kv_version[block] = kv_version

    def oldest_kv_version(self, blocks: list[int]) -> int | None:
        """The oldest `kv_version` among cached `blocks` (None: none recorded)."""
        versions = [v for b in blocks if (v := self.block_kv_version[b]) is not None]
        return min(versions, default=None)

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (referenced ones stay usable by their owners)."""
        for block in list(self._lru):
            del self._by_hash[self.block_hash[block]]
            self.block_hash[block], self.block_kv_version[block] = None, None
            self._free.append(block)
        self._lru.clear()

    def _ref(self, block: int) -> None:
        if self.refcount[block] == 0:
            self._lru.pop(block, None)
        self.refcount[block] += 1

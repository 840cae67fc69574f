"""The receiver in one process, on an in-memory channel: a version lands in the memory of the
version before last only once the engine let go of it, and is the same version either way."""

from __future__ import annotations

import torch

from asyncrl.weight_transfer import BucketReceiver, Shard, pack_buckets


class _Channel:
    """One trainer rank's stream, queued in memory."""

    senders = range(1)

    def __init__(self) -> None:
        self.queue: list = []
        self.acks: list[bool] = []

    def put(self, buckets) -> None:
        self.queue += [(h, p.clone()) for h, p in buckets]

    def recv_bucket(self, src, deadline, buffer=None):
        return self.queue.pop(0)

    def send_ack(self, ok: bool, src) -> None:
        self.acks.append(ok)


def _version(v: int) -> dict[str, torch.Tensor]:
    """Version `v`: the first `v` elements of each weight moved by one (deltas are small)."""
    weights = {"a": torch.zeros(8, 16), "b": torch.ones(4, 32)}
    for t in weights.values():
        t.view(-1)[:v] += 1.0
    return {n: t.bfloat16() for n, t in weights.items()}


def _shards(w: dict[str, torch.Tensor]) -> list[Shard]:
    return [
        Shard(name=n, shape=tuple(t.shape), offset=(0, 0), local_shape=tuple(t.shape), values=t.view(-1))
        for n, t in w.items()
    ]


def _send(channel: _Channel, v: int, base: int | None) -> int:
    """Queue version `v` (a delta on `base` where given); how many of its pieces are deltas."""
    prev = None if base is None else {s.key: s.values for s in _shards(_version(base))}
    buckets = list(
        pack_buckets(_shards(_version(v)), bucket_bytes=1 << 10, version=v, base=prev, base_version=base)
    )
    channel.put(buckets)
    return sum(p.num_changed is not None for h, _ in buckets for p in h.pieces)


def _ptrs(state) -> set[int]:
    return {t.data_ptr() for t in state.values()}


def test_a_version_goes_into_older_memory_only_once_the_engine_released_it():
    channel = _Channel()
    receiver = BucketReceiver(channel, {"a": (8, 16), "b": (4, 32)})
    _send(channel, 1, None)
    _, v1 = receiver.receive()
    v1_bits = {n: t.clone() for n, t in v1.items()}
    _send(channel, 2, 1)
    _, v2 = receiver.receive()
    # the engine may still serve version 1: version 3 gets new memory, version 1 stays as it was
    _send(channel, 3, 2)
    _, v3 = receiver.receive()
    assert not _ptrs(v3) & (_ptrs(v1) | _ptrs(v2))
    assert all(torch.equal(v1[n], v1_bits[n]) for n in v1)
    # the engine serves version 3 now: version 4 is written over version 2
    receiver.released_below = 3
    v3_bits = {n: t.clone() for n, t in v3.items()}
    assert _send(channel, 4, 3) > 0
    version, v4 = receiver.receive()
    assert version == 4 and _ptrs(v4) == _ptrs(v2)
    assert all(torch.equal(v4[n], _version(4)[n]) for n in v4)
    assert all(torch.equal(v3[n], v3_bits[n]) for n in v3)  # the base, still the served version
    assert channel.acks == [True] * 4

"""The trainer's side in one process: snapshots into spare memory, and a delta sender that compares
each version once, whatever the number of channels."""

from __future__ import annotations

import dataclasses

import torch

import asyncrl.weight_transfer.sender as sender_module
from asyncrl.model import Transformer, preset_args
from asyncrl.model.serving import serving_format
from asyncrl.weight_transfer import BucketSender, TransferError, iter_shards


class _Channel:
    """One receiving rank that takes every bucket."""

    receivers = range(1, 2)

    def __init__(self) -> None:
        self.buckets = []

    def send_bucket(self, header, payload, dst) -> None:
        self.buckets.append((header, payload.clone()))

    def recv_ack(self, src) -> bool:
        return True


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(preset_args("tiny-moe"))
    with torch.no_grad():  # every weight initialised: no NaN left from uninitialised memory
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    return model


def _nudge(model: Transformer, rows: int) -> None:
    """Move the first `rows` rows of every 2-d weight far enough to change their bf16 values."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p[:rows] += 1.0


def _bits(shard) -> bytes:
    return shard.values.view(torch.int16).numpy().tobytes()


def _differ(a, b) -> int:
    return int((a.values.view(torch.int16) != b.values.view(torch.int16)).sum())


def test_a_snapshot_into_spare_memory_is_the_fresh_snapshot_in_that_memory():
    model = _model()
    fmt = serving_format(model, torch.bfloat16)
    spare = list(iter_shards(model, fmt))
    _nudge(model, 1)
    fresh = list(iter_shards(model, fmt))
    reused = list(iter_shards(model, fmt, into=spare))
    assert [s.key for s in reused] == [s.key for s in fresh]
    assert all(_bits(a) == _bits(b) for a, b in zip(reused, fresh))
    assert [s.values.data_ptr() for s in reused] == [s.values.data_ptr() for s in spare]
    _nudge(model, 1)  # the optimizer's next step does not reach the snapshot
    assert all(_bits(a) == _bits(b) for a, b in zip(reused, fresh))  # bits: a NaN equals itself


def test_a_delta_sender_compares_once_for_all_channels_and_counts_what_changed(monkeypatch):
    calls = []
    real = sender_module.changes_against
    monkeypatch.setattr(sender_module, "changes_against", lambda a, b: calls.append(1) or real(a, b))
    model = _model()
    fmt = serving_format(model, torch.bfloat16)
    sender = BucketSender(bucket_bytes=1 << 20, delta=True)
    first = list(iter_shards(model, fmt))
    sender.send_shards(first, 0, {"a": _Channel(), "b": _Channel()})
    assert not calls and sender.last_changed is None  # nothing to compare with yet
    _nudge(model, 1)
    second = list(iter_shards(model, fmt))
    channels = {"a": _Channel(), "b": _Channel()}
    stats = sender.send_shards(second, 1, channels)
    assert len(calls) == len(second)  # one comparison per shard, not one per shard and channel
    changed = sum(_differ(a, b) for a, b in zip(first, second))
    assert sender.last_changed == (changed, sum(s.values.numel() for s in second))
    assert 0 < changed < sender.last_changed[1]
    assert stats["a"].num_changed == stats["b"].num_changed == changed
    assert [h for h, _ in channels["a"].buckets] == [h for h, _ in channels["b"].buckets]


def test_changes_found_while_snapshotting_spare_the_senders_comparison(monkeypatch):
    """A snapshot taken `against` the version last sent carries its changes; the sender uses them
    (no comparison of its own) and sends the same buckets as a sender that compares. Changes found
    against another copy of those values are not trusted: that sender compares."""
    calls = []
    real = sender_module.changes_against
    monkeypatch.setattr(sender_module, "changes_against", lambda a, b: calls.append(1) or real(a, b))
    model = _model()
    fmt = serving_format(model, torch.bfloat16)
    fused, plain = (
        BucketSender(bucket_bytes=1 << 16, delta=True),
        BucketSender(bucket_bytes=1 << 16, delta=True),
    )
    first = list(iter_shards(model, fmt))
    fused.send_shards(first, 0, {"a": _Channel()})
    plain.send_shards([dataclasses.replace(s, values=s.values.clone()) for s in first], 0, {"a": _Channel()})
    _nudge(model, 1)
    second = list(iter_shards(model, fmt, against=first))
    assert all(s.changes is not None for s in second)
    got, want = {"a": _Channel()}, {"a": _Channel()}
    fused.send_shards(second, 1, got)
    assert not calls
    plain.send_shards(second, 1, want)  # its base is a copy of `first`: it compares every shard
    assert len(calls) == len(second)
    assert fused.last_changed == plain.last_changed and fused.last_changed[0] > 0
    assert [h for h, _ in got["a"].buckets] == [h for h, _ in want["a"].buckets]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got["a"].buckets, want["a"].buckets, strict=True))
    assert any(p.num_changed for h, _ in got["a"].buckets for p in h.pieces)


class _Breaks(_Channel):
    """A receiver that goes away after taking `after` buckets."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def send_bucket(self, header, payload, dst) -> None:
        if len(self.buckets) == self.after:
            raise TransferError("sending to channel rank 1 failed: connection reset")
        super().send_bucket(header, payload, dst)


def test_each_bucket_is_packed_once_and_goes_to_every_channel_in_turn(monkeypatch):
    """Three channels, one of which breaks mid-version: the buckets are packed once for all, sent
    bucket by bucket across channels, the broken channel gets nothing after its failure and is
    reported, the others take the whole version."""
    packs, order = [], []
    real = sender_module.pack_buckets
    monkeypatch.setattr(sender_module, "pack_buckets", lambda *a, **k: packs.append(1) or real(*a, **k))
    model = _model()
    fmt = serving_format(model, torch.bfloat16)
    sender = BucketSender(bucket_bytes=1 << 14, delta=False)
    channels = {"a": _Channel(), "broken": _Breaks(after=2), "c": _Channel()}
    for name, channel in channels.items():
        send = channel.send_bucket
        channel.send_bucket = lambda h, p, dst, name=name, send=send: order.append(name) or send(h, p, dst)
    results = sender.send_shards(list(iter_shards(model, fmt)), 1, channels)
    assert len(packs) == 1
    assert isinstance(results["broken"], TransferError) and "connection reset" in str(results["broken"])
    n = results["a"].num_buckets + 1  # the stream's last header too
    assert n > 3 and results["c"].num_buckets + 1 == n
    assert order[:6] == ["a", "broken", "c"] * 2 and order[6:9] == ["a", "broken", "c"]
    assert order[9:] == ["a", "c"] * (n - 3)
    assert len(channels["broken"].buckets) == 2
    assert [h for h, _ in channels["a"].buckets] == [h for h, _ in channels["c"].buckets]

"""The trainer's side: send one policy version to every server's channel, in buckets.

    sender = BucketSender(bucket_bytes=256 << 20, delta=True)
    fmt = serving_format(model, torch.bfloat16)      # asyncrl.model.serving; block FP8 with fp8=True
    results = sender.send(model, fmt, version=3, channels={"server0": ch0, "server1": ch1})
    # results["server1"] is a SendStats, or the TransferError that left that server behind

Called on every trainer rank; nothing is collective but FP8's scales. Each rank sends its own
shards (`iter_shards`) to each receiving rank of each channel and waits for its ack; each bucket is
packed once and goes to every channel in turn (the channels that get a delta, then those that get
the whole version). A channel that fails (broken, timed out, or the version refused) is reported,
not raised, so the others still get the version. With `delta`, the rank keeps the serving values
it last sent (its shards only) and sends the whole version instead to a channel whose last send
failed, or one named in `dense` (a server that restarted on a channel of the same name).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from asyncrl.model import Transformer
from asyncrl.model.serving import ServingFormat
from asyncrl.weight_transfer.buckets import Changes, Shard, TransferError, changes_against, pack_buckets
from asyncrl.weight_transfer.channel import Channel
from asyncrl.weight_transfer.shards import iter_shards

__all__ = ["BucketSender", "SendStats"]


@dataclass(frozen=True, kw_only=True)
class SendStats:
    """What this rank sent one channel's receivers (each got the same buckets). Example:
    SendStats(num_buckets=3, num_bytes=1_500_000, num_elements=2_000_000, num_changed=120_000)."""

    num_buckets: int
    num_bytes: int  # payload bytes, per receiving rank
    num_elements: int  # elements of this rank's shards
    num_changed: int  # elements whose serving value changed since the base (all of them for a dense send)


class BucketSender:
    def __init__(self, *, bucket_bytes: int, delta: bool) -> None:
        self.bucket_bytes, self.delta = bucket_bytes, delta
        self._base: dict[str, torch.Tensor] | None = None  # shard key -> serving values last sent
        self._base_version: int | None = None
        self._behind: set[str] = set()  # channels whose last send failed: they get the next one dense
        self._payload: torch.Tensor | None = None  # every bucket is packed here, sent, then overwritten
        self._changes: dict[str, Changes] | None = None  # shard key -> changes against the base, this send
        # (elements whose serving bits changed since the base, elements) of the last send that compared
        # them: delta senders compare once per version, for every channel and for the report
        self.last_changed: tuple[int, int] | None = None
        self._compared: tuple[int, int] | None = None  # (version, id of its shard list) compared last

    def send(
        self,
        model: Transformer,
        fmt: ServingFormat,
        version: int,
        channels: Mapping[str, Channel],
        *,
        dense: Collection[str] = (),
    ) -> dict[str, SendStats | TransferError]:
        """Send `model`'s weights in `fmt` as `version` on every channel; per channel, what went.

        The whole snapshot is taken before the first send: the FP8 scales' all-reduce then never
        waits on a rank that is blocked sending."""
        return self.send_shards(list(iter_shards(model, fmt)), version, channels, dense=dense)

    def send_shards(
        self,
        shards: list[Shard],
        version: int,
        channels: Mapping[str, Channel],
        *,
        dense: Collection[str] = (),
    ) -> dict[str, SendStats | TransferError]:
        """`send` of a snapshot taken before (`iter_shards`): a background thread sends it while
        the trainer's own collectives go on."""
        results: dict[str, SendStats | TransferError] = {}
        if self._compared != (version, id(shards)):
            self.compare(shards, version)
        as_delta = {
            name: self.delta and self._base is not None and name not in dense and name not in self._behind
            for name in channels
        }
        for delta in (True, False):
            group = {n: c for n, c in channels.items() if as_delta[n] == delta}
            if group:
                results |= self._send_group(group, shards, version, delta)
        for name, result in results.items():
            if isinstance(result, TransferError):
                self._behind.add(name)
            else:
                self._behind.discard(name)
        if self.delta:
            self._base, self._base_version = {s.key: s.values for s in shards}, version
        self._compared = None
        return results

    def compare(self, shards: list[Shard], version: int) -> None:
        """With `delta`, find where `shards` differ from the values last sent, once for every
        channel (`send_shards` does it when not done before; the send loop does it first, so that
        no receiver waits through it with a transfer announced). A shard whose snapshot found its
        changes against the very values last sent (`Shard.changes`) is not compared again."""
        self._changes, self.last_changed, self._compared = None, None, (version, id(shards))
        if self.delta and self._base is not None and self._base_version != version:
            self._changes = {
                s.key: self._changes_of(s, self._base[s.key]) for s in shards if s.key in self._base
            }
            total = sum(s.values.numel() for s in shards)
            self.last_changed = (sum(c.count for c in self._changes.values()), total)

    @staticmethod
    def _changes_of(shard: Shard, base: torch.Tensor) -> Changes:
        if shard.changes is not None and shard.changes.base is base:
            return shard.changes
        return changes_against(shard.values, base)

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The payload memory, grown to the largest bucket so far (at most `bucket_bytes`)."""
        if self._payload is None or self._payload.numel() < nbytes or self._payload.device != device:
            self._payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._payload[:nbytes]

    def _send_group(
        self, channels: Mapping[str, Channel], shards: list[Shard], version: int, as_delta: bool
    ) -> dict[str, SendStats | TransferError]:
        """One stream of buckets to every channel of `channels`: each bucket is packed once and sent
        to each channel in turn, so one server places a bucket while the next server receives it.
        A channel whose send fails gets no more buckets; the others go on."""
        base, base_version = (self._base, self._base_version) if as_delta else (None, None)
        live = dict(channels)
        results: dict[str, SendStats | TransferError] = {}
        num_buckets = num_bytes = num_changed = 0
        for header, payload in pack_buckets(
            shards,
            bucket_bytes=self.bucket_bytes,
            version=version,
            base=base,
            base_version=base_version,
            buffer=self._buffer,
            changes=self._changes if as_delta else None,
        ):
            for name, channel in list(live.items()):
                try:
                    for dst in channel.receivers:
                        channel.send_bucket(header, payload, dst)
                except TransferError as e:
                    results[name] = e
                    del live[name]
            num_buckets += not header.last
            num_bytes += header.payload_bytes
            num_changed += sum(p.count if p.num_changed is None else p.num_changed for p in header.pieces)
        num_elements = sum(s.values.numel() for s in shards)
        for name, channel in live.items():
            try:
                refused = [dst for dst in channel.receivers if not channel.recv_ack(dst)]
            except TransferError as e:
                results[name] = e
                continue
            if refused:
                results[name] = TransferError(
                    f"channel ranks {refused} refused version {version} (their logs say why)"
                )
                continue
            results[name] = SendStats(
                num_buckets=num_buckets,
                num_bytes=num_bytes,
                num_elements=num_elements,
                num_changed=num_changed,
            )
        return results

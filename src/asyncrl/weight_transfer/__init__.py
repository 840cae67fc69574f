"""Policy versions from the trainer to the inference servers over torch.distributed, in buckets.

The design is docs/weights-transfer.md: one channel (process group) per server, each trainer rank
sends its own shards in the serving dtype (`BucketSender`), each server assembles a complete
version in staging before it swaps (`BucketReceiver`), dense or delta buckets (`buckets`). In a
run, the channels meet through one control store (`control`): the trainer's ranks send from a
thread (`SendLoop`), each server receives in one (`ReceiveLoop`).

The names below load their module on first use, so that `endpoint` (plain data) imports without
torch: the launcher hands endpoints to its children without paying for the transfer machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "buckets": ("Assembly", "BucketHeader", "Piece", "Shard", "TransferError", "pack_buckets"),
        "channel": ("Channel", "Rendezvous"),
        "control": ("connect_store", "host_store"),
        "endpoint": ("EndpointError", "WeightsEndpoint"),
        "receive_loop": ("ReceiveLoop", "Staged", "StagingTimeout"),
        "receiver": ("BucketReceiver", "as_dtype"),
        "send_loop": ("SendLoop", "VersionReport"),
        "sender": ("BucketSender", "SendStats"),
        "shards": ("iter_shards", "published_shapes"),
    },
)

__all__ = [
    "Assembly",
    "BucketHeader",
    "BucketReceiver",
    "BucketSender",
    "Channel",
    "EndpointError",
    "Piece",
    "ReceiveLoop",
    "Rendezvous",
    "SendLoop",
    "SendStats",
    "Shard",
    "Staged",
    "StagingTimeout",
    "TransferError",
    "VersionReport",
    "WeightsEndpoint",
    "as_dtype",
    "connect_store",
    "host_store",
    "iter_shards",
    "pack_buckets",
    "published_shapes",
]


if TYPE_CHECKING:  # what type checkers and editors see
    from asyncrl.weight_transfer.buckets import (
        Assembly,
        BucketHeader,
        Piece,
        Shard,
        TransferError,
        pack_buckets,
    )
    from asyncrl.weight_transfer.channel import Channel, Rendezvous
    from asyncrl.weight_transfer.control import connect_store, host_store
    from asyncrl.weight_transfer.endpoint import EndpointError, WeightsEndpoint
    from asyncrl.weight_transfer.receive_loop import ReceiveLoop, Staged, StagingTimeout
    from asyncrl.weight_transfer.receiver import BucketReceiver, as_dtype
    from asyncrl.weight_transfer.send_loop import SendLoop, VersionReport
    from asyncrl.weight_transfer.sender import BucketSender, SendStats
    from asyncrl.weight_transfer.shards import iter_shards, published_shapes

"""Policy versions from the trainer to the inference servers over torch.distributed, in buckets.

The design is docs/weights-transfer.md: one channel (process group) per server, each trainer rank
sends its own shards in the serving dtype (`BucketSender`), each server assembles a complete
version in staging before it swaps (`BucketReceiver`), dense or delta buckets (`buckets`).
"""

from asyncrl.weight_transfer.buckets import Assembly, BucketHeader, Piece, Shard, TransferError, pack_buckets
from asyncrl.weight_transfer.channel import Channel, Rendezvous
from asyncrl.weight_transfer.receiver import BucketReceiver, as_dtype
from asyncrl.weight_transfer.sender import BucketSender, SendStats
from asyncrl.weight_transfer.shards import iter_shards, published_shapes

__all__ = [
    "Assembly",
    "BucketHeader",
    "BucketReceiver",
    "BucketSender",
    "Channel",
    "Piece",
    "Rendezvous",
    "SendStats",
    "Shard",
    "TransferError",
    "as_dtype",
    "iter_shards",
    "pack_buckets",
    "published_shapes",
]

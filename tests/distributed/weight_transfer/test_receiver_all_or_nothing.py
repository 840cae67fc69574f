"""A receiver takes whole versions only: a delta on a version it does not hold is refused (and the
stream drained, so the next transfer works), and a trainer that dies mid-version leaves the
receiver on its previous version. One trainer process, one receiver, tiny-moe, gloo. About 8 s."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.model import from_pretrained
from asyncrl.model.serving import serving_format
from asyncrl.tools.init_model import init_model
from asyncrl.weight_transfer import (
    BucketReceiver,
    BucketSender,
    Channel,
    Rendezvous,
    TransferError,
    pack_buckets,
    published_shapes,
)
from asyncrl.weight_transfer.shards import iter_shards
from helpers import free_port

BUCKET_BYTES = 64 << 10


def _bump(model) -> None:
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # a change bf16 keeps


def _sender(channel: Channel, model_dir: Path) -> None:
    model = from_pretrained(model_dir)
    sender = BucketSender(bucket_bytes=BUCKET_BYTES, delta=True)
    ch, fmt = {"a": channel}, serving_format(model, torch.bfloat16)
    assert not isinstance(sender.send(model, fmt, 1, ch)["a"], TransferError)
    _bump(model)
    sender.send(model, fmt, 2, ch)  # a delta the restarted receiver cannot apply
    sender.send(model, fmt, 2, ch, dense={"a"})
    _bump(model)
    buckets = pack_buckets(iter_shards(model, fmt), bucket_bytes=BUCKET_BYTES, version=3)
    for _, (header, payload) in zip(range(5), buckets):  # part of version 3, then the trainer dies
        channel.send_bucket(header, payload, 1)
    os._exit(0)


def _receiver(channel: Channel, model_dir: Path) -> None:
    model = from_pretrained(model_dir)
    shapes = published_shapes(model, serving_format(model, torch.bfloat16))
    first = BucketReceiver(channel, shapes)
    assert first.receive()[0] == 1
    restarted = BucketReceiver(channel, shapes)  # a server back from a restart holds no version
    with pytest.raises(TransferError, match="came as a delta on version 1, but this server holds None"):
        restarted.receive()
    version, state = restarted.receive()
    assert (version, restarted.version) == (2, 2)
    held = dict(state)
    with pytest.raises(TransferError, match="receiving from channel rank 0 failed"):
        restarted.receive()
    assert restarted.version == 2
    assert all(restarted.held[k] is held[k] for k in held)  # the staging of version 3 was dropped
    assert torch.equal(
        held["model.norm.weight"], (from_pretrained(model_dir).model.norm.weight + 1).bfloat16()
    )


def _run(rank: int, port: int, model_dir: Path) -> None:
    torch.set_num_threads(1)
    rdv = Rendezvous(host="127.0.0.1", port=port, num_senders=1, world_size=2)
    channel = Channel.join(rdv, rank=rank, device=torch.device("cpu"), timeout_s=60)
    (_sender if rank == 0 else _receiver)(channel, model_dir)


def test_only_whole_versions_on_a_base_the_receiver_holds_are_taken(tmp_path):
    init_model("tiny-moe", tmp_path, seed=0)
    mp.start_processes(_run, args=(free_port(), tmp_path), nprocs=2, join=True, start_method="fork")

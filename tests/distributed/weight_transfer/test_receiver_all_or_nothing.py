"""A receiver takes whole versions only: a delta on a version it does not hold is refused (and the
stream drained, so the next transfer, dense since the last one failed, works), and a trainer that
dies mid-version, or one whose version does not arrive in time, leaves the receiver on its
previous version. One trainer process, one receiver, tiny-moe, gloo. About 8 s."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

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
from helpers import free_port, run_ranks

BUCKET_BYTES = 64 << 10


def _bump(model) -> None:
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # a change bf16 keeps


def _sender(channels: list[Channel], model_dir: Path) -> None:
    stalls, dies = channels
    model = from_pretrained(model_dir)
    sender = BucketSender(bucket_bytes=BUCKET_BYTES, delta=True)
    ch, fmt = {"a": stalls}, serving_format(model, torch.bfloat16)
    assert not isinstance(sender.send(model, fmt, 1, ch)["a"], TransferError)
    _bump(model)
    refused = sender.send(model, fmt, 2, ch)["a"]  # a delta the restarted receiver cannot apply
    assert isinstance(refused, TransferError) and "refused version 2" in str(refused)
    again = sender.send(model, fmt, 2, ch)["a"]  # dense: the last send to that channel failed
    assert not isinstance(again, TransferError) and again.num_changed == again.num_elements
    _bump(model)
    _send_part(stalls, model, fmt, 3)
    with contextlib.suppress(TransferError):
        stalls.recv_ack(1)  # stalled until the receiver gives up (which closes the channel)
    BucketSender(bucket_bytes=BUCKET_BYTES, delta=False).send(model, fmt, 3, {"b": dies})
    _send_part(dies, model, fmt, 4)
    os._exit(0)  # the trainer dies mid-version


def _send_part(channel: Channel, model, fmt, version: int) -> None:
    buckets = pack_buckets(iter_shards(model, fmt), bucket_bytes=BUCKET_BYTES, version=version)
    for _, (header, payload) in zip(range(5), buckets):
        channel.send_bucket(header, payload, 1)


def _receiver(channels: list[Channel], model_dir: Path) -> None:
    stalls, dies = channels
    model = from_pretrained(model_dir)
    shapes = published_shapes(model, serving_format(model, torch.bfloat16))
    first = BucketReceiver(stalls, shapes)
    assert first.receive()[0] == 1
    restarted = BucketReceiver(stalls, shapes)  # a server back from a restart holds no version
    with pytest.raises(TransferError, match="came as a delta on version 1, but this server holds None"):
        restarted.receive()
    version, state = restarted.receive()
    assert (version, restarted.version) == (2, 2)
    held = dict(state)
    with pytest.raises(TransferError, match="receiving from channel rank 0 failed"):
        restarted.receive(timeout_s=1.0)  # part of version 3 came, then nothing
    assert restarted.version == 2
    assert all(restarted.held[k] is held[k] for k in held)  # the staging of version 3 was dropped
    bumped = (model.model.norm.weight + 1).bfloat16()
    assert torch.equal(held["model.norm.weight"], bumped)
    other = BucketReceiver(dies, shapes)
    assert other.receive()[0] == 3
    with pytest.raises(TransferError, match="receiving from channel rank 0 failed"):
        other.receive()
    assert other.version == 3


def _run(rank: int, ports: list[int], model_dir: Path) -> None:
    torch.set_num_threads(1)
    channels = [
        Channel.join(
            Rendezvous(host="127.0.0.1", port=port, num_senders=1, world_size=2),
            rank=rank,
            device=torch.device("cpu"),
            timeout_s=60,
        )
        for port in ports
    ]
    (_sender if rank == 0 else _receiver)(channels, model_dir)


def test_only_whole_versions_on_a_base_the_receiver_holds_are_taken(tmp_path):
    init_model("tiny-moe", tmp_path, seed=0)
    ports = [free_port(), free_port()]
    run_ranks(_run, 2, ports, tmp_path)

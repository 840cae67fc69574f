"""The sending and receiving threads over one control store, in one process (gloo between threads).

A trainer (one rank) and two servers: each server that joins gets the trainer's current version
whole before any step; a published version reaches both (a delta after the first) with the bits
of the trainer's snapshot (into the memory of the version before last once the server's engine
released it); a server that restarts gets the current version again without a new
step; a transfer that breaks leaves that server behind until it rejoins on a new channel and gets
the version whole; a server whose store never answers times out with a message naming what it holds.
About 3 s on 2 busy cores.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.model import Transformer, from_pretrained
from asyncrl.model.serving import serving_format
from asyncrl.tools.init_model import init_model
from asyncrl.weight_transfer import (
    BucketSender,
    Channel,
    ReceiveLoop,
    SendLoop,
    StagingTimeout,
    TransferError,
    VersionReport,
    WeightsEndpoint,
    host_store,
    iter_shards,
    published_shapes,
)
from helpers import free_port

SERVING = torch.bfloat16


def _step(model: Transformer, seed: int) -> None:
    """A small update: most bf16 values keep their bits, so the next version goes as a delta."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-4 * p.abs())


def _expected(model: Transformer) -> dict[str, torch.Tensor]:
    return {s.name: s.values.view(s.shape) for s in iter_shards(model, serving_format(model, SERVING))}


def _loop(port: int, server: str, shapes) -> ReceiveLoop:
    endpoint = WeightsEndpoint(host="127.0.0.1", port=port, server=server, timeout_s=30)
    loop = ReceiveLoop(endpoint, expected_shapes=shapes)
    loop.start()
    return loop


def _same(state, expected) -> bool:
    return set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())


def test_servers_get_the_current_version_on_join_each_new_version_and_again_after_a_restart(tmp_path):
    init_model("tiny-moe", tmp_path, seed=0)
    model = from_pretrained(tmp_path)
    fmt = serving_format(model, SERVING)
    port = free_port()
    store = host_store(port, num_senders=1)
    reports: list[VersionReport] = []
    snapshot = list(iter_shards(model, fmt))
    sender = SendLoop(
        store,
        rank=0,
        world_size=1,
        sender=BucketSender(bucket_bytes=64 << 10, delta=True),
        timeout_s=30,
        initial=(0, snapshot),
        on_version=reports.append,
    )
    sender.start()
    shapes = published_shapes(model, fmt)
    servers = {name: _loop(port, name, shapes) for name in ("a", "b")}
    try:
        v0 = _expected(model)
        for loop in servers.values():
            staged = loop.wait_staged(0, timeout_s=30)
            assert staged.version == 0 and _same(staged.state, v0)
        memory = {}  # (server, version) -> where its tensors lie
        for version in (1, 2, 3):
            _step(model, version)
            # as the trainer's publisher takes it: changes found against the version last sent
            snapshot = list(iter_shards(model, fmt, against=snapshot))
            sender.submit(version, snapshot)
            sender.wait(version, timeout_s=30)
            want = _expected(model)
            for name, loop in servers.items():
                staged = loop.wait_staged(version, timeout_s=30)
                assert staged.version == version and _same(staged.state, want)
                memory[name, version] = {t.data_ptr() for t in staged.state.values()}
            servers["a"].release(version)  # as a server does once its engine swapped it in
        # server a's engine let go of version 1 before version 3 came: it took version 1's memory
        assert memory["a", 3] == memory["a", 1]
        assert not memory["b", 3] & (memory["b", 1] | memory["b", 2])
        whole = 2 * sum(s.values.numel() * s.values.element_size() for s in iter_shards(model, fmt))
        assert [(r.version, r.servers, r.left_behind) for r in reports] == [
            (1, ("a", "b"), ()),
            (2, ("a", "b"), ()),
            (3, ("a", "b"), ()),
        ]
        for r in reports:  # deltas on the version both servers hold (v0 came whole on join)
            assert 0 < r.changed_fraction < 0.1 and r.num_bytes < whole / 4
        servers["a"].close()
        restarted = servers["a"] = _loop(port, "a", shapes)  # holds nothing: gets version 3 whole
        staged = restarted.wait_staged(3, timeout_s=30)
        assert staged.version == 3 and _same(staged.state, want)
        assert restarted.registration is not None and restarted.registration.gen == 2
    finally:
        for loop in servers.values():
            loop.close()
        sender.close()


def test_a_version_that_does_not_come_in_time_is_a_clear_error(tmp_path):
    init_model("tiny-moe", tmp_path, seed=0)
    model = from_pretrained(tmp_path)
    loop = _loop(free_port(), "lonely", published_shapes(model, serving_format(model, SERVING)))
    try:
        with pytest.raises(
            StagingTimeout, match=r"server 'lonely' did not receive version >= 1 within 0.3 s"
        ):
            loop.wait_staged(1, timeout_s=0.3)
        assert loop.held_version is None
    finally:
        loop.close()


def test_a_transfer_that_breaks_leaves_that_server_behind_and_it_catches_up_on_a_new_channel(
    tmp_path, monkeypatch
):
    """Server b's stream of version 1 breaks after its first bucket: a gets v1, b is reported left
    behind; b registers a new channel generation and gets v1 whole from the trainer, no new version."""
    real = Channel.recv_bucket
    broken = []

    def recv_bucket(self, src, deadline=None, buffer=None):
        header, payload = real(self, src, deadline, buffer)
        if self.rdv.name == "ch/b/1" and header.version == 1 and not broken:
            broken.append(header.version)
            raise TransferError("the stream broke (test)")
        return header, payload

    monkeypatch.setattr(Channel, "recv_bucket", recv_bucket)
    init_model("tiny-moe", tmp_path, seed=0)
    model = from_pretrained(tmp_path)
    fmt = serving_format(model, SERVING)
    port = free_port()
    reports: list[VersionReport] = []
    sender = SendLoop(
        host_store(port, num_senders=1),
        rank=0,
        world_size=1,
        sender=BucketSender(bucket_bytes=64 << 10, delta=True),
        timeout_s=30,
        initial=(0, list(iter_shards(model, fmt))),
        on_version=reports.append,
    )
    sender.start()
    shapes = published_shapes(model, fmt)
    servers = {name: _loop(port, name, shapes) for name in ("a", "b")}
    try:
        for loop in servers.values():
            loop.wait_staged(0, timeout_s=30)
        _step(model, 1)
        sender.submit(1, list(iter_shards(model, fmt)))
        sender.wait(1, timeout_s=30)
        (report,) = reports
        assert (report.servers, report.left_behind) == (("a",), ("b",)) and "b" in report.errors
        want = _expected(model)
        for loop in servers.values():
            staged = loop.wait_staged(1, timeout_s=30)
            assert staged.version == 1 and _same(staged.state, want)
        assert broken == [1] and servers["b"].registration.gen == 2
    finally:
        for loop in servers.values():
            loop.close()
        sender.close()

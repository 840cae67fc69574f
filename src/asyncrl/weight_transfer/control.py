"""The run's control store: where trainer ranks and servers find each other's update channels.

    endpoint = WeightsEndpoint(host="10.0.0.1", port=29700, server="server0")
    store = host_store(endpoint.port, num_senders=2)                    # trainer rank 0, once per run
    store = connect_store(endpoint.host, endpoint.port, timeout_s=30)   # everyone else

One `TCPStore` per run, hosted by trainer rank 0 at the endpoint's host and port (the launcher
picks a free port and hands the endpoint to the trainer and to every server). Every channel lives
under its own prefix of it, so a run has one port however often servers restart. The keys:

    senders                       the trainer's world size W (set by rank 0 when it hosts)
    gen/<server>                  the server's channel generation: +1 each time it (re)joins
    receivers/<server>/<gen>      how many receiving ranks that generation has (R)
    instance/<server>/<id>/<k>    the gen of the k-th registration of one start of a multi-rank server
    registrations                 how many registrations there were; registration/<i> (1-based)
                                  is the i-th as JSON {"server", "gen", "receivers"}: trainer
                                  rank 0 reads them in order and joins each new channel
    ch/<server>/<gen>/...         the channel's own keys (`Channel.join`), and:
    ch/<server>/<gen>/send/<n>    the version of the n-th transfer on that channel (set by trainer
                                  rank 0 before the ranks send): receivers wait here, not in a
                                  collective, between versions
    ch/<server>/<gen>/closed      the trainer dropped the channel: its receivers register anew

Channel ranks 0..W-1 are the trainer's ranks, W..W+R-1 the server's receiving ranks.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from asyncrl.weight_transfer.buckets import TransferError

__all__ = [
    "Registration",
    "channel_name",
    "connect_store",
    "follow",
    "host_store",
    "read_registration",
    "register",
    "wait_any_key",
]

log = logging.getLogger(__name__)

_POLL_S = 0.005  # how often a waiter looks at the store: a TCP round trip each, against latency


@dataclass(frozen=True, kw_only=True)
class Registration:
    """One (re)join of a server: its channel `ch/<server>/<gen>` has `receivers` receiving ranks."""

    server: str
    gen: int
    receivers: int

    @property
    def channel(self) -> str:
        return channel_name(self.server, self.gen)


def channel_name(server: str, gen: int) -> str:
    return f"ch/{server}/{gen}"


def host_store(port: int, *, num_senders: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Host the run's store on `port` (trainer rank 0) and publish the trainer's world size."""
    try:
        store = dist.TCPStore(
            "0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
    except (RuntimeError, dist.DistError) as e:
        raise TransferError(
            f"hosting the weights store on port {port} failed ({e}); is the port taken?"
        ) from e
    store.set("senders", str(num_senders))
    return store


def connect_store(
    host: str, port: int, *, timeout_s: float, attempt_s: float = 1.0, should_stop=lambda: False
) -> dist.TCPStore:
    """A client of the run's store; retries until it answers, `timeout_s` or `should_stop()` (checked
    between attempts of `attempt_s`, so a stop takes effect within one attempt). Logs the first
    retry and then one in 20."""
    deadline = time.monotonic() + timeout_s
    for attempt in itertools.count():
        try:
            return dist.TCPStore(
                host,
                port,
                is_master=False,
                timeout=timedelta(seconds=max(1.0, min(attempt_s, deadline - time.monotonic()))),
            )
        except (RuntimeError, dist.DistError) as e:
            if time.monotonic() >= deadline or should_stop():
                raise TransferError(f"the weights store at {host}:{port} did not answer: {e}") from e
            if attempt % 20 == 0:
                log.info("weights store at %s:%d not up yet (%s); retrying", host, port, e)
            time.sleep(0.5)
    raise AssertionError("unreachable")


def read_registration(store: dist.Store, index: int) -> Registration:
    """The `index`-th registration (1-based); blocks until it is written."""
    return Registration(**json.loads(store.get(f"registration/{index}")))


def register(store: dist.Store, server: str, receivers: int, instance: str, attempt: int) -> Registration:
    """A new generation of `server`'s channel (its receiving rank 0 calls this), logged for the trainer."""
    gen = store.add(f"gen/{server}", 1)
    store.set(f"receivers/{server}/{gen}", str(receivers))
    if instance:
        store.set(f"instance/{server}/{instance}/{attempt}", str(gen))
    reg = Registration(server=server, gen=gen, receivers=receivers)
    index = store.add("registrations", 1)
    store.set(f"registration/{index}", json.dumps({"server": server, "gen": gen, "receivers": receivers}))
    return reg


def follow(store: dist.Store, server: str, instance: str, attempt: int, should_stop) -> Registration | None:
    """The generation that receiving rank 0 of this server start registered for `attempt` (other ranks)."""
    key = f"instance/{server}/{instance}/{attempt}"
    if wait_any_key(store, [key], should_stop=should_stop) is None:
        return None
    gen = int(store.get(key))
    return Registration(server=server, gen=gen, receivers=int(store.get(f"receivers/{server}/{gen}")))


def wait_any_key(
    store: dist.Store, keys: list[str], *, timeout_s: float | None = None, should_stop=lambda: False
) -> str | None:
    """The first of `keys` that is set; None once `should_stop()` or past `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not should_stop():
        for key in keys:
            if store.check([key]):
                return key
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)
    return None

"""A server's receiving thread: joins its update channel and keeps the newest complete version staged.

    loop = ReceiveLoop(endpoint, local_rank=0, num_receivers=1, expected_shapes=shapes)
    loop.start()                                      # returns at once; the thread connects and waits
    staged = loop.wait_staged(min_version=3, timeout_s=120)   # between two engine steps
    engine.load_weights(as_dtype(staged.state, engine.dtype), staged.version)
    loop.release(staged.version)                      # older versions' memory: the next transfer's
    loop.close()

The thread connects to the run's control store (retrying, with a log line, until the trainer is
up), registers a new generation of the server's channel (receiving rank 0 does; the other ranks
of a multi-rank server follow the generation it registered, matched by `endpoint.instance`), joins
the channel, and then takes versions one after the other (`BucketReceiver`), waiting on the store
between them. A transfer that fails (`TransferError`: broken, timed out, refused) keeps the staged
version as it was and registers anew: a gloo group that timed out is unusable, and the trainer
sends a new generation the current version whole. So does a trainer that drops the channel, or a
store that went away (a trainer restarted from a checkpoint hosts a new one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.weight_transfer.buckets import TransferError
from asyncrl.weight_transfer.channel import Channel, Rendezvous
from asyncrl.weight_transfer.control import (
    Registration,
    connect_store,
    follow,
    register,
    wait_any_key,
)
from asyncrl.weight_transfer.endpoint import WeightsEndpoint
from asyncrl.weight_transfer.receiver import BucketReceiver

__all__ = ["ReceiveLoop", "Staged", "StagingTimeout"]

log = logging.getLogger(__name__)

_CONNECT_S = 365 * 24 * 3600.0  # a server waits for its trainer as long as it runs
# the trainer joins a new channel between its own transfers, and only once it has started: a server
# waits that long in the join (transfers keep their own deadline, `endpoint.timeout_s`)
_JOIN_S = 3600.0


class StagingTimeout(TransferError):
    """The version asked for was not received in time; the server keeps the weights it has."""


@dataclass(frozen=True, kw_only=True)
class Staged:
    """A complete version, received and checked. Example: Staged(version=3, state={...}, receive_s=0.41,
    num_bytes=101_000_000)."""

    version: int
    state: Mapping[str, torch.Tensor]  # our names, serving format (`as_dtype` makes it the engine's)
    receive_s: float  # first bucket to last ack
    num_bytes: int  # payload bytes received (a delta's are fewer than the version's)


class ReceiveLoop:
    """See the module docstring. `expected_shapes` is `published_shapes(model, fmt)` of the served model."""

    def __init__(
        self,
        endpoint: WeightsEndpoint,
        *,
        local_rank: int = 0,
        num_receivers: int = 1,
        expected_shapes: Mapping[str, tuple[int, ...]],
        device: torch.device | None = None,
    ) -> None:
        if num_receivers > 1 and not endpoint.instance:
            raise ValueError(
                f"server '{endpoint.server}' receives on {num_receivers} ranks: its endpoint needs an "
                "`instance` shared by those ranks and new at each start of the server"
            )
        assert 0 <= local_rank < num_receivers
        self.endpoint, self.local_rank, self.num_receivers = endpoint, local_rank, num_receivers
        self.expected = dict(expected_shapes)
        self.device = device or torch.device("cpu")
        self._cond = threading.Condition()
        self._staged: Staged | None = None
        self._error: str | None = None  # the last failure, for a StagingTimeout's message
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weights-{endpoint.server}", daemon=True)
        self._attempt = 0  # registrations of this process so far
        self.registration: Registration | None = None  # the channel generation joined last
        self._released: int | None = None  # the engine reads no version older than this

    @property
    def held_version(self) -> int | None:
        """The newest complete version staged, if any."""
        with self._cond:
            return None if self._staged is None else self._staged.version

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and wait up to `timeout_s` for it to end (a transfer under way ends at its
        deadline). A thread left running in a process that later forks can leave the child holding a
        lock of torch.distributed that no thread of the child will release."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def release(self, version: int) -> None:
        """The engine now serves `version` (or its own copy of it) and reads no older version: their
        memory may take the next transfer. Without this call every transfer gets new memory."""
        with self._cond:
            self._released = version if self._released is None else max(self._released, version)

    def wait_staged(self, min_version: int, timeout_s: float) -> Staged:
        """The newest staged version once it is >= `min_version`; StagingTimeout after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._staged is None or self._staged.version < min_version:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    held = None if self._staged is None else self._staged.version
                    raise StagingTimeout(
                        f"server '{self.endpoint.server}' did not receive version >= {min_version} within "
                        f"{timeout_s:g} s (it holds {held}; last transfer error: {self._error or 'none'})"
                    )
                self._cond.wait(left)
            return self._staged

    def _run(self) -> None:
        # One torch thread: beside an engine computing on its own thread, a second OpenMP pool would
        # hold more threads than cores and slow every op of the engine (asyncrl.inference.async_engine).
        torch.set_num_threads(1)
        while not self._stop.is_set():
            try:
                ep = self.endpoint
                store = connect_store(ep.host, ep.port, timeout_s=_CONNECT_S, should_stop=self._stop.is_set)
                self._serve(store)
            except (TransferError, RuntimeError, dist.DistError) as e:
                # the store went away (a trainer restart) or a channel broke: register anew
                self._fail(e)
                time.sleep(0.5)

    def _serve(self, store: dist.Store) -> None:
        """Register and receive until the store fails or the thread stops."""
        while not self._stop.is_set():
            reg = self._register(store)
            if reg is None:
                return
            num_senders = int(store.get("senders"))
            channel = Channel.join(
                Rendezvous(
                    host=self.endpoint.host,
                    port=self.endpoint.port,
                    num_senders=num_senders,
                    world_size=num_senders + reg.receivers,
                    name=reg.channel,
                ),
                rank=num_senders + self.local_rank,
                device=self.device,
                timeout_s=_JOIN_S,
                store=store,
            )
            log.info("weights: server '%s' joined channel %s", self.endpoint.server, reg.channel)
            try:
                self._receive_all(store, channel, reg)
            except TransferError as e:
                self._fail(e)
            finally:
                channel.close()  # before registering anew: a trainer rank still sending on it fails now

    def _register(self, store: dist.Store) -> Registration | None:
        self._attempt += 1
        ep = self.endpoint
        if self.local_rank == 0:
            reg = register(store, ep.server, self.num_receivers, ep.instance, self._attempt)
        else:
            reg = follow(store, ep.server, ep.instance, self._attempt, self._stop.is_set)
        self.registration = reg
        return reg

    def _receive_all(self, store: dist.Store, channel: Channel, reg: Registration) -> None:
        """Versions on one channel until it fails, the trainer drops it, or the thread stops."""
        receiver = BucketReceiver(channel, self.expected)
        closed = f"{reg.channel}/closed"
        n = 1
        while True:
            announced = f"{reg.channel}/send/{n}"
            key = wait_any_key(store, [announced, closed], should_stop=self._stop.is_set)
            if key != announced:
                if key == closed:
                    log.info("weights: the trainer dropped channel %s; joining anew", reg.channel)
                return
            start = time.monotonic()
            with self._cond:
                receiver.released_below = self._released
            version, state = receiver.receive(timeout_s=self.endpoint.timeout_s)
            took = time.monotonic() - start
            self._stage(Staged(version=version, state=state, receive_s=took, num_bytes=receiver.last_bytes))
            n += 1

    def _stage(self, staged: Staged) -> None:
        log.info(
            "weights: server '%s' staged version %d in %.3f s",
            self.endpoint.server,
            staged.version,
            staged.receive_s,
        )
        with self._cond:
            if self._staged is None or staged.version >= self._staged.version:
                self._staged = staged
            self._cond.notify_all()

    def _fail(self, error: Exception) -> None:
        if self._stop.is_set():
            return
        log.warning("weights: server '%s': %s; registering a new channel", self.endpoint.server, error)
        with self._cond:
            self._error = str(error)
            self._cond.notify_all()

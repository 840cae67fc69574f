"""An update channel: the process group of every trainer rank and one server's receiving ranks.

    rdv = Rendezvous(host="10.0.0.1", port=29600, num_senders=2, world_size=3, name="server0/1")
    channel = Channel.join(rdv, rank=2, device=torch.device("cpu"), timeout_s=120)   # on each member
    channel.send_bucket(header, payload, dst=2)        # trainer side
    header, payload = channel.recv_bucket(src=0)       # server side

The group is built outside torch.distributed's default group, from a `TCPStore` that rank 0 hosts
(ranks 0..W-1 are the trainer's, in its own order): gloo on CPU, NCCL on CUDA devices, the same
code. A channel's failure (a member gone, a timeout) is its own; the trainer's collectives and
other servers' channels never see it. `name` prefixes the store's keys: a server that restarts
gets a fresh channel under a new name (its generation), so no key of the old one is read.

A bucket travels as three point-to-point messages: the header's length (int64 [1]), the header
(UTF-8 JSON as uint8), then the payload (uint8 [header.payload_bytes]). Once a receiver has every
sender's stream, it answers each sender with an ack (int64 [1]: 1 taken, 0 refused).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.weight_transfer.buckets import BucketHeader, TransferError

__all__ = ["Channel", "Rendezvous"]


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where a channel's members meet: the launcher hands the same one to every member.
    Example: Rendezvous(host="127.0.0.1", port=29600, num_senders=2, world_size=3, name="server0/1")."""

    host: str
    port: int
    num_senders: int  # the trainer's ranks: channel ranks 0..num_senders-1
    world_size: int  # num_senders + the server's receiving ranks
    name: str = "weights"

    def __post_init__(self) -> None:
        if not 0 < self.num_senders < self.world_size:
            raise ValueError(
                f"a weight channel needs trainer ranks and at least one receiver: num_senders="
                f"{self.num_senders}, world_size={self.world_size}"
            )


class Channel:
    """One member's end of an update channel (see the module docstring)."""

    def __init__(
        self,
        rdv: Rendezvous,
        group: dist.ProcessGroup,
        store: dist.Store,
        *,
        rank: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.rdv, self.rank, self.device = rdv, rank, device
        self.group: dist.ProcessGroup | None = group
        self.timeout = timedelta(seconds=timeout_s)
        self._store = store  # the group reads the store after construction; it must outlive the group

    @property
    def senders(self) -> range:
        return range(self.rdv.num_senders)

    @property
    def receivers(self) -> range:
        return range(self.rdv.num_senders, self.rdv.world_size)

    @classmethod
    def join(
        cls,
        rdv: Rendezvous,
        *,
        rank: int,
        device: torch.device,
        timeout_s: float,
        store: dist.Store | None = None,
    ) -> Channel:
        """Join the channel; returns once every member has joined or raises TransferError. Its keys
        live under `rdv.name` in `store` (the run's control store) when given; otherwise rank 0
        hosts a store of its own at `rdv.host:rdv.port`."""
        timeout = timedelta(seconds=timeout_s)
        try:
            if store is None:
                store = dist.TCPStore(
                    rdv.host, rdv.port, rdv.world_size, is_master=rank == 0, timeout=timeout
                )
            store = dist.PrefixStore(rdv.name, store)
            group = _backend(store, rank, rdv.world_size, device, timeout)
        except (RuntimeError, dist.DistError) as e:
            raise TransferError(
                f"joining the weight channel '{rdv.name}' at {rdv.host}:{rdv.port} failed: {e}"
            ) from e
        return cls(rdv, group, store, rank=rank, device=device, timeout_s=timeout_s)

    def close(self) -> None:
        """Drop the group, so that a peer blocked on this channel fails now instead of at its timeout:
        destroying a gloo group closes its connections (its `abort` and `shutdown` leave a peer's send
        waiting). The channel is unusable afterwards."""
        group, self.group = self.group, None
        if group is not None and self.device.type == "cuda":
            # an NCCL communicator with work in flight must be aborted before it is destroyed
            with contextlib.suppress(RuntimeError, dist.DistError):
                group.abort()

    def send_bucket(self, header: BucketHeader, payload: torch.Tensor, dst: int) -> None:
        data = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
        self._send(torch.tensor([data.numel()], dtype=torch.int64), dst)
        self._send(data, dst)
        if payload.numel():
            self._send(payload, dst)

    def recv_bucket(
        self,
        src: int,
        deadline: float | None = None,
        buffer: Callable[[int], torch.Tensor] | None = None,
    ) -> tuple[BucketHeader, torch.Tensor]:
        """The next bucket from `src`; TransferError past the channel's timeout or `deadline`
        (`time.monotonic()`), whichever comes first. `buffer(n)` gives the uint8 [n] host memory
        the payload lands in (default: new memory; a receiver that is done with each payload before
        the next reuses one, and spares the page faults of fresh memory)."""
        length = self._recv(torch.empty(1, dtype=torch.int64), src, deadline)
        data = self._recv(torch.empty(int(length[0]), dtype=torch.uint8), src, deadline)
        header = BucketHeader.decode(data.numpy().tobytes())
        n = header.payload_bytes
        payload = torch.empty(n, dtype=torch.uint8) if buffer is None else buffer(n)
        if header.payload_bytes:
            payload = self._recv(payload, src, deadline)
        return header, payload

    def send_ack(self, ok: bool, dst: int) -> None:
        """Tell a sender whether its version was taken (it cannot know otherwise: a send may sit in
        socket buffers of a receiver that is gone)."""
        self._send(torch.tensor([int(ok)], dtype=torch.int64), dst)

    def recv_ack(self, src: int) -> bool:
        return bool(self._recv(torch.empty(1, dtype=torch.int64), src, None)[0])

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise TransferError(f"the weight channel '{self.rdv.name}' was closed")
        return self.group

    def _send(self, t: torch.Tensor, dst: int) -> None:
        group = self._group()
        try:
            group.send([t.to(self.device)], dst, 0).wait(self.timeout)
        except (RuntimeError, dist.DistError) as e:
            raise TransferError(f"sending to channel rank {dst} failed: {e}") from e

    def _recv(self, t: torch.Tensor, src: int, deadline: float | None) -> torch.Tensor:
        buf = t.to(self.device)
        timeout = self.timeout
        if deadline is not None:
            timeout = min(timeout, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        group = self._group()
        try:
            group.recv([buf], src, 0).wait(timeout)
        except (RuntimeError, dist.DistError) as e:
            raise TransferError(f"receiving from channel rank {src} failed: {e}") from e
        return buf.cpu()


def _backend(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout: timedelta
) -> dist.ProcessGroup:
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)

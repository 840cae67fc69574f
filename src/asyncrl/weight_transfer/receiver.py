"""A server's side: receive one policy version over its channel into staging, all or nothing.

    receiver = BucketReceiver(channel, published_shapes(model, fmt))
    version, state = receiver.receive()              # serving format; TransferError: nothing changed
    engine.load_weights(as_dtype(state, engine.dtype), version)

Buckets are read from each trainer rank in turn until every rank's stream has ended, and written
into new tensors, or into the memory of the version before the held one once the engine let go of
it (`released_below`); delta pieces start from the version the receiver last completed. Only a
complete version (every published tensor filled exactly, shapes as expected, from a base the
receiver holds) becomes the held version; anything else raises `TransferError` after the streams
are drained where they still flow, and leaves the held version as it was. So does a transfer
that does not end within `timeout_s` (`[weights] timeout_s`); the channel is then to be rebuilt.
Each trainer rank is told (an ack) whether the version was taken, so that both sides agree on
what the server holds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from asyncrl.model.fp8 import FP8_DTYPE
from asyncrl.model.serving import SCALE_SUFFIX, dequantize_blocks
from asyncrl.weight_transfer.buckets import Assembly, BucketHeader, TransferError
from asyncrl.weight_transfer.channel import Channel

__all__ = ["BucketReceiver", "as_dtype"]


def as_dtype(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` in the engine's dtype, converted as the file reader converts (the same bits): FP8
    weights dequantised with their `_scale_inv` blocks, which are dropped. Tensors already in
    `dtype` are shared, not copied: the engine never writes its weights."""
    scales = {name + SCALE_SUFFIX for name, t in state.items() if t.dtype == FP8_DTYPE}
    return {
        name: _dequantize(t, state[name + SCALE_SUFFIX], dtype) if t.dtype == FP8_DTYPE else t.to(dtype)
        for name, t in state.items()
        if name not in scales
    }


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One weight, or a stack of expert weights [E, O, K], block by block as `HFReader` reads it."""
    if q.dim() == 2:
        return dequantize_blocks(q, scale).to(dtype)
    out = torch.empty(q.shape, dtype=dtype)
    for e in range(q.shape[0]):
        out[e].copy_(dequantize_blocks(q[e], scale[e]))
    return out


class BucketReceiver:
    def __init__(self, channel: Channel, expected: Mapping[str, tuple[int, ...]]) -> None:
        self.channel, self.expected = channel, dict(expected)
        self.version: int | None = None  # the version held, once one was received
        self._held: dict[str, torch.Tensor] = {}  # its tensors, the base of delta pieces
        self.last_bytes = 0  # payload bytes of the last transfer, per receiving rank
        self._payload = torch.empty(0, dtype=torch.uint8)  # every bucket lands here; pieces are copied out
        # the version before the held one, kept for its memory: the next version is written there
        # once nothing else reads it, i.e. once the engine serves a version >= `released_below`
        self._retired: tuple[int, dict[str, torch.Tensor]] | None = None
        self.released_below: int | None = None

    @property
    def held(self) -> Mapping[str, torch.Tensor]:
        """The tensors of the held version (serving format), the base of the next delta."""
        return self._held

    def receive(self, timeout_s: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """The next version and its tensors (serving format), within `timeout_s` for the whole
        transfer when given. The caller must not modify them."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        assembly = Assembly(expected=self.expected, base=self._held, spare=self._spare())
        versions, error = set(), None
        self.last_bytes = 0
        for src in self.channel.senders:
            while True:
                # a broken stream raises here
                header, payload = self.channel.recv_bucket(src, deadline, buffer=self._buffer)
                self.last_bytes += header.payload_bytes
                versions.add(header.version)
                if header.last:
                    break
                error = error or self._add(assembly, header, payload)
        if len(versions) != 1:
            error = error or TransferError(f"the trainer ranks sent different versions: {sorted(versions)}")
        try:
            state = assembly.finish() if error is None else None
        except TransferError as e:
            state, error = None, e
        # an ack that cannot be sent raises here: the trainer and this server both keep the old version
        for src in self.channel.senders:
            self.channel.send_ack(error is None, src)
        if error is not None:
            raise error
        assert state is not None
        if self.version is not None:
            self._retired = (self.version, self._held)
        self._held, self.version = state, versions.pop()
        return self.version, state

    def _spare(self) -> dict[str, torch.Tensor]:
        """The retired version's tensors if nothing but this receiver reads them any more."""
        if self._retired is None or self.released_below is None or self._retired[0] >= self.released_below:
            return {}
        return self._retired[1]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._payload.numel() < nbytes:
            self._payload = torch.empty(nbytes, dtype=torch.uint8)
        return self._payload[:nbytes]

    def _add(self, assembly: Assembly, header: BucketHeader, payload: torch.Tensor) -> TransferError | None:
        if header.base_version is not None and header.base_version != self.version:
            return TransferError(
                f"version {header.version} came as a delta on version {header.base_version}, but this "
                f"server holds {self.version}; it needs a dense transfer"
            )
        try:
            for piece in header.pieces:
                assembly.add(piece, payload)
        except TransferError as e:
            return e
        return None

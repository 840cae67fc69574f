"""The bucket format: a header naming pieces of tensors, and one flat byte payload.

A `Shard` is what one trainer rank holds of one published tensor, already in the serving dtype.
`pack_buckets` cuts a rank's shards into buckets of at most `bucket_bytes` payload; a shard larger
than the room left is split across buckets, so a `Piece` is a flat element range of one shard:

    for header, payload in pack_buckets(shards, bucket_bytes=64 << 20, version=3, base=last_sent):
        ...   # header.pieces[i] says where piece i lies in `payload` (uint8 [header.payload_bytes])

A piece is dense (its values) or, when `base` holds the values last sent and that is smaller, a
delta: int32 positions (relative to the piece's start) of the elements whose serving bits
changed, then their new values. `Assembly` puts pieces back into full tensors on the receiving
side; a delta piece starts from the receiver's previous version of the same elements.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from asyncrl.model.dtypes import DTYPES
from asyncrl.model.fp8 import FP8_DTYPE

__all__ = [
    "Assembly",
    "BucketHeader",
    "Changes",
    "Piece",
    "Shard",
    "TransferError",
    "changes_against",
    "copy_differing",
    "count_differing",
    "differing",
    "pack_buckets",
    "shard_key",
]

_POSITION = torch.int32
_ALIGN = 8
# elements compared at a time: a mask of a whole large tensor lands in fresh pages, whose faults
# cost more than the comparison; a chunk's mask stays in cache
_CHUNK = 1 << 20
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # element size -> an integer view of its bits
_WIRE_DTYPES = DTYPES | {"float8_e4m3fn": FP8_DTYPE}  # the serving dtypes, block-FP8 weights included


class TransferError(RuntimeError):
    """A transfer broke or arrived incomplete; the receiver keeps its previous weights."""


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One rank's part of one published tensor. Example: rows 2..3 of a [4, 8] weight:
    Shard(name="model.layers.0.mlp.gate.weight", shape=(4, 8), offset=(2, 0), values=t) with t bf16 [16]."""

    name: str  # our state-dict name (stacked experts)
    shape: tuple[int, ...]  # the full tensor's
    offset: tuple[int, ...]  # where the shard starts in the full tensor, per dim
    local_shape: tuple[int, ...]
    values: torch.Tensor  # [prod(local_shape)], serving dtype, row-major

    changes: Changes | None = None  # where `values` differ from an earlier snapshot's, found while taking it

    @property
    def key(self) -> str:
        return shard_key(self.name, self.offset)


@dataclass(frozen=True, kw_only=True)
class Changes:
    """Where one shard's values differ in their bits from `base` (the values of an earlier version),
    and what they are there. Example: Changes(base=b, count=2, positions=tensor([3, 17]),
    values=tensor([.5, 2.])) with b bf16 [1024]: a delta against `b` sends 2 positions and 2 values.
    Where so many changed that a delta of the whole shard would be larger than the shard (more than
    a third of bf16 values), positions and values are None: the shard goes dense, and its positions
    never take more memory than its values."""

    base: torch.Tensor  # compared against: the changes hold for this very tensor only
    count: int  # elements that differ
    positions: torch.Tensor | None  # int64, ascending (None: too many, send the shard dense)
    values: torch.Tensor | None  # the new values at `positions`, in the shard's dtype


def shard_key(name: str, offset: tuple[int, ...]) -> str:
    """What names one shard among all ranks' shards of one version: the tensor and its offset."""
    return f"{name}@{','.join(map(str, offset))}"


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Elements [start, start + count) of one shard, at bytes [at, at + nbytes) of the payload.
    Example: Piece(name="lm_head.weight", shape=(64, 32), offset=(32, 0), local_shape=(32, 32),
    dtype="bfloat16", start=0, count=1024, at=0, nbytes=2048, num_changed=None)."""

    name: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    start: int
    count: int
    at: int
    nbytes: int
    num_changed: int | None = None  # a delta piece: this many positions, then as many values

    @classmethod
    def from_json(cls, d: dict) -> Piece:
        tuples = {k: tuple(d[k]) for k in ("shape", "offset", "local_shape")}
        return cls(**(d | tuples))


@dataclass(frozen=True, kw_only=True)
class BucketHeader:
    """What one bucket holds. `last` marks the end of a rank's stream (no pieces). Example:
    BucketHeader(version=3, base_version=2, pieces=(...), payload_bytes=67108864, last=False)."""

    version: int
    base_version: int | None  # the version delta pieces apply to (None: every piece is dense)
    pieces: tuple[Piece, ...] = ()
    payload_bytes: int = 0
    last: bool = False

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> BucketHeader:
        d = json.loads(data)
        return cls(**(d | {"pieces": tuple(Piece.from_json(p) for p in d["pieces"])}))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _chunk_masks(
    a: torch.Tensor, b: torch.Tensor, fill: Callable[[int, int], object] | None = None
) -> Iterator[tuple[int, np.ndarray]]:
    """(start, mask of the elements that differ) per chunk of the flat CPU integer tensors `a`, `b`;
    one mask memory serves every chunk (valid until the next is drawn). `fill(i, j)`, when given,
    writes elements [i, j) of `a` first, so a chunk is compared while it is in cache."""
    a_np, b_np = a.numpy(), b.numpy()
    mask = np.empty(min(_CHUNK, a_np.size), dtype=bool)
    for i in range(0, a_np.size, _CHUNK):
        j = min(i + _CHUNK, a_np.size)
        if fill is not None:
            fill(i, j)
        m = mask[: j - i]
        np.not_equal(a_np[i:j], b_np[i:j], out=m)
        yield i, m


def _joined(parts: list[np.ndarray], dtype: np.dtype) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, dtype=dtype))


def count_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of `a` and `b` (flat, same dtype) differ in their bits."""
    a, b = _bits(a), _bits(b)
    if a.device.type != "cpu":
        return int(torch.count_nonzero(a != b))
    return sum(int(np.count_nonzero(m)) for _, m in _chunk_masks(a, b))


def differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The positions (int64, ascending) where the flat tensors `a` and `b` (same dtype) differ in
    their bits. On the CPU through numpy, whose nonzero is ~3x faster than torch's here: this
    comparison of the whole model is most of a delta update's cost on the trainer."""
    a, b = _bits(a), _bits(b)
    if a.device.type != "cpu":
        return (a != b).nonzero().view(-1)
    return _joined([np.flatnonzero(m) + i for i, m in _chunk_masks(a, b)], np.int64)


def _most_changed(numel: int, itemsize: int) -> int:
    """The most changed elements for which a delta of `numel` values can be smaller than them dense."""
    return numel * itemsize // (4 + itemsize)


def changes_against(values: torch.Tensor, base: torch.Tensor) -> Changes:
    """`Changes` of the flat `values` against `base` (same dtype), compared now."""
    if values.device.type == "cpu":
        return _collect_changes(values, base)
    where = differing(values, base)
    if where.numel() > _most_changed(values.numel(), values.element_size()):
        return Changes(base=base, count=where.numel(), positions=None, values=None)
    return Changes(base=base, count=where.numel(), positions=where, values=values.index_select(0, where))


def copy_differing(out: torch.Tensor, src: torch.Tensor, base: torch.Tensor) -> Changes:
    """Cast `src` into `out` (both flat, `out` in `base`'s dtype) and find where `out` then differs
    from `base`, chunk by chunk: each chunk is compared, and its changed values taken, while it is in
    cache. One pass instead of three (cast, compare, gather), which on a CPU each read the whole
    model; a delta update's cost on the trainer is mostly these passes."""
    assert out.numel() == src.numel() == base.numel() and out.dtype == base.dtype
    if out.device.type != "cpu":
        out.copy_(src)
        return changes_against(out, base)
    return _collect_changes(out, base, fill=lambda i, j: out[i:j].copy_(src[i:j]))


def _collect_changes(
    new: torch.Tensor, base: torch.Tensor, fill: Callable[[int, int], object] | None = None
) -> Changes:
    """`Changes` of the flat CPU tensor `new` against `base`, chunk by chunk (`_chunk_masks`, which
    calls `fill` to write each chunk of `new` first). Past `_most_changed` elements only the count
    goes on: the shard will go dense."""
    new_np = _bits(new).numpy()
    most, count = _most_changed(new.numel(), new.element_size()), 0
    positions, values = [], []
    for i, m in _chunk_masks(_bits(new), _bits(base), fill):
        if count > most:
            count += int(np.count_nonzero(m))
            continue
        where = np.flatnonzero(m)
        count += where.size
        values.append(new_np[i : i + m.size][where])
        positions.append(where + i)
    if count > most:
        return Changes(base=base, count=count, positions=None, values=None)
    return Changes(
        base=base,
        count=count,
        positions=_joined(positions, np.int64),
        values=_joined(values, new_np.dtype).view(new.dtype),
    )


def _encode(new: torch.Tensor, changes: Changes | None, start: int) -> tuple[list[torch.Tensor], int | None]:
    """The payload parts of the piece `new` (elements from `start` of its shard): dense [values], or
    delta [positions, values] when smaller; `changes` are the shard's against the base (None: no
    base, dense)."""
    if changes is None or changes.positions is None or changes.values is None:
        return [new], None
    bounds = torch.tensor([start, start + new.numel()])
    lo, hi = (int(i) for i in torch.searchsorted(changes.positions, bounds))
    if (hi - lo) * (4 + new.element_size()) >= new.numel() * new.element_size():
        return [new], None
    return [(changes.positions[lo:hi] - start).to(_POSITION), changes.values[lo:hi]], hi - lo


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.numel():  # an empty tensor may have stride 0, which no dtype view accepts
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(-1).view(torch.uint8)


def pack_buckets(
    shards: Iterable[Shard],
    *,
    bucket_bytes: int,
    version: int,
    base: Mapping[str, torch.Tensor] | None = None,
    base_version: int | None = None,
    buffer: Callable[[int, torch.device], torch.Tensor] | None = None,
    changes: Mapping[str, Changes] | None = None,
) -> Iterator[tuple[BucketHeader, torch.Tensor]]:
    """Buckets of at most `bucket_bytes` payload (uint8) from `shards`, dense or delta against `base`
    (shard key -> the values of version `base_version` last sent); the stream ends with a `last` header.

    `buffer(n, device)` gives the uint8 [n] tensor a payload is packed into (default: a new one).
    A sender that reuses one memory for every bucket (each sent before the next is drawn) saves
    the page faults of fresh memory, which cost more than the copy itself. `changes` (shard key ->
    its `Changes` against `base`) spares the comparison when the caller already made it, e.g. for
    the first of several channels, or while taking the snapshot (`copy_differing`)."""
    assert (base is None) == (base_version is None), "a delta base needs its version"
    if not 8 <= bucket_bytes <= 1 << 31:
        raise ValueError(
            f"bucket_bytes must hold one element of any dtype and keep delta positions in int32 "
            f"(8 to 2**31), got {bucket_bytes}"
        )
    pieces: list[Piece] = []
    parts: list[torch.Tensor] = []
    # payload bytes, and the bytes the bucket's pieces take dense: a bucket covers at most
    # `bucket_bytes` of dense values even when its deltas are small, so that a delta stream comes
    # in as many buckets as a dense one and the receiver places one while the next is packed
    used = covered = 0

    def flush() -> tuple[BucketHeader, torch.Tensor]:
        nonlocal pieces, parts, used, covered
        device = parts[0].device if parts else torch.device("cpu")
        payload = (
            torch.empty(used, dtype=torch.uint8, device=device) if buffer is None else buffer(used, device)
        )
        end = 0
        for piece, blob in zip(pieces, parts):
            payload[end : piece.at] = 0  # alignment padding: the same bytes whatever the buffer held
            payload[piece.at : piece.at + piece.nbytes] = blob
            end = piece.at + piece.nbytes
        header = BucketHeader(
            version=version, base_version=base_version, pieces=tuple(pieces), payload_bytes=used
        )
        pieces, parts, used, covered = [], [], 0, 0
        return header, payload

    for shard in shards:
        itemsize = shard.values.element_size()
        changed = None
        if base is not None and shard.key in base:
            known = None if changes is None else changes.get(shard.key)
            changed = changes_against(shard.values, base[shard.key]) if known is None else known
        start = 0
        while start < shard.values.numel():
            if _align(covered) + itemsize > bucket_bytes:
                yield flush()
            used, covered = _align(used), _align(covered)
            count = min(shard.values.numel() - start, (bucket_bytes - covered) // itemsize)
            covered += count * itemsize
            new = shard.values[start : start + count]
            encoded, num_changed = _encode(new, changed, start)
            blob = torch.cat([_as_bytes(t) for t in encoded]) if len(encoded) > 1 else _as_bytes(encoded[0])
            pieces.append(_piece(shard, start, count, used, blob.numel(), num_changed))
            parts.append(blob)
            used += blob.numel()
            start += count
    if pieces:
        yield flush()
    yield (
        BucketHeader(version=version, base_version=base_version, last=True),
        torch.empty(0, dtype=torch.uint8),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in _WIRE_DTYPES.items() if d == dtype)


def _align(nbytes: int) -> int:
    """Pieces start on 8-byte boundaries, so each views the payload in its own dtype without a copy."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _piece(shard: Shard, start: int, count: int, at: int, nbytes: int, num_changed: int | None) -> Piece:
    return Piece(
        name=shard.name,
        shape=shard.shape,
        offset=shard.offset,
        local_shape=shard.local_shape,
        dtype=_dtype_name(shard.values.dtype),
        start=start,
        count=count,
        at=at,
        nbytes=nbytes,
        num_changed=num_changed,
    )


@dataclass(kw_only=True)
class Assembly:
    """Full tensors in the serving format, filled piece by piece. `base` is the previous version
    (name -> full tensor), which delta pieces start from; `filled` counts elements per name.
    `spare`: tensors nothing reads any more (an older version's), written over where name, shape
    and dtype match instead of new memory, whose page faults cost more than the writes."""

    expected: Mapping[str, tuple[int, ...]]  # every tensor the model publishes, with its shape
    base: Mapping[str, torch.Tensor] = field(default_factory=dict)
    spare: Mapping[str, torch.Tensor] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    filled: dict[str, int] = field(default_factory=dict)

    def add(self, piece: Piece, payload: torch.Tensor) -> None:
        """Write one piece (its bytes are `payload[piece.at : piece.at + piece.nbytes]`)."""
        if self.expected.get(piece.name) != piece.shape:
            want = self.expected.get(piece.name)
            raise TransferError(
                f"tensor '{piece.name}' arrived with shape {list(piece.shape)}, expected {want}"
            )
        dtype = _WIRE_DTYPES[piece.dtype]
        full = self.tensors.get(piece.name)
        if full is None:
            full = self.spare.get(piece.name)
            if full is None or full.shape != piece.shape or full.dtype != dtype:
                full = torch.empty(piece.shape, dtype=dtype)
            self.tensors[piece.name] = full
        region = _Region(_bits(full), piece)  # bits: the same for every dtype, FP8 included
        data = payload[piece.at : piece.at + piece.nbytes]
        if piece.num_changed is None:
            region.write(data.view(region.full.dtype))
        else:
            base = self.base.get(piece.name)
            if base is None:
                raise TransferError(f"a delta piece of '{piece.name}' arrived but the receiver holds no base")
            n = piece.num_changed
            region.patch(
                _bits(base), data[: 4 * n].view(_POSITION).long(), data[4 * n :].view(region.full.dtype)
            )
        self.filled[piece.name] = self.filled.get(piece.name, 0) + piece.count

    def finish(self) -> dict[str, torch.Tensor]:
        """The complete state (serving format); TransferError naming what is missing otherwise."""
        short = [n for n, shape in self.expected.items() if self.filled.get(n, 0) != math.prod(shape)]
        if short:
            raise TransferError(
                f"incomplete transfer: {len(short)} tensors not (exactly) filled, e.g. {short[:3]}"
            )
        return self.tensors


class _Region:
    """Elements [start, start + count) of a shard inside a full tensor, in the shard's row-major order."""

    def __init__(self, full: torch.Tensor, piece: Piece) -> None:
        self.full, self.piece = full, piece
        lead = next((d for d, (n, k) in enumerate(zip(piece.shape, piece.local_shape)) if n != k), 0)
        # one contiguous range when only one dim is split and every dim before it has size 1
        # (FSDP's and EP's dim-0 shards); otherwise the shard's elements are strided in the full tensor
        self.contiguous = (
            math.prod(piece.shape[:lead]) == 1 and piece.shape[lead + 1 :] == piece.local_shape[lead + 1 :]
        )

    def _flat(self) -> torch.Tensor | slice:
        p = self.piece
        if self.contiguous:
            first = sum(o * math.prod(p.shape[d + 1 :]) for d, o in enumerate(p.offset))
            return slice(first + p.start, first + p.start + p.count)
        grid = torch.arange(math.prod(p.shape)).view(p.shape)
        index = tuple(slice(o, o + k) for o, k in zip(p.offset, p.local_shape))
        return grid[index].reshape(-1)[p.start : p.start + p.count]

    def write(self, values: torch.Tensor) -> None:
        self.full.view(-1)[self._flat()] = values

    def patch(self, base: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
        """The region as in `base` (a full tensor), but `values` at positions `where` of the region."""
        flat = self._flat()
        if isinstance(flat, slice):  # a view: patch in place
            region = self.full.view(-1)[flat]
            region.copy_(base.view(-1)[flat])
            region.index_copy_(0, where, values)  # faster than `region[where] = values` here
        else:
            region = base.view(-1)[flat]  # advanced indexing: a copy
            region[where] = values
            self.write(region)

"""Read blocks of tensors from one safetensors file with positioned reads, never mapping the file.

safetensors' own `safe_open` maps the file: every page a slice touches stays in the reader's
resident set until the file is closed, so a rank that reads its shard of a checkpoint would hold
it twice at the peak (the mapped pages and its tensors). Here a block is read with `os.preadv`
straight into the tensor that returns it, so only that tensor is resident (the kernel's page cache
is not counted against the process).

The format: an 8-byte little-endian header size N, N bytes of JSON (`{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`), then the data, row-major, offsets relative
to byte 8 + N.

    f = SafetensorsFile(path)
    f.entries["model.norm.weight"].shape                     # from the header
    rows = f.read("model.embed_tokens.weight", (slice(0, 64), slice(0, 128)))
    f.close()
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DTYPES", "SafetensorsError", "SafetensorsFile", "TensorEntry"]

DTYPES = {  # safetensors' floating dtype names
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024**2  # safetensors' own limit
_MAX_READ = 1 << 30  # bytes per preadv call (Linux caps one call just under 2 GiB)


class SafetensorsError(ValueError):
    """A file that is not valid safetensors (truncated, corrupt header, offsets out of range)."""


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file
    end: int


class SafetensorsFile:
    """One open safetensors file: its header entries, and positioned reads of blocks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.entries = self._read_header()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The block `index` (one [start, stop) slice per dim, step 1) of tensor `name`, as stored.

        The block is read as contiguous runs: one run when only the leading dim is cut (every
        row-sharded weight), one per index of the dims before the innermost cut one otherwise.
        """
        entry = self.entries[name]
        if entry.dtype not in DTYPES:
            raise SafetensorsError(f"tensor '{name}' has dtype {entry.dtype}, which cannot be read here")
        dtype, shape = DTYPES[entry.dtype], entry.shape
        sizes = [s.stop - s.start for s in index]
        itemsize = dtype.itemsize
        cut = [d for d, s in enumerate(index) if (s.start, s.stop) != (0, shape[d])]
        inner = cut[-1] if cut else 0  # dims after `inner` are whole: each run is contiguous
        strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
        run = sizes[inner] * strides[inner] if shape else itemsize
        out = torch.empty(math.prod(sizes) * itemsize, dtype=torch.uint8)
        view = out.numpy()
        pos = 0
        for lead in itertools.product(*(range(s.start, s.stop) for s in index[:inner])):
            offset = sum(i * strides[d] for d, i in enumerate(lead))
            offset += index[inner].start * strides[inner] if shape else 0
            self._pread(view[pos : pos + run], entry.begin + offset)
            pos += run
        return out.view(dtype).view(sizes)

    def _pread(self, buf, offset: int) -> None:
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done : done + _MAX_READ]], offset + done)
            if n == 0:
                raise SafetensorsError(f"unexpected end of file at byte {offset + done}")
            done += n

    def _read_header(self) -> dict[str, TensorEntry]:
        size = os.fstat(self._fd).st_size
        raw = os.pread(self._fd, 8, 0)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise SafetensorsError(f"header size {n} does not fit a file of {size} bytes")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise SafetensorsError("header is not a JSON object")
        header.pop("__metadata__", None)
        entries = {}
        for name, meta in header.items():
            try:
                begin, end = (8 + n + int(o) for o in meta["data_offsets"])
                shape = tuple(map(int, meta["shape"]))
                entry = TensorEntry(dtype=str(meta["dtype"]), shape=shape, begin=begin, end=end)
            except (KeyError, TypeError, ValueError) as e:
                raise SafetensorsError(
                    f"header entry of '{name}' is malformed ({type(e).__name__}: {e})"
                ) from None
            if not 8 + n <= begin <= end <= size:
                raise SafetensorsError(
                    f"tensor '{name}' spans bytes [{begin}, {end}) of a file of {size} bytes (truncated?)"
                )
            known = DTYPES.get(entry.dtype)
            if known is not None and end - begin != math.prod(entry.shape) * known.itemsize:
                raise SafetensorsError(
                    f"tensor '{name}' has {end - begin} bytes for shape {list(entry.shape)}"
                )
            entries[name] = entry
        return entries

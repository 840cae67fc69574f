"""The binary body of `POST /v1/generate`: a JSON header, then the routed experts as raw bytes.

A client that sends `Accept: application/x-asyncrl-generate` gets this body instead of JSON; any
other client gets JSON, whose `routed_experts.data` is base64 (4/3 the bytes, and a decode pass).

    body = encode_generate(response)        # server
    response = decode_generate(body)        # client; the rows are a read-only view of `body`

Layout (little-endian):

    b"ARG1"                magic
    uint32                 header length H
    H bytes                UTF-8 JSON: the `GenerateResponse` fields, `routed_experts` without `data`
    the rest               the routed-expert rows, C order, `shape` and `dtype` as the header says

Torch-free.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from pydantic import ValidationError

from asyncrl.wire.http import GenerateResponse, RoutedExperts

__all__ = ["GENERATE_MEDIA_TYPE", "BinaryBodyError", "decode_generate", "encode_generate"]

GENERATE_MEDIA_TYPE = "application/x-asyncrl-generate"
_MAGIC = b"ARG1"
_PREFIX = struct.Struct("<4sI")


class BinaryBodyError(ValueError):
    """A binary `/v1/generate` body that does not follow the layout (truncated, wrong sizes, bad header)."""


def encode_generate(response: GenerateResponse) -> bytes:
    """`response` as a binary body: the header, then the routing rows with no base64 pass."""
    header = response.model_dump(mode="json", exclude={"routed_experts"})
    rows = b""
    if (routed := response.routed_experts) is not None:
        header["routed_experts"] = {"shape": routed.shape, "dtype": routed.dtype, "start": routed.start}
        rows = routed.to_bytes()
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(_MAGIC, len(head)), head, rows])


def decode_generate(body: bytes) -> GenerateResponse:
    """The `GenerateResponse` of a binary body; BinaryBodyError when it breaks the layout or the contract."""
    if len(body) < _PREFIX.size:
        raise BinaryBodyError(f"body of {len(body)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, head_len = _PREFIX.unpack_from(body)
    if magic != _MAGIC:
        raise BinaryBodyError(f"body starts with {magic!r}, not {_MAGIC!r}")
    rows_at = _PREFIX.size + head_len
    if rows_at > len(body):
        raise BinaryBodyError(f"header of {head_len} bytes runs past the {len(body)}-byte body")
    try:
        header = json.loads(body[_PREFIX.size : rows_at])
        routed = header.pop("routed_experts", None)
        if routed is not None:
            header["routed_experts"] = _rows(body, rows_at, routed)
        elif rows_at != len(body):
            raise BinaryBodyError(f"{len(body) - rows_at} bytes follow a header without routed_experts")
        return GenerateResponse.model_validate(header)
    except BinaryBodyError:
        raise
    except (ValueError, TypeError, KeyError, ValidationError) as e:
        raise BinaryBodyError(f"bad header: {type(e).__name__}: {e}") from None


def _rows(body: bytes, offset: int, meta: dict) -> RoutedExperts:
    shape, dtype = [int(d) for d in meta["shape"]], np.dtype(meta["dtype"])
    if dtype not in (np.uint8, np.uint16) or len(shape) != 3 or min(shape) < 0:
        raise BinaryBodyError(f"routed_experts must be uint8/uint16 [T, L, K], got {dtype} {shape}")
    if (need := math.prod(shape) * dtype.itemsize) != len(body) - offset:
        raise BinaryBodyError(
            f"routed_experts {shape} {dtype} need {need} bytes, the body has {len(body) - offset}"
        )
    rows = np.frombuffer(body, dtype=dtype.newbyteorder("<"), offset=offset).reshape(shape)
    return RoutedExperts.from_array(rows.astype(dtype, copy=False), start=int(meta.get("start", 0)))

"""The binary body of /v1/generate: raw routing rows after a JSON header, exact and checked."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from asyncrl.wire import GenerateResponse, RoutedExperts
from asyncrl.wire.binary import BinaryBodyError, decode_generate, encode_generate


def _response(rows: np.ndarray | None, start: int = 0) -> GenerateResponse:
    return GenerateResponse(
        token_ids=[7, 8, 9],
        logprobs=[-0.25, -1.5, -3.0],
        policy_versions=[2, 2, 3],
        finish_reason="length",
        num_cached_tokens=16,
        context_version=2,
        routed_experts=None if rows is None else RoutedExperts.from_array(rows, start=start),
    )


@pytest.mark.parametrize("dtype,num_experts", [(np.uint8, 256), (np.uint16, 384)])
def test_binary_body_round_trips_bit_for_bit(dtype, num_experts):
    rows = np.random.default_rng(0).integers(0, num_experts, (5, 4, 8)).astype(dtype)
    body = encode_generate(_response(rows, start=11))
    out = decode_generate(body)
    assert out == _response(rows, start=11)
    back = out.routed_experts.to_array()
    assert back.dtype == dtype and back.tobytes() == rows.tobytes() and out.routed_experts.start == 11
    # the rows travel raw: the body is the header plus exactly their bytes, no base64
    assert body.endswith(rows.tobytes()) and base64.b64encode(rows.tobytes()) not in body


def test_binary_body_without_routing():
    out = decode_generate(encode_generate(_response(None)))
    assert out == _response(None) and out.routed_experts is None


def test_json_of_a_message_built_from_an_array_is_the_base64_of_its_bytes():
    rows = np.arange(2 * 3 * 2, dtype=np.uint16).reshape(2, 3, 2) * 300
    data = json.loads(_response(rows, start=4).model_dump_json())["routed_experts"]
    assert data == {"data": base64.b64encode(rows.astype("<u2").tobytes()).decode(), "shape": [2, 3, 2]} | {
        "dtype": "uint16",
        "start": 4,
    }
    with pytest.raises(ValueError, match="data holds 0 base64 characters; shape"):
        RoutedExperts.model_validate(data | {"data": ""})


def test_bad_binary_bodies_are_named():
    body = encode_generate(_response(np.zeros((3, 2, 2), np.uint8)))
    cases = [
        (body[:5], "shorter than the 8-byte prefix"),
        (b"JSON" + body[4:], "not b'ARG1'"),
        (body[:-1], r"need 12 bytes, the body has 11"),
        (body + b"\0", r"need 12 bytes, the body has 13"),
        (encode_generate(_response(None)) + b"\0", "1 bytes follow a header without routed_experts"),
        (body[:8] + b"[" + body[9:], "bad header"),
    ]
    for bad, match in cases:
        with pytest.raises(BinaryBodyError, match=match):
            decode_generate(bad)

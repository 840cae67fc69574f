"""Translation between our token-in/token-out messages and vLLM's /inference/v1/generate."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from pydantic import ValidationError

from asyncrl.wire import GenerateRequest, GenerateResponse, RoutedExperts
from asyncrl.wire.vllm import (
    VLLMGenerateRequest,
    VLLMProtocolError,
    from_vllm_generate,
    parse_version_label,
    to_vllm_answer,
    to_vllm_generate,
)


def _answer(token_ids, spans, *, finish="length", routed=None, cached=None):
    return {
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "token_ids": token_ids,
                "logprobs": {
                    "content": [{"token_id": t, "logprob": -0.5 - i} for i, t in enumerate(token_ids)]
                },
                "weight_versions": spans,
                "routed_experts": routed,
            }
        ],
        "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": cached} if cached else None},
    }


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def test_request_maps_sampling_salt_and_ignore_eos():
    req = GenerateRequest(
        prompt_token_ids=[5, 6, 7],
        max_tokens=9,
        temperature=0.7,
        top_k=0,
        seed=3,
        ignore_eos=True,
        stop_token_ids=[2],
        cache_salt="4",
    )
    body = to_vllm_generate(req, kv_transfer_params={"do_remote_decode": True})
    assert body["token_ids"] == [5, 6, 7]
    assert body["cache_salt"] == "4"
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["top_k"], sp["seed"]) == (9, 0.7, -1, 3)
    assert sp["ignore_eos"] is True and sp["stop_token_ids"] == [2] and sp["logprobs"] == 0
    assert "cache_salt" not in to_vllm_generate(GenerateRequest(prompt_token_ids=[1]))


def test_weight_version_spans_become_exact_per_token_versions():
    req = GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=5)
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 5}]
    out = from_vllm_generate(_answer([9, 8, 7, 6, 5], spans, cached=2), req)
    assert out.token_ids == [9, 8, 7, 6, 5]
    assert out.policy_versions == [0, 0, 7, 7, 7]
    assert out.logprobs == [-0.5, -1.5, -2.5, -3.5, -4.5]
    assert out.finish_reason == "length" and out.num_cached_tokens == 2
    assert out.prompt_token_ids is None and out.routed_experts is None  # the client holds the prompt


def test_missing_spans_use_the_fallback_version_or_fail():
    req = GenerateRequest(prompt_token_ids=[1], max_tokens=2)
    assert from_vllm_generate(_answer([4, 5], None), req, fallback_version=3).policy_versions == [3, 3]
    with pytest.raises(VLLMProtocolError, match="no weight_versions"):
        from_vllm_generate(_answer([4, 5], None), req)


@pytest.mark.parametrize(
    ("spans", "match"),
    [
        ([{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 3}], "not contiguous"),
        ([{"version": "1", "start": 0, "end": 2}], "cover 2 tokens"),
        ([{"version": "v-latest", "start": 0, "end": 3}], "not an asyncrl version"),
    ],
)
def test_bad_spans_are_rejected(spans, match):
    req = GenerateRequest(prompt_token_ids=[1], max_tokens=3)
    with pytest.raises(VLLMProtocolError, match=match):
        from_vllm_generate(_answer([4, 5, 6], spans), req)


def test_unknown_finish_reason_and_length_mismatch_are_rejected():
    req = GenerateRequest(prompt_token_ids=[1], max_tokens=1)
    spans = [{"version": "default", "start": 0, "end": 1}]
    with pytest.raises(VLLMProtocolError, match="finish_reason"):
        from_vllm_generate(_answer([4], spans, finish="error"), req)
    bad = _answer([4], spans)
    bad["choices"][0]["logprobs"]["content"] = []
    with pytest.raises(VLLMProtocolError, match="1 token_ids but 0 logprobs"):
        from_vllm_generate(bad, req)


def test_request_asks_vllm_for_routing_from_the_start_it_already_holds():
    req = GenerateRequest(prompt_token_ids=[1, 2, 3], return_routed_experts=True, routed_experts_start=2)
    assert to_vllm_generate(req)["sampling_params"]["routed_experts_prompt_start"] == 2
    # vLLM rejects a start past the prompt: the last sampled token of a turn is routed only next turn
    past = req.model_copy(update={"routed_experts_start": 5})
    assert to_vllm_generate(past)["sampling_params"]["routed_experts_prompt_start"] == 3
    assert (
        "routed_experts_prompt_start"
        not in to_vllm_generate(GenerateRequest(prompt_token_ids=[1]))["sampling_params"]
    )


def test_rows_vllm_sends_from_the_asked_start_are_placed_there():
    # vLLM 0.32 with routed_experts_prompt_start=2: rows 2..(3 + 2 - 1), uint8 up to 256 experts
    routed = (np.arange(2 * 2 * 2).reshape(2, 2, 2) % 8).astype(np.uint8)
    req = GenerateRequest(
        prompt_token_ids=[1, 2, 3], max_tokens=2, return_routed_experts=True, routed_experts_start=2
    )
    spans = [{"version": "1", "start": 0, "end": 2}]
    out = from_vllm_generate(_answer([4, 5], spans, routed=_npy_b64(routed)), req)
    assert out.routed_experts is not None
    assert out.routed_experts.start == 2 and out.routed_experts.dtype == "uint8"
    np.testing.assert_array_equal(out.routed_experts.to_array(), routed)
    with pytest.raises(VLLMProtocolError, match="3 routed_experts rows for 3 prompt and 2 completion"):
        from_vllm_generate(_answer([4, 5], spans, routed=_npy_b64(np.zeros((3, 2, 2), np.uint8))), req)


def test_rows_from_a_vllm_that_ignored_the_start_are_cut_there():
    # all of [prompt + completion - 1] from token 0, int32 ids (an older vLLM)
    routed = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8
    req = GenerateRequest(
        prompt_token_ids=[1, 2, 3], max_tokens=2, return_routed_experts=True, routed_experts_start=2
    )
    spans = [{"version": "1", "start": 0, "end": 2}]
    out = from_vllm_generate(_answer([4, 5], spans, routed=_npy_b64(routed)), req)
    assert out.routed_experts is not None
    assert out.routed_experts.start == 2 and out.routed_experts.dtype == "uint16"
    np.testing.assert_array_equal(out.routed_experts.to_array(), routed[2:])


def test_uint16_expert_ids_stay_uint16_whatever_their_values():
    # > 256 experts: vLLM sends uint16; a turn whose ids all happen to be < 256 must not turn uint8,
    # or the episode's next turn (or the batch) would mix dtypes
    req = GenerateRequest(prompt_token_ids=[1, 2], max_tokens=1, return_routed_experts=True)
    routed = np.full((2, 2, 2), 7, np.uint16)
    out = from_vllm_generate(
        _answer([4], [{"version": "1", "start": 0, "end": 1}], routed=_npy_b64(routed)), req
    )
    assert out.routed_experts is not None and out.routed_experts.dtype == "uint16"


def test_version_labels():
    assert parse_version_label("default") == 0
    assert parse_version_label("12") == 12


def test_embedded_answer_in_vllm_shape_round_trips():
    req = GenerateRequest(
        prompt_token_ids=[1, 2, 3, 4], max_tokens=3, return_routed_experts=True, routed_experts_start=2
    )
    routed = RoutedExperts.from_array(np.arange(4 * 2 * 2, dtype=np.uint16).reshape(4, 2, 2) * 37, start=2)
    ours = GenerateResponse(
        token_ids=[7, 8, 9],
        logprobs=[-0.1, -0.2, -0.3],
        policy_versions=[3, 3, 4],
        finish_reason="stop",
        num_cached_tokens=2,
        routed_experts=routed,
    )
    payload = to_vllm_answer(ours, req, "r-9")
    assert payload["choices"][0]["weight_versions"] == [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 3},
    ]
    assert from_vllm_generate(payload, req) == ours


def test_vllm_request_shape_becomes_ours_and_rejects_what_we_do_not_serve():
    body = {
        "token_ids": [5, 6],
        "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 0},
        "cache_salt": "s",
        "return_routed_experts": True,
    }
    req = VLLMGenerateRequest.model_validate(body).to_request()
    assert (req.prompt_token_ids, req.max_tokens, req.temperature, req.cache_salt) == ([5, 6], 4, 0.0, "s")
    assert req.return_routed_experts and to_vllm_generate(req)["return_routed_experts"] is True
    with pytest.raises(ValidationError, match="n"):
        VLLMGenerateRequest.model_validate(body | {"sampling_params": {"n": 2}})


def test_embedded_server_reads_the_routing_start_where_vllm_takes_it():
    ours = GenerateRequest(prompt_token_ids=[5, 6, 7], return_routed_experts=True, routed_experts_start=2)
    back = VLLMGenerateRequest.model_validate(to_vllm_generate(ours)).to_request()
    assert back.return_routed_experts and back.routed_experts_start == 2

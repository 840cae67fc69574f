"""Request validation (errors name the field) and stop conditions."""

import pytest
from inference_helpers import drain, random_prompts

from asyncrl.inference import InvalidRequestError, SamplingOptions


@pytest.mark.parametrize(
    ("prompt", "opts", "field"),
    [
        ([1, 2, 999], SamplingOptions(), "prompt"),
        ([-1], SamplingOptions(), "prompt"),
        ([], SamplingOptions(), "prompt"),
        ([1] * 64, SamplingOptions(), "prompt"),
        ([1] * 10, SamplingOptions(max_tokens=60), "max_tokens"),
        ([1], SamplingOptions(max_tokens=0), "max_tokens"),
        ([1], SamplingOptions(stop_token_ids=(5000,)), "stop_token_ids"),
        ([1], SamplingOptions(stop=("x",)), "stop"),  # no detokenizer given
    ],
)
def test_bad_requests_name_the_field(make_engine, prompt, opts, field):
    engine = make_engine(max_model_len=64)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("r", prompt, opts)
    assert e.value.field == field
    assert not engine.has_unfinished()


def test_stop_token_ids_eos_and_ignore_eos(make_engine):
    (prompt,) = random_prompts([6], seed=30)
    probe = make_engine()
    probe.add_request("p", prompt, SamplingOptions(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokens = drain(probe)["p"].tokens
    stop_at = tokens[2]
    first = tokens.index(stop_at)

    engine = make_engine()
    engine.add_request("s", prompt, SamplingOptions(temperature=0.0, max_tokens=8, stop_token_ids=(stop_at,)))
    engine.eos_token_ids = frozenset({stop_at})
    engine.add_request("e", prompt, SamplingOptions(temperature=0.0, max_tokens=8))
    engine.add_request("i", prompt, SamplingOptions(temperature=0.0, max_tokens=8, ignore_eos=True))
    res = drain(engine)
    assert res["s"].tokens == tokens[: first + 1] and res["s"].final.finish_reason == "stop"
    assert res["e"].tokens == tokens[: first + 1] and res["e"].final.finish_reason == "stop"
    assert res["i"].tokens == tokens and res["i"].final.finish_reason == "length"


def test_stop_strings_with_detokenizer(make_engine):
    (prompt,) = random_prompts([6], seed=31)
    engine = make_engine()
    engine.add_request("p", prompt, SamplingOptions(temperature=0.0, max_tokens=10, ignore_eos=True))
    tokens = drain(engine)["p"].tokens
    engine.detokenize = lambda ids: bytes(t % 256 for t in ids).decode("latin-1")
    stop = engine.detokenize(tokens[3:5])
    engine.add_request("s", prompt, SamplingOptions(temperature=0.0, max_tokens=10, stop=(stop,)))
    res = drain(engine)["s"]
    assert res.final.finish_reason == "stop"
    assert stop in engine.detokenize(res.tokens) and stop not in engine.detokenize(res.tokens[:-1])


def test_duplicate_request_id_rejected(make_engine):
    engine = make_engine()
    engine.add_request("r", [1, 2], SamplingOptions())
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("r", [1, 2], SamplingOptions())


def _add_sampled(engine, prompts, stream: bool, return_routed_experts: bool = False) -> None:
    for i, p in enumerate(prompts):
        opts = SamplingOptions(temperature=1.0, seed=i, max_tokens=3 + 2 * i, ignore_eos=True)
        engine.add_request(f"r{i}", p, opts, stream=stream, return_routed_experts=return_routed_experts)


def test_unstreamed_request_yields_one_output_with_every_token(make_engine):
    prompts = random_prompts([5, 9, 3], seed=4)
    streamed = make_engine()
    _add_sampled(streamed, prompts, stream=True, return_routed_experts=True)
    ref = drain(streamed)
    engine = make_engine()
    _add_sampled(engine, prompts, stream=False, return_routed_experts=True)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]  # one output each, the final one
    for out in outputs:
        want = ref[out.request_id]
        assert out.finished and len(out.new_token_ids) == 3 + 2 * int(out.request_id[1])
        assert out.new_token_ids == want.tokens and out.new_logprobs == want.logprobs
        assert out.new_versions == want.versions
        assert (out.routed_experts == want.final.routed_experts).all()


def test_unstreamed_request_aborted_keeps_its_tokens(make_engine):
    engine = make_engine()
    engine.add_request(
        "r", [1, 2, 3], SamplingOptions(temperature=0, max_tokens=20, ignore_eos=True), stream=False
    )
    assert [engine.step() for _ in range(4)] == [[], [], [], []]
    out = engine.abort("r")
    assert out.finish_reason == "abort" and len(out.new_token_ids) == len(out.new_logprobs) == 4

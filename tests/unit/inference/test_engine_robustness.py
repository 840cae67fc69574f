"""One request cannot hurt the others: sampler-level failures stay per request; weight updates are atomic."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch
from inference_helpers import drain

from asyncrl.inference import InvalidRequestError, SamplingOptions
from asyncrl.inference.async_engine import AsyncEngine
from asyncrl.inference.request import RequestFailedError
from asyncrl.model import ModelConfigError
from asyncrl.model.hf import load_into, save_pretrained

PROMPTS = {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7], "c": [20, 21, 22, 23]}
GREEDY = SamplingOptions(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (SamplingOptions(temperature=1e-30), "temperature"),
        (SamplingOptions(temperature=5e-3), "temperature"),
        (SamplingOptions(temperature=float("nan")), "temperature"),
        (SamplingOptions(top_p=float("nan")), "top_p"),
        (SamplingOptions(seed=-1), "seed"),
        (SamplingOptions(seed=2**64), "seed"),
        (SamplingOptions(stop=tuple(str(i) for i in range(17))), "stop"),
        (SamplingOptions(stop=("x" * 1000,)), "stop"),
        (SamplingOptions(stop=("\ud800",)), "stop"),
        (SamplingOptions(stop_token_ids=(1,) * 300), "stop_token_ids"),
    ],
)
def test_options_the_sampler_cannot_compute_are_rejected(make_engine, options, field):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("r", [1, 2, 3], options)
    assert e.value.field == field and not engine.has_unfinished()


def test_unencodable_cache_salt_is_rejected(make_engine):
    with pytest.raises(InvalidRequestError) as e:
        make_engine().add_request("r", [1, 2], GREEDY, cache_salt="\udc80")
    assert e.value.field == "cache_salt"


@pytest.mark.parametrize("temperature", [1e-40, 1e-43, 1e-45])
def test_a_request_the_sampler_cannot_compute_fails_alone(make_engine, temperature):
    """Past validation (options mutated in place), an overflowing temperature fails one request only."""
    reference = make_engine()
    for rid, prompt in PROMPTS.items():
        reference.add_request(rid, prompt, GREEDY)
    expected = drain(reference)

    engine = make_engine()
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.add_request("bad", [5, 6, 7], SamplingOptions(max_tokens=6))
    engine.requests["bad"].options = dataclasses.replace(
        engine.requests["bad"].options, temperature=temperature
    )
    got = drain(engine)
    assert got["bad"].final.error is not None and got["bad"].final.finish_reason == "abort"
    assert engine.stats()["failed_requests"] == 1 and engine.stats()["kv_blocks_used"] == 0
    for rid in PROMPTS:
        assert got[rid].tokens == expected[rid].tokens and got[rid].final.error is None


@pytest.mark.parametrize("error", [RuntimeError("device lost"), IndexError("bad index")])
def test_a_failed_step_fails_its_requests_with_an_error_and_the_engine_goes_on(make_engine, error):
    engine = make_engine()
    real_step, calls = engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real_step()

    engine.step = flaky_step

    async def run() -> tuple[str, list[int], float]:
        driver = AsyncEngine(engine)
        driver.start()
        try:
            with pytest.raises(RequestFailedError) as e:
                async for _ in driver.generate("r1", [1, 2, 3], GREEDY):
                    pass
            tokens = [t async for out in driver.generate("r2", [1, 2, 3], GREEDY) for t in out.new_token_ids]
            return e.value.message, tokens, driver.stats()["step_errors"]
        finally:
            driver.stop()

    message, tokens, step_errors = asyncio.run(run())
    assert str(error) in message and len(tokens) == 6 and step_errors == 1


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def _assert_unchanged(engine, before: dict[str, torch.Tensor]) -> None:
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _corrupt(kind: str, model_dir) -> str:
    """Break a saved checkpoint in one way; returns text the error must contain."""
    file = model_dir / "model.safetensors"
    if kind == "truncated":
        file.write_bytes(file.read_bytes()[:-100])
        return "model.safetensors"
    if kind == "garbage":
        file.write_bytes(b"\x00" * 64)
        return "model.safetensors"
    if kind == "bad_index":
        (model_dir / "model.safetensors.index.json").write_text("{not json")
        return "index.json"
    if kind == "index_escapes":
        (model_dir / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "../x.safetensors"}})
        )
        return "inside"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "bad_index", "index_escapes"])
def test_unreadable_checkpoints_name_the_file_and_change_nothing(make_engine, tiny_moe, tmp_path, kind):
    save_pretrained(tiny_moe, tmp_path)
    needle = _corrupt(kind, tmp_path)
    engine = make_engine()
    before = _snapshot(engine)
    with pytest.raises(ModelConfigError, match=needle.replace(".", r"\.")):
        engine.read_weights(str(tmp_path))
    _assert_unchanged(engine, before)


@pytest.mark.parametrize("which", ["first", "last"])
@pytest.mark.parametrize("fault", ["shape", "dtype", "missing", "extra"])
def test_a_rejected_state_leaves_every_weight_untouched(make_engine, which, fault):
    """Validation runs before the first copy, wherever in the state the bad tensor sits."""
    engine = make_engine()
    before = _snapshot(engine)
    names = [n for n, _ in engine.model.named_parameters()]
    state = {n: p.detach() + 1.0 for n, p in engine.model.named_parameters()}
    name = names[0] if which == "first" else names[-1]
    if fault == "shape":
        state[name] = state[name][..., :-1]
    elif fault == "dtype":
        state[name] = state[name].double()
    elif fault == "missing":
        del state[name]
    else:
        state[f"{name}.extra"] = torch.zeros(1)
    with pytest.raises(ModelConfigError):
        load_into(engine.model, state, where="test")
    with pytest.raises(ModelConfigError):
        engine.load_weights(state, version=1)
    _assert_unchanged(engine, before)
    assert engine.version == 0

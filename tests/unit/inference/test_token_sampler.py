import math

import torch

from asyncrl.inference.request import SamplingOptions
from asyncrl.inference.sampler import sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draw(opts: SamplingOptions, n: int = 2000, seed: int = 0) -> tuple[torch.Tensor, list[float]]:
    logits = PROBS.log().repeat(n, 1)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    tokens, logprobs, failures = sample(logits, [opts] * n, gens)
    assert failures == {}
    return torch.tensor(tokens), logprobs


def test_unfiltered_frequencies_match_the_distribution():
    tokens, _ = _draw(SamplingOptions())
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert (freq - PROBS).abs().max() < 0.04


def test_truncations_exclude_the_right_tokens():
    assert set(_draw(SamplingOptions(top_k=2))[0].tolist()) == {0, 1}
    assert set(_draw(SamplingOptions(top_p=0.7))[0].tolist()) == {0, 1}  # 0.5 + 0.3 covers 0.7
    assert set(_draw(SamplingOptions(min_p=0.4))[0].tolist()) == {0, 1}  # keeps p >= 0.2
    assert set(_draw(SamplingOptions(top_k=1))[0].tolist()) == {0}


def test_logprob_is_under_temperature_before_truncation():
    for opts in (SamplingOptions(temperature=0.5, top_k=2), SamplingOptions(temperature=2.0, top_p=0.6)):
        tokens, logprobs = _draw(opts, n=50)
        ref = torch.log_softmax(PROBS.log() / opts.temperature, dim=-1)
        for t, lp in zip(tokens.tolist(), logprobs):
            assert math.isclose(lp, float(ref[t]), abs_tol=1e-6)


def test_greedy_takes_argmax_and_reports_temperature_one():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    tokens, logprobs, failures = sample(
        logits, [SamplingOptions(temperature=0.0)] * 2, [torch.Generator()] * 2
    )
    assert failures == {}
    assert tokens == [1, 0]
    ref = torch.log_softmax(logits, dim=-1)
    assert math.isclose(logprobs[0], float(ref[0, 1]), abs_tol=1e-6)


def test_seed_reproducible():
    a, _ = _draw(SamplingOptions(), n=64, seed=7)
    b, _ = _draw(SamplingOptions(), n=64, seed=7)
    c, _ = _draw(SamplingOptions(), n=64, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)

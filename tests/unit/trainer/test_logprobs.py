"""The chunked LM head against the unchunked reference: values, entropies and gradients."""

from __future__ import annotations

import torch

from asyncrl.trainer.logprobs import chunked_logprobs, token_logprobs_reference


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h_ND = torch.randn(10, 16, generator=g, dtype=torch.float32)
    w_VD = torch.randn(40, 16, generator=g, dtype=torch.float32)
    target_N = torch.randint(0, 40, (10,), generator=g)
    temp_N = torch.rand(10, generator=g, dtype=torch.float32) + 0.5
    return h_ND, w_VD, target_N, temp_N


def test_chunked_matches_unchunked_values_and_gradients():
    h, w, tgt, temp = _case()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp_chunked, _ = chunked_logprobs(h1, w1, tgt, temp, chunk_size=3)  # 3 + 3 + 3 + 1
    lp_ref = token_logprobs_reference(h2, w2, tgt, temp)
    torch.testing.assert_close(lp_chunked, lp_ref, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, 10)
    (lp_chunked * weights).sum().backward()
    (lp_ref * weights).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)


def test_temperature_divides_the_logits_and_entropy_is_of_that_distribution():
    h, w, tgt, _ = _case(1)
    temp = torch.full((10,), 0.5, dtype=torch.float32)
    lp, ent = chunked_logprobs(h, w, tgt, temp, chunk_size=4)
    logp_NV = torch.log_softmax((h @ w.T) / 0.5, dim=-1)
    torch.testing.assert_close(lp, logp_NV.gather(1, tgt[:, None]).squeeze(1))
    torch.testing.assert_close(ent, -(logp_NV.exp() * logp_NV).sum(-1))
    lp_hot, _ = chunked_logprobs(h, w, tgt, torch.ones(10, dtype=torch.float32), chunk_size=4)
    assert not torch.allclose(lp, lp_hot)

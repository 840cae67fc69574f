"""Token sampling with temperature, top-k, top-p and min-p, and the logprob of each sampled token.

The reported logprob is log softmax(logits / temperature) at the sampled id: the full distribution
after temperature, before the top-k / top-p / min-p truncation. That is the distribution the
trainer recomputes from its own logits (it never sees the truncation), so the importance ratio
between trainer and engine is exactly 1 in an fp32 on-policy run. Greedy rows (temperature 0)
take the argmax and report the logprob under temperature 1.

Shape legend: S sequences being sampled, V vocab.
"""

from __future__ import annotations

import torch

from asyncrl.inference.request import SamplingOptions

__all__ = ["sample"]


def sample(
    logits_SV: torch.Tensor, options: list[SamplingOptions], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Sample one token per row. Returns (token ids, logprobs under the temperature-scaled softmax)."""
    logits_SV = logits_SV.float()
    device = logits_SV.device
    temps_S = torch.tensor([o.temperature if o.temperature > 0 else 1.0 for o in options], device=device)
    logprobs_SV = torch.log_softmax(logits_SV / temps_S[:, None], dim=-1)
    tokens_S = logits_SV.argmax(dim=-1)
    sampled = [i for i, o in enumerate(options) if not o.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=device)
        probs_RV = _truncate(logprobs_SV[rows].exp(), [options[i] for i in sampled])
        for j, i in enumerate(sampled):
            gen = generators[i]
            if gen.device != probs_RV.device:
                draw = torch.multinomial(probs_RV[j].cpu(), 1, generator=gen)
            else:
                draw = torch.multinomial(probs_RV[j], 1, generator=gen)
            tokens_S[i] = draw.to(device)[0]
    chosen_S = logprobs_SV.gather(1, tokens_S[:, None])[:, 0]
    return tokens_S.tolist(), chosen_S.tolist()


def _truncate(probs_RV: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """Zero the tokens that top-k, top-p or min-p exclude (unnormalised; multinomial rescales)."""
    V = probs_RV.shape[1]
    device = probs_RV.device
    top_k = [o.top_k if 0 < o.top_k < V else V for o in options]
    top_p = [o.top_p for o in options]
    min_p = [o.min_p for o in options]
    if all(k == V for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0 for m in min_p):
        return probs_RV
    sorted_RV, order_RV = probs_RV.sort(dim=-1, descending=True)
    rank_V = torch.arange(V, device=device)
    keep_RV = rank_V[None, :] < torch.tensor(top_k, device=device)[:, None]
    mass_before_RV = sorted_RV.cumsum(dim=-1) - sorted_RV
    keep_RV &= mass_before_RV < torch.tensor(top_p, device=device)[:, None]
    keep_RV &= sorted_RV >= torch.tensor(min_p, device=device)[:, None] * sorted_RV[:, :1]
    keep_RV[:, 0] = True  # the most likely token always survives
    kept_RV = torch.zeros_like(probs_RV).scatter(1, order_RV, sorted_RV * keep_RV)
    return kept_RV

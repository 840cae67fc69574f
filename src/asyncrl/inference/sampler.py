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
) -> tuple[list[int], list[float], dict[int, str]]:
    """Sample one token per row.

    Returns (token ids, logprobs under the temperature-scaled softmax, failures). A row whose
    scaled logits are not finite, or whose draw fails, is reported in `failures` (row -> reason)
    with a placeholder token, so that one bad row never fails the others.
    """
    logits_SV = logits_SV.float()
    device = logits_SV.device
    temps_S = torch.tensor([o.temperature if o.temperature > 0 else 1.0 for o in options], device=device)
    scaled_SV = logits_SV / temps_S[:, None]
    finite_S = torch.isfinite(scaled_SV).all(dim=-1)
    failures = {i: "non-finite logits" for i, ok in enumerate(finite_S.tolist()) if not ok}
    if failures:  # neutral rows keep the batched math finite; their results are discarded
        scaled_SV = torch.where(finite_S[:, None], scaled_SV, 0.0)
    logprobs_SV = torch.log_softmax(scaled_SV, dim=-1)
    tokens_S = scaled_SV.argmax(dim=-1)
    sampled = [i for i, o in enumerate(options) if not o.greedy and i not in failures]
    if sampled:
        rows = torch.tensor(sampled, device=device)
        probs_RV = _truncate(logprobs_SV[rows].exp(), [options[i] for i in sampled])
        for j, i in enumerate(sampled):
            gen = generators[i]
            probs_V = probs_RV[j] if gen.device == probs_RV.device else probs_RV[j].cpu()
            try:
                draw = torch.multinomial(probs_V, 1, generator=gen)
            except RuntimeError as e:  # an invalid distribution for this row only
                failures[i] = f"sampling failed: {e}"
                continue
            tokens_S[i] = draw.to(device)[0]
    chosen_S = logprobs_SV.gather(1, tokens_S[:, None])[:, 0]
    return tokens_S.tolist(), chosen_S.tolist(), failures


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

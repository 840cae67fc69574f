"""Log-probabilities of sampled tokens through a chunked LM head.

The LM head runs over `chunk_size` tokens at a time in fp32, and each chunk is recomputed in the
backward pass (activation checkpointing), so neither the forward nor the backward ever holds the
full [T, V] fp32 logits; only the [chunk, V] block of the chunk being processed.

Logits are divided by each token's sampling temperature before the softmax, so the result is the
log-probability under the distribution the token was actually sampled from.

Shape legend: N tokens, D model dim, V vocab, C chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_logprobs", "token_logprobs_reference"]


def _chunk(
    h_CD: torch.Tensor, w_VD: torch.Tensor, target_C: torch.Tensor, temp_C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_CV = F.linear(h_CD.float(), w_VD.float()) / temp_C.unsqueeze(-1)
    logz_C = torch.logsumexp(logits_CV, dim=-1)
    logprob_C = logits_CV.gather(1, target_C.unsqueeze(-1)).squeeze(-1) - logz_C
    with torch.no_grad():
        logp_CV = logits_CV.detach() - logz_C.detach().unsqueeze(-1)
        entropy_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return logprob_C, entropy_C


def chunked_logprobs(
    h_ND: torch.Tensor,
    w_VD: torch.Tensor,
    target_N: torch.Tensor,
    temperature_N: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logprob of each target [N] f32 with grad, entropy of each position [N] f32, detached)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    recompute = torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad)
    logprobs, entropies = [], []
    for start in range(0, h_ND.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        args = (h_ND[sl], w_VD, target_N[sl], temperature_N[sl])
        if recompute:
            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(*args)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies).detach()


def token_logprobs_reference(
    h_ND: torch.Tensor, w_VD: torch.Tensor, target_N: torch.Tensor, temperature_N: torch.Tensor
) -> torch.Tensor:
    """Unchunked reference (materialises [N, V]); for tests and debugging."""
    logits_NV = F.linear(h_ND.float(), w_VD.float()) / temperature_N.unsqueeze(-1)
    return torch.log_softmax(logits_NV, dim=-1).gather(1, target_N.unsqueeze(-1)).squeeze(-1)

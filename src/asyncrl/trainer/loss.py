"""Policy-gradient losses with off-policy correction, as pure functions over flat token tensors.

Every function takes the tokens of one micro-batch, flattened ([N]), and returns the *sum* of
per-token losses divided by `num_loss_tokens`, the count of loss tokens in the whole step over all
data-parallel ranks. Summing these over micro-batches and all-reducing (sum) the gradients over
ranks therefore gives the gradient of one token-level mean over the global batch.

Notation (per token i): logpi = current log-probability (with grad), logmu = the inference
engine's log-probability, log r = logpi - logmu, r = exp(log r), A = advantage, w = min(r,
ratio_cap) the capped importance weight. The formulas of
every variant are in docs/trainer.md ("Loss variants"); this file is their only implementation.

Shape legend: N tokens of a micro-batch (flattened), S sequences in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.config.trainer import (
    LossConfig,
    MISLossConfig,
    SequenceLossConfig,
    TISLossConfig,
    TrustRegionLossConfig,
)

__all__ = ["LossInputs", "LossResult", "mismatch_kl", "rl_loss", "sft_loss"]


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """The per-token streams of one micro-batch.

    Example (two sequences, three loss tokens)::

        LossInputs(logprobs=lp_N, inference_logprobs=torch.tensor([0., -.1, -.5, 0., -.2]),
                   advantages=torch.tensor([0., 1., 1., 0., -1.]),
                   loss_mask=torch.tensor([0, 1, 1, 0, 1], dtype=torch.bool),
                   seq_ids=torch.tensor([0, 0, 0, 1, 1]))
    """

    logprobs: torch.Tensor  # f32 [N], current policy (requires grad)
    inference_logprobs: torch.Tensor  # f32 [N], sampling policy mu
    advantages: torch.Tensor  # f32 [N]
    loss_mask: torch.Tensor  # bool [N]
    seq_ids: torch.Tensor  # int64 [N], index of each token's sequence within the micro-batch


@dataclass(frozen=True, kw_only=True)
class LossResult:
    """The loss to backpropagate plus detached sums for the step's metrics."""

    loss: torch.Tensor  # scalar, already divided by num_loss_tokens
    num_loss_tokens: torch.Tensor  # scalar, loss tokens in this micro-batch
    num_masked: torch.Tensor  # scalar, loss tokens whose policy-gradient term was masked out
    mismatch_kl_sum: torch.Tensor  # scalar, sum over loss tokens of k3 = r - log r - 1


def mismatch_kl(log_ratio_N: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(mu || pi) per sampled token: r - log r - 1 (>= 0, exactly 0 when r == 1)."""
    return torch.expm1(log_ratio_N) - log_ratio_N


def _trust_region_mask(inp: LossInputs, cfg: TrustRegionLossConfig) -> torch.Tensor:
    """Mask where pi - mu has left [-delta_low, delta_high] in the direction the advantage pushes."""
    delta_N = inp.logprobs.detach().exp() - inp.inference_logprobs.exp()
    too_high = (inp.advantages > 0) & (delta_N > cfg.delta_high)
    too_low = (inp.advantages < 0) & (delta_N < -cfg.delta_low)
    return too_high | too_low


def _sequence_mask(log_ratio_N: torch.Tensor, inp: LossInputs, cfg: SequenceLossConfig) -> torch.Tensor:
    """Mask every token of a sequence whose geometric-mean ratio over its loss tokens is out of bounds."""
    num_seqs = int(inp.seq_ids.max()) + 1 if inp.seq_ids.numel() else 0
    m_N = inp.loss_mask.to(log_ratio_N.dtype)
    sums_S = log_ratio_N.new_zeros(num_seqs).index_add_(0, inp.seq_ids, log_ratio_N.detach() * m_N)
    counts_S = log_ratio_N.new_zeros(num_seqs).index_add_(0, inp.seq_ids, m_N)
    geo_ratio_S = (sums_S / counts_S.clamp(min=1)).exp()
    bad_S = (geo_ratio_S < cfg.seq_low) | (geo_ratio_S > cfg.seq_high)
    return bad_S[inp.seq_ids]


def _capped_weight(
    ratio_N: torch.Tensor, cfg: TrustRegionLossConfig | MISLossConfig | SequenceLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """min(r, ratio_cap) (detached) and the mask of tokens above the cap (none when it is inf)."""
    return ratio_N.clamp(max=cfg.ratio_cap), ratio_N > cfg.ratio_cap


def rl_loss(inp: LossInputs, cfg: LossConfig, num_loss_tokens: float) -> LossResult:
    """Token-level policy-gradient loss for `cfg.variant` plus kl_coef * (log r)^2 on every loss token."""
    assert num_loss_tokens > 0, "caller must skip steps without loss tokens"
    log_ratio_N = inp.logprobs - inp.inference_logprobs.detach()
    ratio_N = log_ratio_N.exp()
    mask_N = inp.loss_mask
    if isinstance(cfg, TISLossConfig):
        weight_N = ratio_N.detach().clamp(max=cfg.tis_cap)
        pg_N = -weight_N * inp.logprobs * inp.advantages
        masked_N = torch.zeros_like(mask_N)
    else:
        if isinstance(cfg, TrustRegionLossConfig):
            masked_N = _trust_region_mask(inp, cfg)
        elif isinstance(cfg, MISLossConfig):
            r_N = ratio_N.detach()
            masked_N = (r_N < cfg.mis_low) | (r_N > cfg.mis_high)
        else:
            assert isinstance(cfg, SequenceLossConfig), cfg
            masked_N = _sequence_mask(log_ratio_N, inp, cfg)
        weight_N, capped_N = _capped_weight(ratio_N.detach(), cfg)
        if cfg.ratio_cap_mode == "mask":
            masked_N = masked_N | capped_N
        # weight * exp(log r - sg(log r)) has the value of -min(r, C) * A and the gradient
        # -min(r, C) * A * grad log pi: the same as -r * A below the cap, and never inf * 0 above it.
        pg_N = -weight_N * (log_ratio_N - log_ratio_N.detach()).exp() * inp.advantages
    masked_N = masked_N & mask_N
    keep_N = mask_N & ~masked_N
    per_token_N = torch.where(keep_N, pg_N, 0.0) + torch.where(
        mask_N, cfg.kl_coef * log_ratio_N.square(), 0.0
    )
    with torch.no_grad():
        kl_sum = torch.where(mask_N, mismatch_kl(log_ratio_N.detach()), 0.0).sum()
    return LossResult(
        loss=per_token_N.sum() / num_loss_tokens,
        num_loss_tokens=mask_N.sum(),
        num_masked=masked_N.sum(),
        mismatch_kl_sum=kl_sum,
    )


def sft_loss(inp: LossInputs, num_loss_tokens: float) -> LossResult:
    """Cross-entropy on loss tokens: sum(-logpi) / num_loss_tokens (advantages and mu are ignored)."""
    assert num_loss_tokens > 0, "caller must skip steps without loss tokens"
    mask_N = inp.loss_mask
    zero = torch.zeros((), device=mask_N.device)
    return LossResult(
        loss=torch.where(mask_N, -inp.logprobs, 0.0).sum() / num_loss_tokens,
        num_loss_tokens=mask_N.sum(),
        num_masked=zero,
        mismatch_kl_sum=zero,
    )

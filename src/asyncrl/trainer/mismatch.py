"""Trainer-inference mismatch metrics (pure functions over tensors) and the mismatch gate.

    sums = mismatch_sums(logprobs_T, inference_logprobs_T, loss_mask_T)       # per micro-batch
    split = mismatch_by_staleness(logprobs_T, inference_logprobs_T, loss_mask_T,
                                  context_versions_T, trainer_version=n - 1)  # current vs stale
    agree_L = routing_agreement(replayed_TLK, router_topk_TLK, loss_mask_T, moe_layers)
    metrics = (sums_a + sums_b).metrics()     # {"mismatch_kl": .., "mismatch_kl_max": .., ...}
    check_mismatch_gate(kl_current, max_kl=1e-3, mode="fail", step=n, kl_stale=kl_stale)

Definitions (mu = the inference engine's distribution, pi = the trainer's, on tokens sampled
from mu, both under the sampling temperature):
  r = pi(x) / mu(x) = exp(logprob - inference_logprob)
  k3 = r - log r - 1 >= 0, an unbiased, always non-negative estimator of KL(mu || pi)
  outlier fraction = share of tokens with r outside [ratio_low, ratio_high] (default [0.5, 2])
  routing agreement of a layer = |replayed ids & router's own top-k ids| / K, averaged over tokens

Staleness split: tokens sampled by the trainer's current weights measure engine mismatch alone;
older tokens add off-policy drift. Comparing the two tells the two causes apart, and the gate
looks at the current ones only. "Sampled by the current weights" must hold for the whole context:
a completion that spans a weight update continues on KV that the older weights computed, and so
does one whose prompt was prefilled across an update or served from the prefix cache, so such
tokens carry the new version yet differ from a forward of the new weights. The trainer therefore
splits on the context version of each token (the oldest version, policy or KV, among the sampled
tokens of its sequence up to it, `MicroBatch.context_versions`), not on its own stamp.

Shape legend: T tokens, L layers, K top_k.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "MismatchAccumulator",
    "MismatchGateError",
    "MismatchSums",
    "check_mismatch_gate",
    "k3_per_token",
    "mismatch_by_staleness",
    "mismatch_sums",
    "routing_agreement",
]


def k3_per_token(logprobs_T: torch.Tensor, inference_logprobs_T: torch.Tensor) -> torch.Tensor:
    """k3 = r - log r - 1 with r = exp(logprobs - inference_logprobs); float64 [T]."""
    log_r = logprobs_T.detach().double() - inference_logprobs_T.detach().double()
    # expm1(x) - x is r - 1 - log r without cancellation when r is close to 1 (the common case).
    return torch.expm1(log_r) - log_r


@dataclass(frozen=True, kw_only=True)
class MismatchSums:
    """Additive mismatch statistics, so micro-batches and ranks combine by `+` (or all-reduce:
    sum every field but `kl_max`, which takes the max).

    Example: MismatchSums(kl_sum=0.02, kl_max=0.01, num_outside=1, num_tokens=100).metrics()
    == {"mismatch_kl": 2e-4, "mismatch_kl_max": 0.01, "mismatch_ratio_outside": 0.01, ...}.
    """

    kl_sum: float = 0.0
    kl_max: float = 0.0
    num_outside: int = 0
    num_tokens: int = 0

    def __add__(self, other: MismatchSums) -> MismatchSums:
        return MismatchSums(
            kl_sum=self.kl_sum + other.kl_sum,
            kl_max=max(self.kl_max, other.kl_max),
            num_outside=self.num_outside + other.num_outside,
            num_tokens=self.num_tokens + other.num_tokens,
        )

    def metrics(self, prefix: str = "mismatch") -> dict[str, float]:
        n = max(self.num_tokens, 1)
        return {
            f"{prefix}_kl": self.kl_sum / n,
            f"{prefix}_kl_max": self.kl_max,
            f"{prefix}_ratio_outside": self.num_outside / n,
            f"{prefix}_tokens": float(self.num_tokens),
        }


def _check_shapes(logprobs_T: torch.Tensor, inference_logprobs_T: torch.Tensor, mask_T: torch.Tensor) -> None:
    if not (logprobs_T.shape == inference_logprobs_T.shape == mask_T.shape):
        raise ValueError(
            f"mismatch: logprobs {tuple(logprobs_T.shape)}, inference_logprobs "
            f"{tuple(inference_logprobs_T.shape)} and mask {tuple(mask_T.shape)} must have the same shape"
        )
    if mask_T.dtype != torch.bool:
        raise ValueError(f"mismatch: mask must be a bool tensor, got {mask_T.dtype}")


def mismatch_sums(
    logprobs_T: torch.Tensor,
    inference_logprobs_T: torch.Tensor,
    mask_T: torch.Tensor,
    *,
    ratio_low: float = 0.5,
    ratio_high: float = 2.0,
) -> MismatchSums:
    """k3 KL sum and max, and the count of ratios outside [ratio_low, ratio_high], over mask_T."""
    _check_shapes(logprobs_T, inference_logprobs_T, mask_T)
    if not 0 < ratio_low < ratio_high:
        raise ValueError(f"mismatch: need 0 < ratio_low < ratio_high, got [{ratio_low}, {ratio_high}]")
    k3 = k3_per_token(logprobs_T, inference_logprobs_T)[mask_T]
    if k3.numel() == 0:
        return MismatchSums()
    log_r = logprobs_T.detach().double()[mask_T] - inference_logprobs_T.detach().double()[mask_T]
    outside = (log_r < torch.tensor(ratio_low).log()) | (log_r > torch.tensor(ratio_high).log())
    return MismatchSums(
        kl_sum=float(k3.sum()),
        kl_max=float(k3.max()),
        num_outside=int(outside.sum()),
        num_tokens=int(k3.numel()),
    )


def mismatch_by_staleness(
    logprobs_T: torch.Tensor,
    inference_logprobs_T: torch.Tensor,
    mask_T: torch.Tensor,
    versions_T: torch.Tensor,
    *,
    trainer_version: int,
    ratio_low: float = 0.5,
    ratio_high: float = 2.0,
) -> dict[str, MismatchSums]:
    """{"current": tokens of version == trainer_version, "stale": older tokens} as MismatchSums.

    Pass context versions (see the module docstring) so that tokens whose context older weights
    computed count as stale.

    trainer_version is the version of the weights that computed `logprobs_T` (at trainer step n,
    before the optimizer step, that is n - 1).
    """
    if versions_T.shape != mask_T.shape:
        raise ValueError(
            f"mismatch: versions {tuple(versions_T.shape)} must match mask {tuple(mask_T.shape)}"
        )
    current_T = versions_T == trainer_version
    kw = {"ratio_low": ratio_low, "ratio_high": ratio_high}
    return {
        "current": mismatch_sums(logprobs_T, inference_logprobs_T, mask_T & current_T, **kw),
        "stale": mismatch_sums(logprobs_T, inference_logprobs_T, mask_T & ~current_T, **kw),
    }


def routing_agreement(
    replayed_TLK: torch.Tensor,
    router_topk_TLK: torch.Tensor,
    mask_T: torch.Tensor,
    layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """Per-layer mean overlap |replayed & own| / K over masked tokens; float64 [len(layers)].

    Order within the K ids does not matter. `layers` selects the MoE layers (dense layers carry
    zeros); default all. A layer gets NaN when mask_T selects no token.
    """
    if replayed_TLK.shape != router_topk_TLK.shape or replayed_TLK.dim() != 3:
        raise ValueError(
            f"routing_agreement: replayed {tuple(replayed_TLK.shape)} and router_topk "
            f"{tuple(router_topk_TLK.shape)} must both be [tokens, layers, top_k]"
        )
    if mask_T.shape != replayed_TLK.shape[:1]:
        raise ValueError(f"routing_agreement: mask {tuple(mask_T.shape)} must be [{replayed_TLK.shape[0]}]")
    sel = list(range(replayed_TLK.shape[1])) if layers is None else list(layers)
    a_TLK = replayed_TLK[mask_T][:, sel].long()
    b_TLK = router_topk_TLK[mask_T][:, sel].long()
    # Top-k ids within one token are distinct, so pairwise equality counts the set intersection.
    overlap_TL = (a_TLK.unsqueeze(-1) == b_TLK.unsqueeze(-2)).sum(dim=(-1, -2)).double()
    K = replayed_TLK.shape[-1]
    return (overlap_TL / K).mean(dim=0)


class MismatchGateError(RuntimeError):
    """Mismatch KL exceeded `mismatch.max_mismatch_kl` with `mismatch.gate = "fail"`."""


def check_mismatch_gate(
    kl_current: float,
    *,
    max_kl: float | None,
    mode: Literal["warn", "fail"],
    step: int,
    kl_stale: float | None = None,
) -> str | None:
    """Gate on the mean k3 KL of current-version tokens (sampled by the weights being trained).

    Stale tokens are left out: their KL adds ordinary off-policy drift, which the loss corrects and
    `max_off_policy_steps` bounds, so it must not stop a run; `kl_stale` only goes into the message.
    Return None when within the limit (or no limit); else warn (mode "warn") and return the message,
    or raise MismatchGateError (mode "fail"). A NaN KL always trips the gate.
    """
    if mode not in ("warn", "fail"):
        raise ValueError(f"mismatch.gate must be 'warn' or 'fail', got {mode!r}")
    if max_kl is None or kl_current <= max_kl:
        return None
    stale = "" if kl_stale is None else f"; stale tokens (off-policy drift, not gated): {kl_stale:.3e}"
    message = (
        f"step {step}: mismatch KL {kl_current:.3e} exceeds mismatch.max_mismatch_kl = {max_kl:.3e} on "
        f"tokens sampled by the weights being trained{stale}; inference and trainer disagree (precision "
        f"or routing): match their dtype / fp8 settings, enable router replay, or raise the limit"
    )
    if mode == "fail":
        raise MismatchGateError(message)
    warnings.warn(message, stacklevel=2)
    return message


class MismatchAccumulator:
    """Per-step mismatch statistics over micro-batches and ranks, as tensors ready to all-reduce.

    acc = MismatchAccumulator(moe_layers=[0, 1], ratio_low=0.5, ratio_high=2.0, device=dev)
    acc.add(logprobs_T, inference_logprobs_T, mask_T, context_versions_T, trainer_version=n - 1,
            replayed_TLK=..., router_topk_TLK=...)          # per micro-batch
    acc.all_reduce(sum_fn, max_fn); acc.metrics()           # once per step

    Metrics: mismatch_kl_max, mismatch_ratio_outside, mismatch_kl_current / _stale (tokens sampled by
    the weights being trained versus older ones: engine mismatch versus off-policy drift), and
    routing_agreement (mean, and per MoE layer) when the batch carried replayed routing.
    """

    _SUMS = ("current_kl", "current_outside", "current_n", "stale_kl", "stale_outside", "stale_n")

    def __init__(self, moe_layers: Sequence[int], ratio_low: float, ratio_high: float, device) -> None:
        self.moe_layers, self.ratio_low, self.ratio_high = list(moe_layers), ratio_low, ratio_high
        self.sums = torch.zeros(len(self._SUMS), dtype=torch.float64, device=device)
        self.kl_max = torch.zeros(1, dtype=torch.float64, device=device)
        self.agree_sum_L = torch.zeros(len(self.moe_layers), dtype=torch.float64, device=device)
        self.agree_n = torch.zeros(1, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(
        self,
        logprobs_T: torch.Tensor,
        inference_logprobs_T: torch.Tensor,
        mask_T: torch.Tensor,
        versions_T: torch.Tensor,
        *,
        trainer_version: int,
        replayed_TLK: torch.Tensor | None = None,
        router_topk_TLK: torch.Tensor | None = None,
    ) -> None:
        split = mismatch_by_staleness(
            logprobs_T,
            inference_logprobs_T,
            mask_T,
            versions_T,
            trainer_version=trainer_version,
            ratio_low=self.ratio_low,
            ratio_high=self.ratio_high,
        )
        cur, old = split["current"], split["stale"]
        values = [cur.kl_sum, cur.num_outside, cur.num_tokens, old.kl_sum, old.num_outside, old.num_tokens]
        self.sums += torch.tensor(values, dtype=torch.float64, device=self.sums.device)
        self.kl_max.fill_(max(float(self.kl_max), cur.kl_max, old.kl_max))
        n = int(mask_T.sum())
        if replayed_TLK is not None and router_topk_TLK is not None and self.moe_layers and n:
            agree_L = routing_agreement(replayed_TLK, router_topk_TLK, mask_T, self.moe_layers)
            self.agree_sum_L += agree_L.to(self.agree_sum_L.device) * n
            self.agree_n += n

    def all_reduce(
        self, sum_: Callable[[torch.Tensor], object], max_: Callable[[torch.Tensor], object]
    ) -> None:
        for t in (self.sums, self.agree_sum_L, self.agree_n):
            sum_(t)
        max_(self.kl_max)

    def metrics(self) -> dict[str, float]:
        s = dict(zip(self._SUMS, self.sums.tolist(), strict=True))
        n = s["current_n"] + s["stale_n"]
        out = {
            "mismatch_kl_max": float(self.kl_max[0]),
            "mismatch_ratio_outside": (s["current_outside"] + s["stale_outside"]) / max(n, 1.0),
            "mismatch_kl_current": s["current_kl"] / max(s["current_n"], 1.0),
            "mismatch_kl_stale": s["stale_kl"] / max(s["stale_n"], 1.0),
            "mismatch_tokens_stale_fraction": s["stale_n"] / max(n, 1.0),
        }
        if float(self.agree_n[0]) > 0:
            per_layer = (self.agree_sum_L / self.agree_n).tolist()
            out["routing_agreement"] = sum(per_layer) / len(per_layer)
            out |= {
                f"routing_agreement/layer_{layer}": a
                for layer, a in zip(self.moe_layers, per_layer, strict=True)
            }
        return out

"""One optimizer step over packed micro-batches, shared by RL and SFT.

    runner = StepRunner(model, optimizer, scheduler, dist_info, max_grad_norm=1.0, chunk_size=1024)
    result = runner.step(micro_batches, loss_fn, trained_version=n - 1)  # step n trains v_{n-1}

The step: count loss tokens on every rank and all-reduce the count; for each micro-batch run the
model (replaying routed experts when present), recompute sampled-token logprobs through the
chunked LM head, compute the loss (already divided by the global count) and backpropagate;
clip; then either step the optimizer or, if the loss or the gradient norm is not finite, drop
the gradients and leave the weights untouched.

With a `ParallelState` (FSDP2 / EP / CP under torchrun, see scaleout.py) every rank first pads
its micro-batch list to the same length, runs its CP chunk of each row with the context-parallel
attention backend, lets FSDP reduce-scatter the gradients, and clips with
`asyncrl.distributed.clip_grad_norm_` (dense and expert gradients live on different meshes).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.distributed import DistInfo, all_reduce_, clip_grad_norm_
from asyncrl.model import AttentionBackend, Transformer
from asyncrl.trainer.logprobs import chunked_logprobs
from asyncrl.trainer.loss import LossInputs, LossResult
from asyncrl.trainer.mismatch import MismatchAccumulator
from asyncrl.trainer.packing import MicroBatch
from asyncrl.trainer.scaleout import LocalMicroBatch, ParallelState, equalize_micro_batches, split_for_rank

__all__ = ["LossFn", "StepResult", "StepRunner"]

LossFn = Callable[[LossInputs, float], LossResult]

# Order of the summed statistics all-reduced once per step.
_SUMS = ("loss", "num_masked", "mismatch_kl", "entropy", "staleness", "num_tokens", "context")


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """Global (all-rank) statistics of one step. Means are over loss tokens."""

    skipped: bool  # True when the step was not applied (non-finite loss/grad, or no loss tokens)
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int  # all tokens in the packed rows
    num_loss_tokens: int
    masked_fraction: float
    mismatch_kl: float
    entropy: float
    staleness_mean: float
    staleness_max: int
    mean_context: float  # keys each token attends to, averaged over all tokens (for FLOP counts)
    seconds: float
    mismatch: dict[
        str, float
    ]  # MismatchAccumulator.metrics(): max, outliers, current/stale, routing agreement


class StepRunner:
    def __init__(
        self,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        info: DistInfo,
        *,
        max_grad_norm: float,
        chunk_size: int,
        ratio_bounds: tuple[float, float] = (0.5, 2.0),
        parallel: ParallelState | None = None,
    ) -> None:
        if info.is_distributed and parallel is None:
            raise ValueError(
                "StepRunner at world size > 1 needs a ParallelState (build_parallel_model): "
                "gradients are summed by FSDP, not by the step runner"
            )
        self.model, self.optimizer, self.scheduler, self.info = model, optimizer, scheduler, info
        self.parallel = parallel
        self.max_grad_norm, self.chunk_size, self.ratio_bounds = max_grad_norm, chunk_size, ratio_bounds
        self.params = [p for p in model.parameters() if p.requires_grad]

    def forward_micro_batch(
        self, mb: MicroBatch, attention: AttentionBackend | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of the targets under the current weights [T] (with grad) and entropies [T]."""
        logprobs_T, entropy_T, _ = self._forward(mb, attention)
        return logprobs_T, entropy_T

    def _forward(
        self, mb: MicroBatch, attention: AttentionBackend | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Also returns the router's own top-k [T, L, K] when routing is replayed (for agreement)."""
        replay = mb.routed_experts is not None
        out = self.model(
            mb.input_ids,
            mb.position_ids,
            routed_experts=mb.routed_experts,
            return_routing=replay,
            attention=attention,
            compute_logits=False,
        )
        h_TD = out.hidden_states[0]
        logprobs_T, entropy_T = chunked_logprobs(
            h_TD, self.model.lm_head.weight, mb.target_ids, mb.temperatures, self.chunk_size
        )
        return logprobs_T, entropy_T, (out.router_topk[0] if replay else None)

    def step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, trained_version: int) -> StepResult:
        start = time.perf_counter()
        device = self.info.device
        local = self._local_micro_batches([mb.to(device) for mb in micro_batches])
        count = torch.tensor([float(sum(int(lm.mb.loss_mask.sum()) for lm in local))], device=device)
        num_loss_tokens = float(all_reduce_(count, self.info)[0])
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)
        staleness_max = torch.zeros(1, dtype=torch.float64, device=device)
        mm = MismatchAccumulator(self.model.args.moe_layers, *self.ratio_bounds, device=device)
        if num_loss_tokens > 0:
            for lm in local:
                self._accumulate(lm, loss_fn, num_loss_tokens, trained_version, sums, staleness_max, mm)
        all_reduce_(sums, self.info)
        all_reduce_(staleness_max, self.info, op="max")
        mm.all_reduce(lambda t: all_reduce_(t, self.info), lambda t: all_reduce_(t, self.info, op="max"))
        grad_norm = self._clip()
        stats = dict(zip(_SUMS, sums.tolist()))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = num_loss_tokens == 0 or not (math.isfinite(stats["loss"]) and math.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()" is intended here
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()  # the schedule follows step numbers, applied or not
        else:
            self.optimizer.step()
            self.scheduler.step()
        denom = max(num_loss_tokens, 1.0)
        return StepResult(
            skipped=skipped,
            loss=stats["loss"],
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=int(stats["num_tokens"]),
            num_loss_tokens=int(num_loss_tokens),
            masked_fraction=stats["num_masked"] / denom,
            mismatch_kl=stats["mismatch_kl"] / denom,
            entropy=stats["entropy"] / denom,
            staleness_mean=stats["staleness"] / denom,
            staleness_max=int(staleness_max[0]),
            mean_context=stats["context"] / max(stats["num_tokens"], 1.0),
            seconds=time.perf_counter() - start,
            mismatch=mm.metrics(),
        )

    def _local_micro_batches(self, micro_batches: list[MicroBatch]) -> list[LocalMicroBatch]:
        if self.parallel is None:
            return [
                LocalMicroBatch(
                    mb=mb,
                    attention=None,
                    num_tokens=mb.num_tokens,
                    context=float((mb.position_ids + 1).sum()),
                )
                for mb in micro_batches
            ]
        micro_batches = equalize_micro_batches(micro_batches, self.parallel, self.info.device)
        return [split_for_rank(mb, self.parallel) for mb in micro_batches]

    def _clip(self) -> float:
        """Clip by the global gradient norm and return it (FSDP already summed gradients over ranks)."""
        if self.parallel is not None:  # dense and expert gradients live on different meshes
            return float(clip_grad_norm_(self.params, self.max_grad_norm))
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True))

    def _accumulate(
        self,
        lm: LocalMicroBatch,
        loss_fn: LossFn,
        num_loss_tokens: float,
        trained_version: int,
        sums: torch.Tensor,
        staleness_max: torch.Tensor,
        mm: MismatchAccumulator,
    ) -> None:
        mb = lm.mb
        logprobs_T, entropy_T, router_topk_TLK = self._forward(mb, lm.attention)
        inputs = LossInputs(
            logprobs=logprobs_T,
            inference_logprobs=mb.inference_logprobs,
            advantages=mb.advantages,
            loss_mask=mb.loss_mask,
            seq_ids=mb.seq_ids,
        )
        result = loss_fn(inputs, num_loss_tokens)
        result.loss.backward()
        with torch.no_grad():
            mask_T = mb.loss_mask
            # staleness = optimizer steps between the sampling weights and the weights trained now
            # (0 = on-policy)
            staleness_T = (trained_version - mb.policy_versions).double()
            sums += torch.stack(
                [
                    result.loss.detach().double(),
                    result.num_masked.double(),
                    result.mismatch_kl_sum.double(),
                    entropy_T.double()[mask_T].sum(),
                    staleness_T[mask_T].sum(),
                    torch.tensor(float(lm.num_tokens), dtype=torch.float64, device=sums.device),
                    torch.tensor(lm.context, dtype=torch.float64, device=sums.device),
                ]
            )
            if mask_T.any():
                staleness_max.copy_(torch.maximum(staleness_max, staleness_T[mask_T].max().reshape(1)))
            replayed = None if mb.routed_experts is None else mb.routed_experts[0]
            mm.add(
                logprobs_T,
                mb.inference_logprobs,
                mask_T,
                mb.context_versions,
                trainer_version=trained_version,
                replayed_TLK=replayed,
                router_topk_TLK=router_topk_TLK,
            )

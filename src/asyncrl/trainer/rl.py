"""The RL loop: one optimizer step per rollout batch, from the session's start step to max_steps.

    records = run_rl(cfg)   # cfg: RLTrainerConfig; the process entry point is asyncrl.trainer.main

Step n waits for batch n, reads this data rank's part of it (the orchestrator writes one per
rank), checks that it fits the model, trains on it (packed rows, the configured off-policy loss,
router replay when the samples carry routing), publishes v_n, logs the step and applies the
mismatch gate.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.model import ModelArgs
from asyncrl.run_dir import batch_dir
from asyncrl.trainer.loss import LossInputs, LossResult, rl_loss
from asyncrl.trainer.mismatch import check_mismatch_gate
from asyncrl.trainer.packing import pack_samples
from asyncrl.trainer.session import TrainSession
from asyncrl.transport import BatchShare, read_batch_part
from asyncrl.wire import BatchFormatError, RolloutBatch

__all__ = ["check_batch_fits_model", "run_rl"]


def check_batch_fits_model(batch: RolloutBatch, args: ModelArgs, where: str) -> None:
    """Catch token ids and routing shapes that do not belong to this model, naming the field."""
    for i, s in enumerate(batch.samples):
        outside = s.token_ids[(s.token_ids < 0) | (s.token_ids >= args.vocab_size)]
        if outside.size:
            raise BatchFormatError(
                f"{where}: sample {i}: field 'token_ids' holds id {int(outside[0])}, "
                f"outside the model's vocab of {args.vocab_size}"
            )
        if s.routed_experts is not None and args.is_moe:
            want = (args.num_hidden_layers, args.num_experts_per_tok)
            if tuple(s.routed_experts.shape[1:]) != want:
                raise BatchFormatError(
                    f"{where}: sample {i}: field 'routed_experts' has [layers, top_k] = "
                    f"{list(s.routed_experts.shape[1:])}, the model needs {list(want)}"
                )
            if int(s.routed_experts.max()) >= args.num_experts:
                raise BatchFormatError(
                    f"{where}: sample {i}: field 'routed_experts' holds expert "
                    f"{int(s.routed_experts.max())}, the model has {args.num_experts}"
                )


def batch_stats(share: BatchShare) -> dict[str, Any]:
    """The whole batch's sample count and mean reward (from its manifest), and the bytes this rank
    read of it against the batch's size, for the trainer's metrics line."""
    rewards = share.manifest.rewards
    return {
        "num_samples": len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "batch_bytes_read": share.num_bytes_read,
        "batch_bytes": share.manifest.num_bytes,
    }


def _warn_if_replay_is_idle(cfg: RLTrainerConfig, args: ModelArgs, batch: RolloutBatch) -> None:
    if not (cfg.router_replay and args.is_moe and batch.samples):
        return
    if all(s.routed_experts is None for s in batch.samples):
        warnings.warn(
            f"router_replay = true but this rank's part of batch {batch.step} carries no routed_experts; "
            "the trainer routes "
            "with its own router (ask the orchestrator for return_routed_experts)",
            stacklevel=2,
        )


def run_rl(cfg: RLTrainerConfig) -> list[dict[str, Any]]:
    """Train from session.start_step + 1 to cfg.max_steps; returns the metric records (main rank)."""
    session = TrainSession.build(cfg)
    records = []

    def loss_fn(inputs: LossInputs, num_loss_tokens: float) -> LossResult:
        return rl_loss(inputs, cfg.loss, num_loss_tokens)

    replay = cfg.router_replay and session.model.args.is_moe
    try:
        for step in range(session.start_step + 1, cfg.max_steps + 1):
            t_wait = time.perf_counter()
            share = read_batch_part(
                cfg.run_dir,
                step,
                rank=session.data_rank,
                num_ranks=session.data_size,
                timeout_s=cfg.batch_timeout_s,
            )
            wait_s = time.perf_counter() - t_wait
            mine = share.batch
            check_batch_fits_model(mine, session.model.args, str(batch_dir(cfg.run_dir, step)))
            if step == session.start_step + 1:
                _warn_if_replay_is_idle(cfg, session.model.args, mine)
            micro_batches = pack_samples(mine.samples, cfg.seq_len, replay=replay)
            result = session.step_runner.step(micro_batches, loss_fn, trained_version=step - 1)
            records.append(session.end_step(step, result, batch_stats(share) | {"wait_s": wait_s}))
            check_mismatch_gate(
                result.mismatch["mismatch_kl_current"],
                max_kl=cfg.mismatch.max_mismatch_kl,
                mode=cfg.mismatch.gate,
                step=step,
                kl_stale=result.mismatch["mismatch_kl_stale"],
            )
    finally:
        session.close()
    return records

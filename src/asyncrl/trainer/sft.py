"""`asyncrl sft @ sft.toml [--dotted.key value]`: supervised fine-tuning with the RL trainer's machinery.

    asyncrl sft @ sft.toml --data.path data/chat.jsonl --max-steps 200 --run-dir outputs/sft

Each step takes `data.batch_size` sequences (see asyncrl.trainer.sft_sources for the JSONL forms),
this rank's share of them, packs them into rows of at most seq_len tokens and minimises the
cross-entropy of the loss tokens, normalised by the global loss-token count. The optimizer,
schedule, checkpoints (`--resume`), weight publishing (`RUN/weights/step_n/`) and metrics are the
ones the RL trainer uses, so the output directory serves as the base model of an RL run.
With `[stop] loss = X` the run ends early, at the first step where the mean loss of the last
`stop.window` steps is at most X (see SFTStopConfig); max_steps is then the cap.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

from transformers import AutoTokenizer

from asyncrl.config import load_config
from asyncrl.config.trainer import SFTConfig, SFTStopConfig
from asyncrl.trainer.diskspace import report_disk_full
from asyncrl.trainer.loss import LossInputs, LossResult, sft_loss
from asyncrl.trainer.packing import pack_samples, shard_samples
from asyncrl.trainer.session import TrainSession
from asyncrl.trainer.sft_sources import JsonlSFTSource, SFTSource
from asyncrl.transport import DiskFullError

__all__ = ["main", "run_sft"]

# RL-only metrics that mean nothing for supervised data.
_RL_ONLY = (
    "masked_fraction",
    "mismatch_kl",
    "staleness_mean",
    "staleness_max",
    "mismatch_kl_max",
    "mismatch_ratio_outside",
    "mismatch_kl_current",
    "mismatch_kl_stale",
    "mismatch_tokens_stale_fraction",
)


def _loss(inputs: LossInputs, num_loss_tokens: float) -> LossResult:
    return sft_loss(inputs, num_loss_tokens)


def build_source(cfg: SFTConfig) -> SFTSource:
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.path))
    d = cfg.data
    return JsonlSFTSource(
        d.path, tokenizer, batch_size=d.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, shuffle=d.shuffle
    )


class _StopRule:
    """SFTStopConfig over a run: the losses of the last `window` applied steps.

    The loss is all-reduced, so every rank reaches the same decision at the same step.
    """

    def __init__(self, cfg: SFTStopConfig) -> None:
        self.threshold = cfg.loss
        self.recent: deque[float] = deque(maxlen=cfg.window)

    def reached(self, loss: float, skipped: bool) -> bool:
        if self.threshold is None:
            return False
        if not skipped:
            self.recent.append(loss)
        full = len(self.recent) == self.recent.maxlen
        return full and sum(self.recent) / len(self.recent) <= self.threshold


def run_sft(cfg: SFTConfig, source: SFTSource | None = None) -> list[dict[str, Any]]:
    """Train from session.start_step + 1 to cfg.max_steps, or until cfg.stop is met; returns the
    metric records (main rank)."""
    source = source or build_source(cfg)
    session = TrainSession.build(cfg)
    stop = _StopRule(cfg.stop)
    records = []
    try:
        for step in range(session.start_step + 1, cfg.max_steps + 1):
            mine = shard_samples(source.batch(step), session.data_rank, session.data_size)
            micro_batches = pack_samples(mine, cfg.seq_len, replay=False)
            result = session.step_runner.step(micro_batches, _loss, trained_version=step - 1)
            done = stop.reached(result.loss, result.skipped)
            records.append(session.end_step(step, result, drop_keys=_RL_ONLY, last=done))
            if done:
                if session.info.is_main:
                    print(
                        f"[sft] stop at step {step}: mean loss of the last {cfg.stop.window} steps "
                        f"<= {cfg.stop.loss}",
                        flush=True,
                    )
                break
    finally:
        session.close()
    return records


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(SFTConfig, list(sys.argv[1:] if argv is None else argv))
    try:
        run_sft(cfg)
    except DiskFullError as e:
        return report_disk_full("asyncrl sft", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

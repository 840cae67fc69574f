"""`asyncrl trainer @ rl.toml [--dotted.key value]`: the RL trainer process.

    asyncrl trainer @ rl.toml --run-dir outputs/demo --max-steps 100
    torchrun --nproc-per-node 2 -m asyncrl.trainer.main @ rl.toml      # FSDP2 over 2 ranks
    torchrun --nproc-per-node 4 -m asyncrl.trainer.main @ rl.toml --parallel.ep 2 --parallel.cp 2

Step n reads `RUN/rollouts/step_n/` (waiting up to batch_timeout_s), takes this data rank's share
of the samples, packs them into rows of at most seq_len tokens, runs one optimizer step with the
configured off-policy loss (router replay on when samples carry routed experts), publishes
`RUN/weights/step_n/` and appends a line to `RUN/metrics.jsonl`. `--resume` (or `--resume-step N`) continues
from the latest checkpoint with the same step numbering. A publish or checkpoint that does not fit
on the disk (checked before it starts) stops the trainer with one line that names the path, what
was being written and the free space (exit code 1); nothing partial is left as a complete step.
"""

from __future__ import annotations

import sys

from asyncrl.config import load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.trainer.diskspace import report_disk_full
from asyncrl.trainer.rl import run_rl
from asyncrl.transport import DiskFullError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(RLTrainerConfig, list(sys.argv[1:] if argv is None else argv))
    try:
        run_rl(cfg)
    except DiskFullError as e:
        return report_disk_full("asyncrl trainer", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

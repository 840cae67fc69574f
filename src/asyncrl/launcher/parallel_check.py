"""Check `[trainer.parallel]` against the trainer's world size before anything is launched.

    check_trainer_parallel(resolved.trainer, world_size=cfg.deployment.trainer_nproc, where="...")

The trainer validates the same degrees at start-up (before its process group exists); checking
here as well turns a wasted Slurm allocation or a child crash into an immediate config error.
`num_experts` comes from the model's config.json when the directory is reachable from here;
otherwise the expert-parallel rules that need it are left to the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.config.trainer import RLTrainerConfig

__all__ = ["check_trainer_parallel"]


def _num_experts(model_dir: Path) -> int | None:
    """Experts per MoE layer from config.json (0 for a dense model), or None if unreadable here."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # the trainer reports a broken config.json with its own error
    return int(cfg.get("num_experts") or 0)


def check_trainer_parallel(
    trainer: RLTrainerConfig, *, world_size: int, where: str, model_dir: Path | None = None
) -> None:
    """Raise ConfigError naming the violated constraint (see asyncrl.distributed.ParallelDims).

    `model_dir`: where to read the model's config.json, when not from the trainer's model path (a
    job rendered away from the filesystem that holds the model)."""
    # Imported here: asyncrl.distributed pulls in torch, which `asyncrl rl --help` does not need.
    from asyncrl.distributed import ParallelDims, ParallelDimsError

    p = trainer.parallel
    num_experts = _num_experts(model_dir or trainer.model.path)
    ep = p.ep if num_experts is not None else 1
    try:
        ParallelDims.build(
            world_size=world_size, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard,
            ep=ep, cp=p.cp, num_experts=num_experts or 0,
        )  # fmt: skip
    except ParallelDimsError as e:
        raise ConfigError(f"[trainer.parallel] with {where}: {e}") from None

"""The layout of a run directory: one function per path, the only place that spells their names.

    RUN/
      configs/<name>.toml   config_file      the resolved config of each process (asyncrl rl, slurm)
      logs/<name>.log       log_file         the output of each child process
      rollouts/step_N/      batch_dir        batch N, with the orchestrator's checkpoint
      weights/step_N/       weights_dir      policy version N: HF safetensors + STABLE
      weights/keep.json     weights_keep_file  versions pruning must keep (the eval's, the best)
      checkpoints/step_N/   checkpoint_dir   the trainer's DCP checkpoint after step N
      metrics.jsonl         metrics_file     one line per step and role
      eval.jsonl            eval_file        `asyncrl eval --json-out` results `asyncrl report` reads
      report/               report_dir       `asyncrl report`'s page and plots
      tensorboard/          tensorboard_dir  the TensorBoard sink's event files
      slurm.sbatch          sbatch_file      `asyncrl slurm`'s job script
      slurm.check           slurm_check_file the nonce that job's head node writes for every node to read

`rollouts_root`, `weights_root` and `checkpoints_root` are the parents of the step directories;
`step_name` and `step_of` turn a step into its directory's name and back, and `steps_in` lists the
steps under a parent. The files inside a step directory belong to their writers (asyncrl.transport:
the batch's parts and manifest, and the STABLE marker; asyncrl.orchestrator.checkpoint: its state
file). This module imports nothing of asyncrl and not torch, so every package may use it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "batch_dir",
    "checkpoint_dir",
    "checkpoint_steps",
    "checkpoints_root",
    "config_file",
    "configs_dir",
    "eval_file",
    "latest_checkpoint_step",
    "log_file",
    "logs_dir",
    "metrics_file",
    "report_dir",
    "rollouts_root",
    "sbatch_file",
    "slurm_check_file",
    "step_name",
    "step_of",
    "steps_in",
    "tensorboard_dir",
    "weights_dir",
    "weights_keep_file",
    "weights_root",
]

RunDir = str | os.PathLike

_STEP_NAME = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    """The name of step `step`'s directory under rollouts/, weights/ and checkpoints/."""
    return f"step_{step}"


def step_of(name: str) -> int | None:
    """The step a directory name stands for (`step_12` -> 12), or None for any other name."""
    m = _STEP_NAME.match(name)
    return int(m[1]) if m else None


def steps_in(root: Path, *, marker: str | None = None) -> list[int]:
    """Steps of the `step_N` directories under `root`, ascending; with `marker`, of those that hold it."""
    if not root.is_dir():
        return []
    found = ((step_of(child.name), child) for child in root.iterdir())
    return sorted(s for s, child in found if s is not None and (marker is None or (child / marker).is_file()))


def configs_dir(run_dir: RunDir) -> Path:
    return Path(run_dir) / "configs"


def config_file(run_dir: RunDir, name: str) -> Path:
    return configs_dir(run_dir) / f"{name}.toml"


def logs_dir(run_dir: RunDir) -> Path:
    return Path(run_dir) / "logs"


def log_file(run_dir: RunDir, name: str) -> Path:
    return logs_dir(run_dir) / f"{name}.log"


def rollouts_root(run_dir: RunDir) -> Path:
    return Path(run_dir) / "rollouts"


def batch_dir(run_dir: RunDir, step: int) -> Path:
    return rollouts_root(run_dir) / step_name(step)


def weights_root(run_dir: RunDir) -> Path:
    return Path(run_dir) / "weights"


def weights_dir(run_dir: RunDir, step: int) -> Path:
    return weights_root(run_dir) / step_name(step)


def weights_keep_file(run_dir: RunDir) -> Path:
    return weights_root(run_dir) / "keep.json"


def checkpoints_root(run_dir: RunDir) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_dir(run_dir: RunDir, step: int) -> Path:
    return checkpoints_root(run_dir) / step_name(step)


def checkpoint_steps(run_dir: RunDir) -> list[int]:
    """Steps of the complete checkpoints (the ones whose DCP `.metadata` was written), ascending."""
    return steps_in(checkpoints_root(run_dir), marker=".metadata")


def latest_checkpoint_step(run_dir: RunDir) -> int | None:
    steps = checkpoint_steps(run_dir)
    return steps[-1] if steps else None


def metrics_file(run_dir: RunDir) -> Path:
    return Path(run_dir) / "metrics.jsonl"


def eval_file(run_dir: RunDir) -> Path:
    return Path(run_dir) / "eval.jsonl"


def report_dir(run_dir: RunDir) -> Path:
    return Path(run_dir) / "report"


def tensorboard_dir(run_dir: RunDir) -> Path:
    return Path(run_dir) / "tensorboard"


def sbatch_file(run_dir: RunDir) -> Path:
    return Path(run_dir) / "slurm.sbatch"


def slurm_check_file(run_dir: RunDir) -> Path:
    return Path(run_dir) / "slurm.check"

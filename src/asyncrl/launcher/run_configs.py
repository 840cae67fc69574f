"""RUN/configs/: the resolved config of every process of an RL run, one TOML file each.

`asyncrl rl` and `asyncrl slurm` both write them; each child process is then started with
`@ RUN/configs/<name>.toml`, so a run can be inspected and any process restarted by hand.
"""

from __future__ import annotations

from pathlib import Path

import tomli_w
from pydantic import BaseModel

from asyncrl.config.rl import ResolvedRL, RLConfig
from asyncrl.run_dir import config_file, configs_dir

__all__ = ["write_configs"]


def _dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json", exclude_none=True)


def _dump_rl(cfg: RLConfig) -> dict:
    """The run's config as given: the process sections keep only the keys they set, so that the file
    read again resolves to the same processes (resolve() derives the others)."""
    sections = ("inference", "orchestrator", "trainer")
    out = cfg.model_dump(mode="json", exclude_none=True, exclude=set(sections))
    for name in sections:
        out[name] = getattr(cfg, name).model_dump(mode="json", exclude_none=True, exclude_unset=True)
    return out


def write_configs(cfg: RLConfig, resolved: ResolvedRL) -> dict[str, Path]:
    """Write rl.toml, inference-<i>.toml, orchestrator.toml and trainer.toml; name -> path."""
    configs_dir(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    models = {"rl": cfg} | {f"inference-{i}": inf for i, inf in enumerate(resolved.inference)}
    models |= {name: getattr(resolved, name) for name in ("orchestrator", "trainer")}
    files = {}
    for name, model in models.items():
        files[name] = config_file(cfg.run_dir, name)
        files[name].touch(mode=0o600)  # they may hold the run's API key: owner only
        files[name].chmod(0o600)
        files[name].write_text(tomli_w.dumps(_dump_rl(cfg) if name == "rl" else _dump(model)))
    return files

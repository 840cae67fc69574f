"""RUN/configs/: the resolved config of every process of an RL run, one TOML file each.

`asyncrl rl` and `asyncrl slurm` both write them; each child process is then started with
`@ RUN/configs/<name>.toml`, so a run can be inspected and any process restarted by hand.
"""

from __future__ import annotations

from pathlib import Path

import tomli_w
from pydantic import BaseModel

from asyncrl.config.rl import ResolvedRL, RLConfig

__all__ = ["write_configs"]


def _dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json", exclude_none=True)


def write_configs(cfg: RLConfig, resolved: ResolvedRL) -> dict[str, Path]:
    """Write rl.toml, inference-<i>.toml, orchestrator.toml and trainer.toml; name -> path."""
    configs = Path(cfg.run_dir) / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    files = {"rl": configs / "rl.toml"}
    files["rl"].write_text(tomli_w.dumps(_dump(cfg)))
    for i, inf in enumerate(resolved.inference):
        files[f"inference-{i}"] = configs / f"inference-{i}.toml"
        files[f"inference-{i}"].write_text(tomli_w.dumps(_dump(inf)))
    for name in ("orchestrator", "trainer"):
        files[name] = configs / f"{name}.toml"
        files[name].write_text(tomli_w.dumps(_dump(getattr(resolved, name))))
    return files

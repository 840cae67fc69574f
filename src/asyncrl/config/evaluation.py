"""Config schema of the evals during training: `[orchestrator.eval]`.

Example (TOML)::

    [orchestrator.eval]
    interval = 10                 # every 10 policy versions (and v0, and the final version); 0 = off
    k = 4                         # samples per task at the training temperature: pass@1 and pass@4
    greedy = true                 # and one greedy sample per task: greedy_reward
    num_tasks = 64                # tasks 0..63 of each env's eval split
    keep_best = "eval/reverse-text/pass@4"   # the best version by this metric is kept from pruning

By default every training env is evaluated on its own eval split; `[[orchestrator.eval.envs]]`
tables name other envs instead (a held-out task file, say), each evaluated on its eval split.
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.base import BaseConfig
from asyncrl.config.envs import EnvConfig

__all__ = ["EvalConfig"]


class EvalConfig(BaseConfig):
    """Held-out evals on the servers while a run trains (docs/orchestrator.md, Evaluation during training)."""

    interval: int = Field(
        0, ge=0, description="evaluate every N policy versions, v0 and the final version too; 0 = off"
    )
    k: int = Field(4, ge=1, description="samples per task at the training temperature (pass@1, pass@k)")
    greedy: bool = Field(True, description="one greedy sample per task as well (greedy_reward)")
    num_tasks: int = Field(64, ge=1, description="tasks 0..num_tasks-1 of each eval env's eval split")
    envs: list[EnvConfig] = Field(
        default_factory=list,
        description="envs to evaluate, each on its eval split; empty: every training env "
        "([orchestrator.envs])",
    )
    pass_threshold: float = Field(
        1.0, description="an episode passes (pass@1, pass@k) when its reward is at least this"
    )
    keep_best: str | None = Field(
        None,
        description="an eval metric, eval/<env>/<reward|pass@1|pass@k|greedy_reward> with k spelt out: the "
        "version with its highest value is kept from weight pruning and named at the end of the run",
    )

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def labels(self, training_envs: list[EnvConfig]) -> list[str]:
        """The env names of the eval's metric keys, `eval/<label>/...`."""
        return [e.label or e.name for e in (self.envs or training_envs)]

    def check(self, training_envs: list[EnvConfig], max_model_len: int | None) -> None:
        """Unique env names, a keep_best that the eval writes, and budgets that fit the servers."""
        labels = self.labels(training_envs)
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(
                f"eval envs {twice} appear more than once: their metrics would share keys; give each a label"
            )
        if self.keep_best is not None:
            self._check_keep_best(labels)
        for i, env in enumerate(self.envs):
            if max_model_len is not None and env.max_total_tokens > max_model_len:
                raise ValueError(
                    f"eval.envs[{i}] ({env.label or env.name}) max_total_tokens ({env.max_total_tokens}) is "
                    f"larger than max_model_len ({max_model_len}), the servers' context limit; lower it"
                )

    def _check_keep_best(self, labels: list[str]) -> None:
        metrics = ["reward", "pass@1", f"pass@{self.k}", *(["greedy_reward"] if self.greedy else [])]
        allowed = [f"eval/{label}/{m}" for label in labels for m in dict.fromkeys(metrics)]
        if self.keep_best not in allowed:
            raise ValueError(
                f"eval.keep_best = {self.keep_best!r} is not a metric this eval writes (higher is better); "
                f"choose one of {allowed}"
            )

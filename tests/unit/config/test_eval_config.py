"""`[orchestrator.eval]`: off by default, its keep_best names a metric the eval writes, env names unique."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import RLConfig


def _rl(**orchestrator) -> RLConfig:
    return load_config(RLConfig, {"model": "m", "run_dir": "r", "orchestrator": orchestrator})


def test_eval_is_off_by_default_and_parses_from_an_rl_config():
    assert not _rl().resolve().orchestrator.eval.enabled
    cfg = _rl(eval={"interval": 10, "k": 8, "greedy": False, "keep_best": "eval/reverse-text/pass@8"})
    ev = cfg.resolve().orchestrator.eval
    assert ev.enabled and (ev.interval, ev.k, ev.greedy, ev.num_tasks) == (10, 8, False, 64)
    assert ev.labels(cfg.resolve().orchestrator.envs.envs) == ["reverse-text"]


def test_keep_best_must_be_a_metric_the_eval_writes():
    with pytest.raises(
        ConfigError, match=r"eval.keep_best = 'eval/reverse-text/pass@4' is not a metric"
    ) as e:
        _rl(eval={"interval": 5, "k": 8, "keep_best": "eval/reverse-text/pass@4"}).resolve()
    assert "'eval/reverse-text/pass@8'" in str(e.value) and "'eval/reverse-text/greedy_reward'" in str(
        e.value
    )
    with pytest.raises(ConfigError, match=r"greedy_reward.* is not a metric"):
        _rl(eval={"interval": 5, "greedy": False, "keep_best": "eval/reverse-text/greedy_reward"}).resolve()
    with pytest.raises(ConfigError, match=r"'eval/sort/reward' is not a metric"):  # not an eval env
        _rl(eval={"interval": 5, "keep_best": "eval/sort/reward"}).resolve()
    named = {
        "interval": 5,
        "envs": [{"name": "dataset", "label": "held-out"}],
        "keep_best": "eval/held-out/reward",
    }
    assert OrchestratorConfig(model="m", eval=named).eval.keep_best == "eval/held-out/reward"


def test_eval_env_names_must_be_unique_and_their_budgets_fit_the_servers():
    twice = [{"name": "reverse-text"}, {"name": "reverse-text", "args": {"max_len": 4}}]
    with pytest.raises(ValueError, match=r"eval envs \['reverse-text'\] appear more than once"):
        OrchestratorConfig(model="m", eval={"interval": 2, "envs": twice})
    labelled = [twice[0], twice[1] | {"label": "short"}]
    assert OrchestratorConfig(model="m", eval={"interval": 2, "envs": labelled}).eval.labels([]) == [
        "reverse-text",
        "short",
    ]
    with pytest.raises(
        ValueError, match=r"eval.envs\[0\] \(reverse-text\) max_total_tokens \(2048\) is larger"
    ):
        OrchestratorConfig(
            model="m",
            max_model_len=1024,
            envs={"envs": [{"name": "reverse-text", "max_total_tokens": 512}]},
            eval={"interval": 2, "envs": twice[:1]},
        )

"""RL rollout sampling the loss can honour: temperature > 0 and no top-p / top-k / min-p truncation.

The engine reports each token's logprob under the full temperature-scaled distribution and the
trainer recomputes the same; greedy (temperature 0) has no such distribution and truncation
samples from another one. Eval sampling (asyncrl eval, SamplingParams itself) keeps both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import RLConfig
from asyncrl.config.sampling import SamplingParams
from asyncrl.launcher.cli import main

DEMO = Path(__file__).parents[3] / "examples" / "reverse_text" / "rl.toml"


def _rl(sampling: dict) -> RLConfig:
    return load_config(RLConfig, {"model": "m", "orchestrator": {"sampling": sampling}})


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"temperature": 0.0}, r"temperature = 0 \(greedy\) cannot train: .* every loss is NaN"),
        ({"top_p": 0.9}, r"top_p = 0\.9 would truncate the distribution"),
        ({"top_k": 20}, r"top_k = 20 would truncate"),
        ({"min_p": 0.05}, r"min_p = 0\.05 would truncate"),
        (
            {"top_p": 0.5, "top_k": 4},
            r"top_p = 0\.5, top_k = 4 would truncate .* importance ratios would be wrong",
        ),
    ],
)
def test_rl_rejects_sampling_the_loss_cannot_honour(sampling, message):
    with pytest.raises(ConfigError, match=r"'orchestrator\.sampling': " + message):
        _rl(sampling).resolve()
    with pytest.raises(ValueError, match=message):
        OrchestratorConfig(model="m", sampling=SamplingParams(**sampling))


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.7}, {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}, {"top_k": 0}],
)
def test_rl_accepts_temperature_only_sampling(sampling):
    orch = _rl(sampling | {"max_tokens": 8}).resolve().orchestrator
    assert orch.sampling.max_tokens == 8 and orch.sampling.temperature > 0


def test_eval_sampling_may_still_be_greedy_or_truncated():
    params = SamplingParams(temperature=0.0, top_p=0.9, top_k=5, min_p=0.1)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 0.9, 5, 0.1)


def test_demo_config_dry_run_still_passes(tmp_path, capsys):
    assert main(["rl", "@", str(DEMO), "--run-dir", str(tmp_path / "rl"), "--dry-run"]) == 0
    assert "asyncrl orchestrator @" in capsys.readouterr().out
    assert (
        main(
            [
                "rl",
                "@",
                str(DEMO),
                "--run-dir",
                str(tmp_path / "bad"),
                "--orchestrator.sampling.top-p",
                "0.95",
                "--dry-run",
            ]
        )
        == 2
    )
    assert "'orchestrator.sampling': top_p = 0.95 would truncate" in capsys.readouterr().err

"""Trainer config parsing (files, dotted overrides, resume flags) and the learning-rate schedule."""

from __future__ import annotations

import itertools
import math

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.trainer import RLTrainerConfig, ScheduleConfig
from asyncrl.trainer.optim import lr_factor


def test_cli_overrides_and_resume_flags(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text('max_steps = 10\n[model]\npath = "m"\n[loss]\nvariant = "mis"\n')
    cfg = load_config(RLTrainerConfig, ["@", str(toml), "--loss.mis-high", "3.0", "--resume-step", "4"])
    assert cfg.loss.variant == "mis" and cfg.loss.mis_high == 3.0 and cfg.resume_step == 4
    assert load_config(RLTrainerConfig, ["@", str(toml), "--resume"]).resume is True


def test_unknown_key_and_bad_variant_are_named(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text('max_steps = 10\n[model]\npath = "m"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'loss.kl_coeff' \(did you mean 'kl_coef'\?\)"):
        load_config(RLTrainerConfig, ["@", str(toml), "--loss.kl-coeff", "0.1"])
    with pytest.raises(ConfigError, match=r"'loss\.variant'"):
        load_config(RLTrainerConfig, ["@", str(toml), "--loss.variant", "ppo"])


def test_warmup_then_cosine_schedule():
    cfg = ScheduleConfig(kind="cosine", warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(i, cfg, max_steps=14) for i in range(15)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))


def test_constant_schedule_after_warmup():
    cfg = ScheduleConfig(kind="constant", warmup_steps=2)
    assert [lr_factor(i, cfg, 10) for i in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]

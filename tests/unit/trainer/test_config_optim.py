"""Trainer config parsing (files, dotted overrides, resume flags), the optimizer and the learning-rate
schedule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.config.trainer import (
    OptimConfig,
    RLTrainerConfig,
    ScheduleConfig,
    SequenceLossConfig,
    TISLossConfig,
    TrustRegionLossConfig,
)
from asyncrl.trainer.optim import build_optimizer, lr_factor


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


def test_a_key_of_another_loss_variant_fails_as_the_config_is_read(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text('max_steps = 10\n[model]\npath = "m"\n[loss]\nvariant = "trust_region"\nmis_low = 0.3\n')
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'loss.mis_low': it belongs to variant = 'mis', and this table's variant is "
        r"'trust_region'",
    ):
        load_config(RLTrainerConfig, ["@", str(toml)])
    # without `variant` the table is the default variant's
    with pytest.raises(ConfigError, match=r"'loss.seq_high': it belongs to variant = 'sequence'"):
        load_config(RLTrainerConfig, ["--model.path", "m", "--max-steps", "1", "--loss.seq-high", "3"])
    with pytest.raises(ConfigError, match=r"'loss.ratio_cap': it belongs to variant = 'trust_region' or"):
        load_config(RLTrainerConfig, ["@", str(toml), "--loss.variant", "tis", "--loss.ratio-cap", "3"])


def test_each_loss_variant_reads_its_own_keys():
    base = ["--model.path", "m", "--max-steps", "1"]
    cfg = load_config(RLTrainerConfig, [*base, "--loss.kl-coef", "0.01"])
    assert isinstance(cfg.loss, TrustRegionLossConfig) and cfg.loss.kl_coef == 0.01
    cfg = load_config(RLTrainerConfig, [*base, "--loss.variant", "tis", "--loss.tis-cap", "1.5"])
    assert isinstance(cfg.loss, TISLossConfig) and cfg.loss.tis_cap == 1.5
    cfg = load_config(RLTrainerConfig, [*base, "--loss.variant", "sequence", "--loss.seq-low", "0.8"])
    assert isinstance(cfg.loss, SequenceLossConfig) and (cfg.loss.seq_low, cfg.loss.ratio_cap) == (0.8, 2.0)
    with pytest.raises(ConfigError, match=r"'loss': mis_low \(2.0\) must be below mis_high \(2.0\)"):
        load_config(RLTrainerConfig, [*base, "--loss.variant", "mis", "--loss.mis-low", "2"])


def test_publish_has_no_kind_and_the_device_defaults_to_auto():
    base = ["--model.path", "m", "--max-steps", "1"]
    assert load_config(RLTrainerConfig, base).model.device == "auto"
    with pytest.raises(ConfigError, match=r"'model.device': Input should be 'auto', 'cpu' or 'cuda'"):
        load_config(RLTrainerConfig, [*base, "--model.device", "gpu"])
    with pytest.raises(ConfigError, match=r"unknown key 'publish.kind'"):
        load_config(RLTrainerConfig, [*base, "--publish.kind", "filesystem"])


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


def test_the_optimizer_is_torchs_fused_adamw_and_steps_as_the_per_op_one():
    gen = torch.Generator().manual_seed(0)
    model, ref = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    ref.load_state_dict(model.state_dict())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    hyper = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    per_op = torch.optim.AdamW(ref.parameters(), **hyper, foreach=False)
    assert opt.defaults["fused"]
    for _ in range(3):
        x = torch.randn(4, 16, generator=gen)
        for m, o in ((model, opt), (ref, per_op)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    before = model.bfloat16().weight.detach().clone()  # bf16 parameters, as a bf16 CPU run trains them
    opt = build_optimizer(model, cfg)
    model(torch.randn(4, 16, generator=gen).bfloat16()).float().square().sum().backward()
    opt.step()
    assert model.weight.dtype == torch.bfloat16 and (model.weight - before).abs().max() > 5e-3

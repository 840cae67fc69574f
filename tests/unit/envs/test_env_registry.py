"""Environments by name or `module:factory`, config validation, and the weighted mixture."""

from __future__ import annotations

import random
import textwrap

import pytest

from asyncrl.config import ConfigError, EnvsConfig, load_config
from asyncrl.envs import EnvConfigError, EnvMixture, build_env, register_env, registry
from asyncrl.envs.builtin.reverse_text import ReverseTextEnv


def test_build_builtin_with_args():
    env = build_env("reverse-text", {"min_len": 5, "max_len": 5}, seed=3)
    assert isinstance(env, ReverseTextEnv) and env.seed == 3
    assert len(env.task("train", 0).answer) == 5


def test_unknown_name_and_bad_args_are_named():
    with pytest.raises(
        EnvConfigError, match=r"unknown environment 'revers-text'.*did you mean 'reverse-text'"
    ):
        build_env("revers-text")
    with pytest.raises(EnvConfigError, match=r"environment 'reverse-text': bad args \['max_length'\]"):
        build_env("reverse-text", {"max_length": 3})
    with pytest.raises(ValueError, match="min_len <= max_len"):
        build_env("reverse-text", {"min_len": 9, "max_len": 3})
    with pytest.raises(EnvConfigError, match="cannot import 'no_such_module_xyz'"):
        build_env("no_such_module_xyz:make")
    with pytest.raises(EnvConfigError, match="has no callable 'nope'"):
        build_env("asyncrl.envs.registry:nope")


def test_module_factory_and_register(tmp_path, monkeypatch):
    (tmp_path / "my_envs_mod.py").write_text(
        textwrap.dedent(
            """
            from asyncrl.envs.builtin.reverse_text import ReverseTextEnv

            def make(seed, length):
                return ReverseTextEnv(seed=seed, min_len=length, max_len=length)

            def not_an_env(seed):
                return 42
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = build_env("my_envs_mod:make", {"length": 4})
    assert len(env.task("eval", 1).answer) == 4
    with pytest.raises(EnvConfigError, match="returned int, not an Environment"):
        build_env("my_envs_mod:not_an_env")
    monkeypatch.setattr(registry, "_REGISTERED", {})
    register_env("fixed-six", lambda seed: ReverseTextEnv(seed=seed, min_len=6, max_len=6))
    assert len(build_env("fixed-six").task("train", 0).answer) == 6
    with pytest.raises(EnvConfigError, match="already registered"):
        register_env("reverse-text", ReverseTextEnv)


def test_config_and_mixture_weights():
    cfg = load_config(
        EnvsConfig,
        ["--seed", "5"],
    )
    assert [e.name for e in cfg.envs] == ["reverse-text"] and cfg.seed == 5
    cfg = load_config(
        EnvsConfig,
        {
            "envs": [
                {"name": "reverse-text", "weight": 3.0},
                {"name": "sort-words", "latency": {"median_s": 0.1}},
            ]
        },
    )
    mix = EnvMixture.from_config(cfg)
    rng = random.Random(0)
    picks = [mix.pick(rng)[0].name for _ in range(4000)]
    assert picks.count("reverse-text") / len(picks) == pytest.approx(0.75, abs=0.03)
    with pytest.raises(ConfigError, match=r"'envs\.0\.weight'"):
        load_config(EnvsConfig, {"envs": [{"name": "reverse-text", "weight": 0}]})
    with pytest.raises(ConfigError, match=r"unknown key 'envs\.0\.wieght'"):
        load_config(EnvsConfig, {"envs": [{"name": "reverse-text", "wieght": 1}]})

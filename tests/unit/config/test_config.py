"""Config files, `@ file` composition, dotted overrides and error messages."""

from __future__ import annotations

import pytest

from asyncrl.config import BaseConfig, ConfigError, load_config


class Optim(BaseConfig):
    lr: float = 1e-3
    betas: list[float] = [0.9, 0.999]


class Demo(BaseConfig):
    model: str = "m"
    max_steps: int = 10
    optim: Optim = Optim()
    flag: bool = False


def test_files_merge_left_to_right_then_overrides(tmp_path):
    (tmp_path / "a.toml").write_text('model = "a"\nmax_steps = 3\n[optim]\nlr = 0.1\n')
    (tmp_path / "b.toml").write_text("[optim]\nbetas = [0.5, 0.6]\n")
    cfg = load_config(
        Demo, ["@", str(tmp_path / "a.toml"), f"@{tmp_path / 'b.toml'}", "--max-steps", "7", "--flag"]
    )
    assert cfg.model == "a" and cfg.max_steps == 7 and cfg.flag is True
    assert cfg.optim.lr == 0.1 and cfg.optim.betas == [0.5, 0.6]
    assert load_config(Demo, ["--optim.lr=3e-4", "--model", "x/y"]).optim.lr == 3e-4


def test_unknown_key_names_nearest_valid_name():
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr' \(did you mean 'lr'\?\)"):
        load_config(Demo, ["--optim.lrr", "1"])
    with pytest.raises(ConfigError, match=r"unknown key 'max_step' \(did you mean 'max_steps'\?\)"):
        load_config(Demo, {"max_step": 1})


def test_bad_values_and_files(tmp_path):
    with pytest.raises(ConfigError, match="'max_steps': Input should be a valid integer"):
        load_config(Demo, ["--max-steps", "many"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Demo, ["@", str(tmp_path / "missing.toml")])
    (tmp_path / "bad.toml").write_text("x = = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(Demo, ["@", str(tmp_path / "bad.toml")])
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        load_config(Demo, ["stray"])


class Env(BaseConfig):
    name: str
    weight: float = 1.0


class WithList(BaseConfig):
    envs: list[Env] = []


def test_lists_of_tables_from_the_command_line():
    toml_style = load_config(WithList, ["--envs", '[{name = "calculator", weight = 2.0}]'])
    json_style = load_config(
        WithList, ["--envs", '[{"name": "calculator", "weight": 2.0}, {"name": "sort-words"}]']
    )
    assert toml_style.envs == [Env(name="calculator", weight=2.0)]
    assert [e.name for e in json_style.envs] == ["calculator", "sort-words"]
    with pytest.raises(ConfigError, match="cannot parse .* as a TOML or JSON value"):
        load_config(WithList, ["--envs", "[{broken"])

"""`--help` text from the config schemas: every key with its default and its Field description."""

from __future__ import annotations

import inspect
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from asyncrl.config import BaseConfig, InferenceConfig, RLTrainerConfig, SFTConfig, SlurmConfig
from asyncrl.config.base import config_help
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import RLConfig
from asyncrl.launcher import cli
from asyncrl.launcher import rl as rl_launcher


class Item(BaseConfig):
    name: str = Field(description="what it is called")


class Inner(BaseConfig):
    """Inner section."""

    lr: float = Field(1e-3, description="step size")
    path: str = Field("x", description="set elsewhere")


class Demo(BaseConfig):
    model: str = Field(description="model directory")
    mode: Literal["a", "b"] | None = Field(None, description="how")
    steps: int = 10
    items: list[Item] = Field(default_factory=lambda: [Item(name="one")], description="the items")
    inner: Inner = Field(default_factory=lambda: Inner(lr=0.5), description="the inner table")


def test_config_help_lists_defaults_descriptions_choices_and_sections():
    text = config_help(Demo, "demo", exclude=("inner.path",))
    lines = text.splitlines()
    assert lines[0] == "[demo]"
    assert lines[1].split() == ["model", "(required)", "model", "directory"]
    assert lines[2].split() == ["mode", "=", "(unset)", "how", "(one", "of", '"a"', "|", '"b")']
    assert lines[3] == "  steps = 10"  # no description: the key and its default alone
    assert lines[4].split() == ["items", "=", '[{"name":', '"one"}]', "the", "items"]
    # the section shows its field's own default (lr = 0.5), not the class default
    assert "[demo.inner]  the inner table\n  lr = 0.5  step size" in text
    assert "set elsewhere" not in text
    assert "[[demo.items]]  (a list; one table per item)\n  name (required)  what it is called" in text


def test_long_descriptions_wrap_in_their_column():
    class Wordy(BaseConfig):
        key: int = Field(1, description=" ".join(["word"] * 40))

    lines = config_help(Wordy, width=60).splitlines()[1:]
    assert len(lines) > 2 and all(len(line) <= 60 for line in lines)
    assert lines[0].startswith("  key = 1  word")  # the description column starts at 2 + 7 + 2
    assert all(line.startswith(" " * 11 + "word") for line in lines[1:])


def _sections_in_use() -> list[type[BaseModel]]:
    """The schemas `asyncrl rl`, `trainer`, `orchestrator`, `inference` and `slurm` read, nested included."""
    todo = [RLConfig, OrchestratorConfig, InferenceConfig, RLTrainerConfig, SFTConfig, SlurmConfig]
    seen: list[type[BaseModel]] = []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for field in cls.model_fields.values():
            for t in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if inspect.isclass(t) and issubclass(t, BaseModel):
                    todo.append(t)
    return seen


@pytest.mark.parametrize("cls", _sections_in_use(), ids=lambda c: c.__name__)
def test_every_key_users_set_has_a_description(cls):
    # A nested section needs none: its title shows its class docstring or its field's description.
    missing = [
        name
        for name, field in cls.model_fields.items()
        if not field.description
        and not (inspect.isclass(field.annotation) and issubclass(field.annotation, BaseModel))
    ]
    assert not missing, f"{cls.__name__}: fields without description=: {missing}"


def test_rl_help_shows_descriptions_and_leaves_out_the_shared_keys(capsys):
    assert rl_launcher.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "asynchronous RL in one command" in out  # the module docstring comes first
    lines = out.splitlines()

    def row(key_and_default: str) -> str:
        return next(line for line in lines if line.strip().startswith(key_and_default))

    assert row("batch_size = 32").endswith("samples per batch (one trainer step)")
    assert row("max_off_policy_steps = 1").endswith("drop samples with a token older than version n-1-k")
    assert row("lr = 1e-05").endswith("peak learning rate")
    assert row("num_inference_servers = 1").endswith("inference servers to start")
    assert "[orchestrator.sampling]  sampling of every rollout request" in out
    assert row("max_tokens = 64").endswith(
        "most tokens sampled per request (turn)"
    )  # the orchestrator's default
    orchestrator = out.split("\n[orchestrator]  ")[1].split("[orchestrator.envs]")[0]
    assert (
        "model, run_dir, max_steps, servers, prefill_servers, seed, api_key, inference_backend, seq_len, "
        "max_model_len, trainer_dp_size, weights_transport come from the top level (max_model_len: the "
        "[inference] servers' context limit) (trainer_dp_size: the [trainer] data-parallel ranks)"
        in orchestrator
    )
    assert (
        "run_dir =" not in orchestrator
        and "servers =" not in orchestrator
        and "api_key =" not in orchestrator
        and "seq_len =" not in orchestrator
    )
    assert "path (required)" not in out.split("[trainer.model]")[1].split("[trainer.optim]")[0]
    # the loss variants: the key that picks one, then each variant's own keys under its title
    assert row('variant = "trust_region"').endswith('one of "trust_region" | "tis" | "mis" | "sequence"')
    mis = out.split('[trainer.loss]  variant = "mis": ')[1].split("\n\n")[0]
    assert "mis_low = 0.5" in mis and "ratio_cap = 2.0" in mis and "delta_low" not in mis
    tis = out.split('[trainer.loss]  variant = "tis": ')[1].split("\n\n")[0]
    assert "tis_cap = 2.0" in tis and "ratio_cap" not in tis


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("trainer", "batch_timeout_s = 600.0   how long to wait for rollouts/step_n"),
        ("sft", "[data]  JSONL rows"),
        ("orchestrator", "group_size = 4"),
        ("inference", "kv_cache_tokens = 32768"),
    ],
)
def test_config_commands_answer_help_with_their_keys(command, expected, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"`asyncrl {command}")  # the module docstring, read without importing it
    assert expected in out
    assert "Keys (TOML, or `--dotted.key value`" in out

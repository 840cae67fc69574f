"""Environments by name: built-ins, `register_env`, or any importable `package.module:factory`.

    env = build_env("reverse-text", {"max_len": 6}, seed=0)
    env = build_env("my_pkg.envs:make_env", {"difficulty": 2})
    env = build_env("verifiers:my_taskset_module", {"num_tasks": 50})   # envs/verifiers_env.py
    mix = EnvMixture.from_config(EnvsConfig(...)); env_cfg, env = mix.pick(rng)

A factory is called as `factory(seed=seed, **args)` and must return an `Environment`.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass

from asyncrl.config.envs import EnvConfig, EnvsConfig
from asyncrl.envs.base import EnvConfigError, Environment

__all__ = ["EnvConfigError", "EnvMixture", "available_envs", "build_env", "register_env"]

EnvFactory = Callable[..., Environment]

_BUILTINS: dict[str, str] = {
    "reverse-text": "asyncrl.envs.builtin.reverse_text:ReverseTextEnv",
    "sort-words": "asyncrl.envs.builtin.sort_words:SortWordsEnv",
    "calculator": "asyncrl.envs.builtin.calculator:CalculatorEnv",
    "long-context": "asyncrl.envs.builtin.long_context:LongContextEnv",
    "swe-lite": "asyncrl.envs.builtin.swe_lite:SweLiteEnv",
    "swe": "asyncrl.envs.builtin.swe:SweEnv",
    "dataset": "asyncrl.envs.builtin.dataset:DatasetEnv",
}
_REGISTERED: dict[str, EnvFactory] = {}


def register_env(name: str, factory: EnvFactory) -> None:
    if name in _BUILTINS or name in _REGISTERED:
        raise EnvConfigError(f"environment name {name!r} is already registered")
    _REGISTERED[name] = factory


def available_envs() -> list[str]:
    return sorted([*_BUILTINS, *_REGISTERED])


def _import_target(target: str) -> EnvFactory:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise EnvConfigError(f"environment factory {target!r} must look like 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvConfigError(f"environment factory {target!r}: cannot import {module_name!r} ({e})") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EnvConfigError(f"environment factory {target!r}: {module_name!r} has no callable {attr!r}")
    return factory


def resolve_factory(name: str) -> EnvFactory:
    if name.startswith("verifiers:"):
        return _verifiers_factory(name.removeprefix("verifiers:"))
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTINS:
        return _import_target(_BUILTINS[name])
    if ":" in name:
        return _import_target(name)
    close = difflib.get_close_matches(name, available_envs(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise EnvConfigError(
        f"unknown environment {name!r}{hint}; known: {available_envs()}, or use 'module:factory'"
    )


def _verifiers_factory(module: str) -> EnvFactory:
    if not module:
        raise EnvConfigError("environment 'verifiers:' needs a module name: 'verifiers:MODULE'")
    from asyncrl.envs.verifiers_env import VerifiersEnv  # imports verifiers only when asked for

    return functools.partial(VerifiersEnv, module=module)


def build_env(name: str, args: dict | None = None, *, seed: int = 0) -> Environment:
    """Instantiate environment `name` with keyword `args`; bad names or arguments raise EnvConfigError."""
    factory = resolve_factory(name)
    args = dict(args or {})
    try:
        inspect.signature(factory).bind(seed=seed, **args)
    except TypeError as e:
        raise EnvConfigError(
            f"environment {name!r}: bad args {sorted(args)}: {e}; signature {inspect.signature(factory)}"
        ) from None
    except ValueError:  # no signature available (builtins); let the call itself complain
        pass
    try:
        env = factory(seed=seed, **args)
    except ImportError as e:  # an optional dependency (verifiers) is missing; the message says which
        raise EnvConfigError(f"environment {name!r}: {e}") from e
    if not isinstance(env, Environment):
        raise EnvConfigError(
            f"environment factory for {name!r} returned {type(env).__name__}, not an Environment"
        )
    return env


@dataclass(frozen=True, kw_only=True)
class EnvMixture:
    """The configured environments and their weights; `pick` samples one in proportion to its weight."""

    configs: tuple[EnvConfig, ...]
    envs: tuple[Environment, ...]

    @classmethod
    def from_config(cls, config: EnvsConfig) -> EnvMixture:
        envs = tuple(build_env(c.name, c.args, seed=config.seed) for c in config.envs)
        return cls(configs=tuple(config.envs), envs=envs)

    def pick(self, rng: random.Random) -> tuple[EnvConfig, Environment]:
        (i,) = rng.choices(range(len(self.envs)), weights=[c.weight for c in self.configs])
        return self.configs[i], self.envs[i]

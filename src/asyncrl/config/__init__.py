"""Typed, torch-free configuration shared by every process (see base.py for the file/CLI grammar)."""

from asyncrl.config.base import (
    BaseConfig,
    ConfigError,
    load_config,
    load_toml,
    merge_dicts,
    parse_cli_overrides,
)
from asyncrl.config.envs import EnvConfig, EnvsConfig, LatencyConfig
from asyncrl.config.fp8 import FP8Config
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.mismatch import MismatchConfig
from asyncrl.config.parallel import ParallelConfig, SlurmConfig
from asyncrl.config.trainer import RLTrainerConfig, SFTConfig

__all__ = [
    "BaseConfig",
    "ConfigError",
    "EnvConfig",
    "EnvsConfig",
    "FP8Config",
    "InferenceConfig",
    "LatencyConfig",
    "MismatchConfig",
    "ParallelConfig",
    "RLTrainerConfig",
    "SFTConfig",
    "SlurmConfig",
    "load_config",
    "load_toml",
    "merge_dicts",
    "parse_cli_overrides",
]

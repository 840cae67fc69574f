"""Typed, torch-free configuration shared by every process (see base.py for the file/CLI grammar)."""

from asyncrl.config.base import (
    BaseConfig,
    ConfigError,
    load_config,
    load_toml,
    merge_dicts,
    parse_cli_overrides,
)

__all__ = ["BaseConfig", "ConfigError", "load_config", "load_toml", "merge_dicts", "parse_cli_overrides"]

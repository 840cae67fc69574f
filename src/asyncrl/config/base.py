"""Typed, torch-free configuration: pydantic schemas, TOML files, `@ file` composition, dotted overrides.

Every process reads its config the same way::

    asyncrl trainer @ base.toml @ small.toml --optim.lr 3e-4 --max-steps 20

Files are merged left to right (tables merge key by key), then `--dotted.key value` overrides apply.
Values on the command line are parsed as TOML values (`3e-4`, `true`, `[1, 2]`,
`[{name = "calculator"}]`), then as JSON (`'[{"name": "calculator"}]'`), and fall back to plain
strings. Unknown keys are errors that name the key and the nearest valid name.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["BaseConfig", "ConfigError", "load_config", "merge_dicts", "parse_cli_overrides"]


class ConfigError(ValueError):
    """A user mistake in a config file or on the command line."""


class BaseConfig(BaseModel):
    """Base of every config section: unknown keys are rejected, fields are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


C = TypeVar("C", bound=BaseConfig)


def merge_dicts(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `override` into a copy of `base` (tables merge, everything else replaces)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = value
    return out


def _parse_value(text: str) -> Any:
    """TOML scalar/array/inline table first; then JSON (`'[{"name": "x"}]'`); else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"cannot parse {text!r} as a TOML or JSON value: {e}") from None
    return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.replace("-", "_").split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: '{part}' is a value, not a table")
        node = child
    node[parts[-1]] = value


def parse_cli_overrides(argv: list[str]) -> dict[str, Any]:
    """Turn `@ a.toml @ b.toml --x.y 1 --flag` into one merged dict (files first, then overrides)."""
    tree: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or arg.startswith("@"):
            path_text = arg[1:] if len(arg) > 1 else (argv[i + 1] if i + 1 < len(argv) else "")
            if not path_text:
                raise ConfigError("'@' must be followed by a TOML file path")
            tree = merge_dicts(tree, load_toml(Path(path_text)))
            i += 1 if len(arg) > 1 else 2
        elif arg.startswith("--"):
            key = arg[2:]
            if "=" in key:
                key, raw = key.split("=", 1)
                i += 1
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                raw = argv[i + 1]
                i += 2
            else:
                raw = "true"
                i += 1
            if not key:
                raise ConfigError(f"empty option name in {arg!r}")
            _set_dotted(overrides, key, _parse_value(raw))
        else:
            raise ConfigError(f"unexpected argument {arg!r}: use '@ FILE.toml' or '--dotted.key value'")
    return merge_dicts(tree, overrides)


def load_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e


def _nearest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _fields_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Valid field names of the (nested) model at `loc`, for "did you mean" hints."""
    model: Any = cls
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return list(model.model_fields)
        model = field.annotation
    return list(model.model_fields)


def format_validation_error(cls: type[BaseModel], err: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the dotted key (with `prefix`, e.g. 'orchestrator.')."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = prefix + ".".join(str(p) for p in loc)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            hint = _nearest(str(loc[-1]), _fields_at(cls, loc[:-1]))
            lines.append(f"unknown key '{key}'{hint}")
        elif loc:
            lines.append(f"'{key}': {msg}")
        else:
            lines.append(f"{prefix.rstrip('.') or cls.__name__}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(cls: type[C], argv: list[str] | dict[str, Any], prefix: str = "") -> C:
    """Build `cls` from CLI-style arguments or a plain dict, with errors that name the key.

    `prefix` is prepended to every key in error messages (a section of a larger config).
    """
    data = parse_cli_overrides(argv) if isinstance(argv, list) else argv
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(cls, e, prefix)) from None

"""Typed, torch-free configuration: pydantic schemas, TOML files, `@ file` composition, dotted overrides.

Every process reads its config the same way::

    asyncrl trainer @ base.toml @ small.toml --optim.lr 3e-4 --max-steps 20

Files are merged left to right (tables merge key by key), then `--dotted.key value` overrides apply.
Values on the command line are parsed as TOML values (`3e-4`, `true`, `[1, 2]`,
`[{name = "calculator"}]`), then as JSON (`'[{"name": "calculator"}]'`), and fall back to plain
strings. Unknown keys are errors that name the key and the nearest valid name.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import textwrap
import tomllib
import typing
from collections.abc import Collection
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = [
    "BaseConfig",
    "ConfigError",
    "config_help",
    "load_config",
    "merge_dicts",
    "parse_cli_overrides",
    "section_of",
]


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


def _variants(info: FieldInfo) -> dict[str, type[BaseModel]]:
    """tag -> config class of a discriminated-union field (empty for any other field)."""
    key = info.discriminator
    if not isinstance(key, str):
        return {}
    members = [m for m in typing.get_args(info.annotation) if _config_class(m)]
    return {typing.get_args(m.model_fields[key].annotation)[0]: m for m in members}


@dataclasses.dataclass(frozen=True)
class _Table:
    """Where an error location points, as the user writes it."""

    key: str  # dotted, union tags left out
    model: type[BaseModel] | None  # the config class there (None past a plain value)
    union_key: str = ""  # when it is one variant of a union: the key that picks it ("variant")
    variants: dict[str, type[BaseModel]] = dataclasses.field(default_factory=dict)  # and all of them, by tag


def _locate(cls: type[BaseModel], loc: tuple[Any, ...]) -> _Table:
    model: type[BaseModel] | None = cls
    union_key, variants, parts = "", {}, []
    rest = list(loc)
    while rest:
        part = rest.pop(0)
        parts.append(str(part))
        info = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        model, union_key, variants = None, "", {}
        if info is None:
            continue
        if (variants := _variants(info)) and rest and rest[0] in variants:
            model, union_key = variants[rest.pop(0)], str(info.discriminator)
        elif (item := _list_item_class(info.annotation)) and rest and isinstance(rest[0], int):
            parts.append(str(rest.pop(0)))
            model = item
        else:
            model = _config_class(info.annotation)
    return _Table(".".join(parts), model, union_key, variants)


def _unknown_key(cls: type[BaseModel], loc: tuple[Any, ...], prefix: str) -> str:
    """`unknown key 'a.b'` with the nearest valid name, or the variant the key belongs to."""
    table, name = _locate(cls, loc[:-1]), str(loc[-1])
    key = prefix + ".".join(p for p in (table.key, name) if p)
    if table.model is None:
        return f"unknown key '{key}'"
    owners = [repr(tag) for tag, m in table.variants.items() if name in m.model_fields]
    if owners:
        this = table.model.model_fields[table.union_key].default
        return (
            f"unknown key '{key}': it belongs to {table.union_key} = {' or '.join(owners)}, and this "
            f"table's {table.union_key} is {this!r}"
        )
    return f"unknown key '{key}'{_nearest(name, list(table.model.model_fields))}"


def format_validation_error(cls: type[BaseModel], err: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the dotted key (with `prefix`, e.g. 'orchestrator.')."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = prefix + _locate(cls, loc).key
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(_unknown_key(cls, loc, prefix))
        elif e["type"] == "union_tag_invalid":
            union_key = e["ctx"]["discriminator"].strip("'")
            tag, expected = e["ctx"]["tag"], e["ctx"]["expected_tags"]
            lines.append(f"'{key}.{union_key}': {tag!r} is not one of {expected}")
        elif loc:
            lines.append(f"'{key}': {msg}")
        else:
            lines.append(f"{prefix.rstrip('.') or cls.__name__}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def section_of(cls: type[BaseModel], exclude: Collection[str]) -> type[BaseConfig]:
    """The keys of `cls` less `exclude` (dotted for nested ones: "model.path"), as a class of their own.

    It is the table of a larger config that fills in the excluded keys itself: each key keeps its
    type, bounds, default and description, so a mistyped or unknown key fails as the table is read.
    Checks across keys stay with `cls`, which reads the table again once the excluded keys are known.
    """
    fields: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        if name in exclude:
            continue
        inner = [e.removeprefix(f"{name}.") for e in exclude if e.startswith(f"{name}.")]
        if inner:
            table = _config_class(info.annotation)
            assert table is not None, f"{cls.__name__}.{name} is not a table"
            section = section_of(table, inner)
            fields[name] = (section, Field(default_factory=section, description=info.description))
        else:
            fields[name] = (info.annotation, copy.copy(info))
    return create_model(
        f"{cls.__name__}Section",
        __base__=BaseConfig,
        __doc__=cls.__doc__,
        __module__=cls.__module__,
        **fields,
    )


def load_config(cls: type[C], argv: list[str] | dict[str, Any], prefix: str = "") -> C:
    """Build `cls` from CLI-style arguments or a plain dict, with errors that name the key.

    `prefix` is prepended to every key in error messages (a section of a larger config).
    """
    data = parse_cli_overrides(argv) if isinstance(argv, list) else argv
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(cls, e, prefix)) from None


def _jsonable(value: Any) -> Any:
    """A default as it would be written in TOML (sections show only their non-default keys)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return str(value) if isinstance(value, Path) else value


def _default_text(field: Any, value: Any) -> str:
    if value is PydanticUndefined:
        return "(required)"
    if value is None:
        return "= (unset)"
    try:
        return "= " + json.dumps(_jsonable(value))  # TOML-like: "text", true, [0.9, 0.999]
    except TypeError:
        return f"= {value!r}"


def _choices(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    inner = [_choices(a) for a in args]  # Literal[...] | None
    return next((c for c in inner if c), "")


def _config_class(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _list_item_class(annotation: Any) -> type[BaseModel] | None:
    args = typing.get_args(annotation)
    return _config_class(args[0]) if typing.get_origin(annotation) is list and args else None


def config_help(
    cls: type[BaseModel],
    section: str = "",
    exclude: Collection[str] = (),
    width: int = 110,
    defaults: BaseModel | None = None,
    about: str | None = None,
) -> str:
    """Every key of `cls` with its default and its Field description, one table per nested section.

    `section` is the dotted name the keys sit under (`"orchestrator"` prints `[orchestrator]`, then
    `[orchestrator.sampling]`, ...); `exclude` leaves out keys that are set elsewhere (dotted for
    nested ones: "model.path"); `defaults` is the instance whose values are shown (a section's own
    default, which may differ from its class's); `about` follows the section's title (default: the
    class docstring's first line). Example line:
    `  batch_size = 32            samples per batch (one trainer step)`.
    """
    rows: list[tuple[str, str]] = []
    nested: list[tuple[str, str]] = []
    for name, field in cls.model_fields.items():
        if name in exclude:
            continue
        if defaults is not None:
            value = getattr(defaults, name)
        else:
            value = PydanticUndefined if field.is_required() else field.get_default(call_default_factory=True)
        sub_section = f"{section}.{name}" if section else name
        if sub := _config_class(field.annotation):
            sub_defaults = value if isinstance(value, BaseModel) else None
            sub_exclude = [e.removeprefix(f"{name}.") for e in exclude if e.startswith(f"{name}.")]
            text = config_help(
                sub, sub_section, sub_exclude, width, defaults=sub_defaults, about=field.description
            )
            nested.append((sub_section, text))
            continue
        if _variants(field):
            nested.append((sub_section, _variants_help(field, sub_section, value, width)))
            continue
        if item := _list_item_class(field.annotation):
            item_help = config_help(item, sub_section, width=width).split("\n", 1)[1]
            nested.append((sub_section, f"[[{sub_section}]]  (a list; one table per item)\n{item_help}"))
        text = field.description or ""
        if choices := _choices(field.annotation):
            text = f"{text} (one of {choices})" if text else f"one of {choices}"
        rows.append((f"{name} {_default_text(field, value)}", text))
    about = about or (cls.__doc__ or "").strip().split("\n")[0]
    title = (f"[{section}]" if section else "(top level)") + (f"  {about}" if about else "")
    return "\n\n".join(["\n".join([title, *_table(rows, width)]), *(text for _, text in nested)])


def _variants_help(info: FieldInfo, section: str, value: Any, width: int) -> str:
    """A union's table: the key that picks the variant, then each variant's keys under its own title."""
    key, variants = str(info.discriminator), _variants(info)
    default = getattr(value, key, None)
    choices = " | ".join(json.dumps(tag) for tag in variants)
    row = (f"{key} = {json.dumps(default)}" if default else f"{key} (required)", f"one of {choices}")
    title = f"[{section}]  {info.description or ''}".rstrip()
    blocks = ["\n".join([title, *_table([row], width)])]
    for tag, member in variants.items():
        doc = (member.__doc__ or "").strip().split("\n")[0]
        shown = value if isinstance(value, member) else None
        about = f"{key} = {json.dumps(tag)}: {doc}"
        blocks.append(config_help(member, section, exclude=(key,), width=width, defaults=shown, about=about))
    return "\n\n".join(blocks)


def _table(rows: list[tuple[str, str]], width: int) -> list[str]:
    """`  key = default   description`, the description wrapped in its column."""
    key_width = min(34, max((len(k) for k, _ in rows), default=0))
    indent = " " * (key_width + 4)
    lines = []
    for key, text in rows:
        wrapped = textwrap.wrap(text, width=max(40, width - len(indent))) or [""]
        first = f"  {key:<{key_width}}  " if len(key) <= key_width else f"  {key}\n{indent}"
        lines.append((first + wrapped[0]).rstrip())
        lines += [indent + w for w in wrapped[1:]]
    return lines

"""Generic mapping of TOML tables onto frozen dataclasses, for the daemon's config.

Invariants: a value reaches a dataclass only converted to its field's type hint; a value given
as text (an environment variable or a command-line flag) is read as a TOML value unless the
field is textual (str, Path, TcpAddress, an Enum); an unknown key, a wrong type or a value
outside the field's ``range`` metadata raises ``ConfigError`` naming key, value, source and
expectation, and so does a value the dataclass's own checks refuse (its ConfigError's field is
renamed to the key the user wrote, ``section.prefix+field``). Which fields are keys, and under
which names, is declared by the dataclasses themselves (`config_keys`).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from clockwork_async.config.keys import (
    INTERNAL,
    PREFIX,
    RANGE,
    SECRET,
    internal,
    nested,
    ranged,
    secret,
)
from clockwork_async.core.config import ConfigError
from clockwork_async.wire.addresses import TcpAddress

# ConfigError and TcpAddress are defined where the lowest layer using them can import them;
# they are re-exported here for the config's users.
__all__ = [
    "ConfigError",
    "Raw",
    "TcpAddress",
    "build_section",
    "choices",
    "internal",
    "nested",
    "parse_toml_value",
    "ranged",
    "secret",
    "section_keys",
    "section_values",
]


@dataclass(frozen=True, slots=True)
class Raw:
    """A value before conversion, and where it came from (for error messages)."""

    value: Any
    source: str
    is_text: bool = False  # from an environment variable or a flag: read as a TOML value


def parse_toml_value(key: str, text: str, source: str) -> Any:
    """Read ``text`` as one TOML value (``10``, ``true``, ``[1, 2]``); raises ConfigError."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(key, text, "a TOML value (e.g. [1, 2] or true)", source) from None


def choices(items: Sequence[str]) -> str:
    return ", ".join(items)


FieldPath = tuple[str, ...]  # field names from the section's dataclass down to a value


def section_keys(cls: type[Any]) -> dict[str, FieldPath]:
    """The TOML keys of config dataclass ``cls`` (`config_keys`: every init field not
    `internal`, and the keys of each `nested` one under its prefix), each with the path of
    field names it sets."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, FieldPath] = {}
    for spec in dataclasses.fields(cls):
        if not spec.init or spec.metadata.get(INTERNAL):
            continue
        if PREFIX in spec.metadata:
            prefix = spec.metadata[PREFIX]
            prefix = f"{spec.name}_" if prefix is None else prefix
            inner = {
                prefix + key: (spec.name, *path)
                for key, path in section_keys(hints[spec.name]).items()
            }
        else:
            inner = {spec.name: (spec.name,)}
        clash = keys.keys() & inner.keys()
        if clash:  # a nested dataclass's key would hide another: a mistake in the code
            raise TypeError(f"{cls.__name__}: keys {sorted(clash)} are declared twice")
        keys.update(inner)
    return keys


def section_values(section: Any) -> dict[str, tuple[Any, bool]]:
    """Each key of a built section with its value and whether it is secret."""
    values = {}
    for key, path in section_keys(type(section)).items():
        owner = section
        for name in path[:-1]:
            owner = getattr(owner, name)
        spec = next(f for f in dataclasses.fields(owner) if f.name == path[-1])
        values[key] = (getattr(owner, path[-1]), bool(spec.metadata.get(SECRET)))
    return values


def build_section(cls: type[Any], section: str, raw: Mapping[str, Raw]) -> Any:
    """Build config dataclass ``cls`` (and those `nested` in it) from the raw values of its
    keys; an unknown key, a bad type or range, or a value the dataclass refuses raises
    ConfigError naming ``section.key``."""
    keys = section_keys(cls)
    values: dict[FieldPath, Any] = {}
    for key, item in raw.items():
        name = f"{section}.{key}"
        if key not in keys:
            raise ConfigError(name, item.value, f"a key of [{section}]: {choices(list(keys))}")
        spec, hint = _leaf(cls, keys[key])
        values[keys[key]] = _field_value(spec, hint, item, name)
    return _construct(cls, (), "", values, _Where(section, raw))


@dataclass(frozen=True, slots=True)
class _Where:
    section: str
    raw: Mapping[str, Raw]

    def error(self, key: str, error: ConfigError) -> ConfigError:
        """``error`` (raised by a dataclass about its field ``key``) named as the user wrote it."""
        item = self.raw.get(key)
        return ConfigError(
            f"{self.section}.{key}", error.value, error.expected, item.source if item else ""
        )


def _leaf(cls: type[Any], path: FieldPath) -> tuple[dataclasses.Field[Any], Any]:
    for name in path[:-1]:
        cls = typing.get_type_hints(cls)[name]
    spec = next(f for f in dataclasses.fields(cls) if f.name == path[-1])
    return spec, typing.get_type_hints(cls)[path[-1]]


def _construct(
    cls: type[Any], at: FieldPath, prefix: str, values: Mapping[FieldPath, Any], where: _Where
) -> Any:
    """``cls`` at ``at`` (whose keys start with ``prefix``), from the ``values`` under it; a
    `nested` dataclass no value reaches keeps its default."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for spec in dataclasses.fields(cls):
        path = (*at, spec.name)
        if path in values:
            kwargs[spec.name] = values[path]
        elif PREFIX in spec.metadata and any(p[: len(path)] == path for p in values):
            inner = spec.metadata[PREFIX]
            inner = f"{spec.name}_" if inner is None else inner
            kwargs[spec.name] = _construct(hints[spec.name], path, prefix + inner, values, where)
    try:
        return cls(**kwargs)
    except ConfigError as error:  # the dataclass's own checks, naming its field
        raise where.error(prefix + error.key, error) from None
    except TypeError as error:  # a required key is missing
        raise ConfigError(where.section, "", f"all required keys ({error})") from None
    except ValueError as error:  # a check that names no field
        raise ConfigError(where.section, kwargs, f"a valid combination ({error})") from None


def _field_value(spec: dataclasses.Field[Any], hint: Any, item: Raw, key: str) -> Any:
    try:
        value = _coerce(item.value, hint, key, item.source, item.is_text)
        _check_range(spec, value, key, item.source)
    except ConfigError as error:
        if spec.metadata.get(SECRET):
            raise ConfigError(key, "<redacted>", error.expected, error.source) from None
        raise
    return value


def _coerce(value: Any, hint: Any, key: str, source: str, is_text: bool) -> Any:
    """Convert a TOML value (or an env/flag text) to ``hint``; raises ConfigError."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if value == "" or value is None:
            return None
        return _coerce(value, options[0], key, source, is_text)
    if is_text and not _is_textual(hint):
        value = parse_toml_value(key, value, source)
    try:
        return _convert(value, hint)
    except (TypeError, ValueError) as error:
        raise ConfigError(key, value, str(error) or _type_name(hint), source) from None


def _is_textual(hint: Any) -> bool:
    return hint in (str, Path, TcpAddress) or (isinstance(hint, type) and issubclass(hint, Enum))


def _convert(value: Any, hint: Any) -> Any:
    if typing.get_origin(hint) is tuple:
        item_hint = typing.get_args(hint)[0]
        if not isinstance(value, list):
            raise TypeError(f"an array of {_type_name(item_hint)}")
        return tuple(_convert(item, item_hint) for item in value)
    if hint is bool or hint is str:
        if not isinstance(value, hint):
            raise TypeError(_type_name(hint))
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError("a number")
        return float(value)
    if hint in (Path, TcpAddress) and isinstance(value, hint):
        return value
    if not isinstance(value, str):
        raise TypeError(_type_name(hint))
    return _convert_text(value, hint)


def _convert_text(text: str, hint: Any) -> Any:
    if hint is Path:
        path = Path(text).expanduser()
        if not path.is_absolute():
            raise ValueError("an absolute path")
        return path
    if hint is TcpAddress:
        return TcpAddress.parse(text)
    if isinstance(hint, type) and issubclass(hint, Enum):
        allowed = [str(member.value) for member in hint]
        if text not in allowed:
            raise ValueError(f"one of {choices(allowed)}")
        return hint(text)
    raise TypeError(f"a type the config cannot express ({_type_name(hint)})")


def _type_name(hint: Any) -> str:
    names = {bool: "true or false", str: "a string", int: "an integer", float: "a number"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _check_range(spec: dataclasses.Field[Any], value: Any, key: str, source: str) -> None:
    lo, hi = spec.metadata.get(RANGE, (None, None))
    if lo is not None and value < lo:
        raise ConfigError(key, value, f"at least {lo}", source)
    if hi is not None and value > hi:
        raise ConfigError(key, value, f"at most {hi}", source)


def plain_section(section: Any) -> dict[str, Any]:
    """A section as plain data (as a file would set it), every set secret ``"<redacted>"``."""
    return {
        key: "<redacted>" if is_secret and value else _plain(value)
        for key, (value, is_secret) in section_values(section).items()
    }


def _plain(value: Any) -> Any:
    if isinstance(value, Path | TcpAddress):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    if isinstance(value, Enum):
        return value.value
    return value

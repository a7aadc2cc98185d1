"""Generic mapping of TOML tables onto frozen dataclasses, for the daemon's config.

Invariants: a value reaches a dataclass only converted to its field's type hint; a value given
as text (an environment variable or a command-line flag) is read as a TOML value unless the
field is textual (str, Path, TcpAddress, an Enum); an unknown key, a wrong type or a value
outside the field's ``range`` metadata raises ``ConfigError`` naming key, value, source and
expectation.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from clockwork_async.connection import TcpAddress
from clockwork_async.core.config import ConfigError

# ConfigError and TcpAddress are defined where the lowest layer using them can import them;
# they are re-exported here for the config's users.
__all__ = [
    "ConfigError",
    "Raw",
    "TcpAddress",
    "build_section",
    "choices",
    "parse_toml_value",
    "ranged",
    "secret",
]


def ranged(default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    """A dataclass field with an inclusive numeric range checked by the loader."""
    return field(default=default, metadata={"range": (lo, hi)})


def secret(default: str = "") -> Any:
    """A string field that is never printed (repr, errors, ``redacted``)."""
    return field(default=default, metadata={"secret": True}, repr=False)


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


def build_section(cls: type[Any], section: str, raw: Mapping[str, Raw]) -> Any:
    """Build dataclass ``cls`` from raw values; unknown keys, bad types and ranges raise."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values = {}
    for key, item in raw.items():
        name = f"{section}.{key}"
        if key not in fields:
            raise ConfigError(name, item.value, f"a key of [{section}]: {choices(list(fields))}")
        values[key] = _field_value(fields[key], hints[key], item, name)
    try:
        return cls(**values)
    except TypeError as error:  # a required key is missing
        raise ConfigError(section, "", f"all required keys ({error})") from None
    except ValueError as error:  # the section's own __post_init__ validation
        raise ConfigError(section, values, f"a valid combination ({error})") from None


def _field_value(spec: dataclasses.Field[Any], hint: Any, item: Raw, key: str) -> Any:
    try:
        value = _coerce(item.value, hint, key, item.source, item.is_text)
        _check_range(spec, value, key, item.source)
    except ConfigError as error:
        if spec.metadata.get("secret"):
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
    lo, hi = spec.metadata.get("range", (None, None))
    if lo is not None and value < lo:
        raise ConfigError(key, value, f"at least {lo}", source)
    if hi is not None and value > hi:
        raise ConfigError(key, value, f"at most {hi}", source)

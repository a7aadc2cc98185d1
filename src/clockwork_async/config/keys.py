"""How a config dataclass declares its TOML keys: field metadata only, no parsing and no I/O.

The daemon's config sections are the dataclasses their parts use (`ServerLimits`, `LinkConfig`,
`ProfilerConfig`, `ControllerConfig` ...), so those parts declare here what the loader
(`config_fields`) may accept, beside the one default of each field:

- every init field is a key of its section, named as the field;
- `ranged` adds the inclusive range a user may configure (the dataclass's own checks may be
  looser: code and tests may go beyond it);
- `secret` keeps a value out of repr, errors and logs;
- `internal` makes a field no key (set in code only);
- `nested` makes a field whose type is a config dataclass contribute that dataclass's keys
  to the same section, each named ``prefix + key`` (default prefix: the field's name and
  ``_``), so one TOML table can fill a dataclass and the dataclasses inside it.

Pure: importable from any layer above the core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any

RANGE = "range"
SECRET = "secret"
INTERNAL = "internal"
PREFIX = "prefix"


def ranged(default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    """A key with an inclusive numeric range checked by the loader."""
    return field(default=default, metadata={RANGE: (lo, hi)})


def secret(default: str = "") -> Any:
    """A string key that is never printed (repr, errors, ``redacted``)."""
    return field(default=default, metadata={SECRET: True}, repr=False)


def internal(default: Any) -> Any:
    """A field that is no config key: set in code only."""
    return field(default=default, metadata={INTERNAL: True})


def nested(factory: Callable[[], Any], prefix: str | None = None) -> Any:
    """A field holding another config dataclass, whose keys join this section as
    ``prefix + key`` (None: the field's name and ``_``; "": the keys as they are)."""
    return field(default_factory=factory, metadata={PREFIX: prefix})

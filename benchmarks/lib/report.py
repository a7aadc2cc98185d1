"""Where and how benchmarks write what they found: one JSON file per run under ``results/``,
plain text tables on stdout, daemon logs kept beside the JSON, PNGs copied into docs/img.

Invariant: a report is written whole or not at all by the caller's last step; nothing here
drops a key of the report it is given (``default=str`` writes what JSON cannot hold).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path("results")
DOCS_IMG = Path("docs/img")


def write_report(name: str, report: Mapping[str, Any], directory: Path = RESULTS) -> Path:
    """Write ``report`` as ``directory/name.json``; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def write_json(name: str, quick: bool, result: Mapping[str, Any], directory: Path) -> Path:
    """``directory/NAME[-quick].json``."""
    return write_report(f"{name}-quick" if quick else name, result, directory)


def keep_log(source: Path, target: Path) -> None:
    """Copy a daemon's log out of its temporary folder (if it wrote one)."""
    if source.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def copy_to_docs(paths: Iterable[Path], prefix: str, directory: Path = DOCS_IMG) -> list[Path]:
    """Copy PNGs into docs/img as ``PREFIX-<name>``; returns the copies."""
    directory.mkdir(parents=True, exist_ok=True)
    copies = []
    for path in paths:
        target = directory / f"{prefix}-{path.name}"
        shutil.copyfile(path, target)
        copies.append(target)
    return copies


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        first = row[0].ljust(widths[0])
        rest = [value.rjust(width) for value, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join([first, *rest]))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def percent(value: float | None, digits: int = 4) -> str:
    """A share as a percentage with ``digits`` decimals, ``-`` when unknown."""
    return "-" if value is None else f"{100 * value:.{digits}f}"


def rejected_text(rejected: Mapping[str, int]) -> str:
    """``reason count, ...`` of rejections, ``-`` when there are none."""
    return ", ".join(f"{reason} {count}" for reason, count in sorted(rejected.items())) or "-"

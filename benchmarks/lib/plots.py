"""Plots of the benchmarks, on matplotlib's Agg backend.

Invariant: matplotlib is optional. `pyplot` returns None, after one line on stderr, when it is
missing, and every plotting function of a benchmark then returns None instead of a path: the
run's JSON and printed summary never depend on a plot.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Series = dict[str, list[float]]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a note) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return None
    return plt


def save(plt: Any, fig: Any, path: Path, dpi: int = 100) -> Path:
    """Lay out, write ``fig`` as ``path`` (creating its folder) and close it; returns ``path``."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_panels(
    plt: Any,
    series: Series,
    panels: Sequence[tuple[str, Sequence[str]]],
    title: str,
    path: Path,
    *,
    slo_ms: float | None = None,
    xlabel: str = "simulated time (s)",
) -> Path:
    """One panel per ``(ylabel, keys)``, stacked, sharing the time axis ``series["time_s"]``.
    A panel whose keys all end in ``_ms`` gets the SLO line."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    axes = list(axes) if len(panels) > 1 else [axes]
    for ax, (ylabel, keys) in zip(axes, panels, strict=True):
        for key in keys:
            if key in series:
                ax.plot(series["time_s"], series[key], label=key, linewidth=1)
        if slo_ms is not None and all(key.endswith("_ms") for key in keys):
            ax.axhline(slo_ms, color="red", linestyle="--", linewidth=1, label="SLO")
        ax.set_ylabel(ylabel)
        ax.legend(loc="upper left", fontsize="small")
    axes[0].set_title(title)
    axes[-1].set_xlabel(xlabel)
    return save(plt, fig, path)

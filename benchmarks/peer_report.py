"""Tables, goals and plots of `benchmarks.peer_ray`'s result (a pure function of its JSON, so
a saved result can be re-reported: ``python -m benchmarks.peer_report results/X.json``).

Columns: ``ok/s`` = successes by the server's own verdict (our daemon's ``ok``; Ray's HTTP
200, or a handle result before the cancel at the SLO); ``in SLO/s`` and ``in SLO %`` = those
the client received within the SLO (the goodput the issue asks for; the client's clock for
every system); latency percentiles over every ``ok``; ``ok after SLO`` = ok minus in SLO;
``marked late`` = replies our daemon marked ``late`` (Ray marks none: ``-``); ``lag p99 ms``
= the generator's send lag, followed by ``behind`` where over 1% of its requests left later
than the lag budget (`clockwork_async.bench.send_verdict`): that run measured the generator's
bursts too, and its goal check says so (``generator_behind``).

Ratios are ``ours / this system`` at the same point (same SLO, same arrivals), ``ours`` being
the ``clockwork`` policy: in-SLO ratios above 1 and p50 ratios below 1 favour ours. A ratio
against 0 is written ``inf``; without a value on either side, ``-``. The goals also compare
``clockwork-v2http`` (the same daemon through its Open Inference Protocol HTTP front end)
with ``ray-http`` (the same HTTP client and request bytes) at the light fixed rates: p50
``p50_http_light_rates``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib import pyplot, save, table

OURS = "clockwork"
OURS_HTTP = "clockwork-v2http"  # our daemon through its v2 HTTP front end
RAY = ("ray-http", "ray-handle")
GOAL_CAPACITY_SHARE = 0.95
GOAL_GOODPUT_RATIO = 5.0
GOAL_P50_RATIO = 0.25
GOAL_MAX_SLO_MULTIPLE = 10.0


def rows_of(result: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for found in result["systems"].values():
        yield from found.get("rows") or []


def by_point(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """point label -> system -> row."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows_of(result):
        found.setdefault(row["point"], {})[row["system"]] = row
    return found


def ratio(ours: float | None, theirs: float | None) -> float | str | None:
    """ours / theirs (3 significant digits); ``inf`` when only theirs is 0; None if unknown."""
    if ours is None or theirs is None:
        return None
    if theirs == 0:
        return "inf" if ours > 0 else None
    return float(f"{ours / theirs:.3g}")


def ratios(ours: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    return {
        "in_slo": ratio(ours["in_slo_rps"], row["in_slo_rps"]),
        "p50": ratio(ours["latency_ms"]["p50"], row["latency_ms"]["p50"]),
    }


# --- goals ---------------------------------------------------------------------------------------


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, checked point by point."""
    b1_ms = result["b1_ms"]
    overload, p50s, after, http_p50s = [], [], [], []
    for label, systems in by_point(result).items():
        http, ray_http = systems.get(OURS_HTTP), systems.get("ray-http")
        if http is not None and ray_http is not None and http["load"] is None:
            value = ratio(http["latency_ms"]["p50"], ray_http["latency_ms"]["p50"])
            http_p50s.append({"point": label, "ours_http_over_ray_http": value})
        ours = systems.get(OURS)
        if ours is None:
            continue
        peers = {s: systems[s] for s in RAY if s in systems}
        # SLOs are rounded to the µs (`peer_ray.slos`): 10x a b1 of 7.827166 ms is 78.272
        if ours["load"] == 2.0 and ours["slo_ms"] <= GOAL_MAX_SLO_MULTIPLE * b1_ms + 1e-3:
            overload.append(_overload(result, label, ours, list(peers.values())))
        for system, row in peers.items():
            value = ratio(ours["latency_ms"]["p50"], row["latency_ms"]["p50"])
            if value is not None:
                p50s.append({"point": label, "peer": system, "ours_over_peer": value})
        after.append(ours["ok_after_slo_client"])
    return {
        "overload_2x_tight_slo": overload,
        "p50_ours_over_ray": p50s,
        "p50_met": all(
            isinstance(p["ours_over_peer"], float) and p["ours_over_peer"] <= GOAL_P50_RATIO
            for p in p50s
        )
        if p50s
        else None,
        "p50_http_light_rates": http_p50s,
        "p50_http_met": all(
            isinstance(p["ours_http_over_ray_http"], float)
            and p["ours_http_over_ray_http"] <= GOAL_P50_RATIO
            for p in http_p50s
        )
        if http_p50s
        else None,
        "ours_ok_after_slo_client": sum(after),
        "ours_marked_late": sum(r["marked_late"] for r in rows_of(result) if r["system"] == OURS),
    }


def _overload(
    result: dict[str, Any], label: str, ours: dict[str, Any], peers: list[dict[str, Any]]
) -> dict[str, Any]:
    """The 2x-overload goal at one point, on the client's clock (``in_slo``) and on each
    server's own verdict (``ok``)."""
    capacity = result["capacity"]["rps"]
    found: dict[str, Any] = {"point": label}
    for key in ("in_slo", "ok"):
        mine = ours[f"{key}_rps"]
        best = max((r[f"{key}_rps"] for r in peers), default=None)
        over = ratio(mine, best)
        found[key] = {
            "ours_rps": mine,
            "of_capacity": round(mine / capacity, 3),
            "best_ray_rps": best,
            "over_best_ray": over,
            "met": mine >= GOAL_CAPACITY_SHARE * capacity and _at_least(over, GOAL_GOODPUT_RATIO),
        }
    found["in_slo"]["of_rule_capacity_at_slo"] = _rule_share(result, ours)
    found["generator_behind"] = ours.get("generator_behind")
    return found


def _rule_share(result: dict[str, Any], row: dict[str, Any]) -> float | None:
    rule = result.get("rule_capacity_by_slo", {}).get(row["slo_label"])
    return round(row["in_slo_rps"] / rule, 3) if rule else None


def _at_least(value: float | str | None, bound: float) -> bool:
    return value == "inf" or (isinstance(value, float) and value >= bound)


# --- tables --------------------------------------------------------------------------------------

HEADERS = (
    "point",
    "system",
    "offered/s",
    "requests",
    "ok/s",
    "in SLO/s",
    "in SLO %",
    "p50 ms",
    "p99 ms",
    "p99.9 ms",
    "max ms",
    "ok after SLO",
    "marked late",
    "lag p99 ms",
    "in SLO ours/x",
    "p50 ours/x",
)


def table_rows(result: dict[str, Any], slo_label: str) -> list[list[Any]]:
    """One row per system and point at ``slo_label``; ratios against the result's
    ``reference`` system (``clockwork`` unless it names another)."""
    reference = result.get("reference", OURS)
    rows = []
    for label, systems in by_point(result).items():
        ours = systems.get(reference)
        for name, row in systems.items():
            if row["slo_label"] != slo_label:
                continue
            versus = ratios(ours, row) if ours is not None and name != reference else {}
            latency = row["latency_ms"]
            share = row["in_slo_share"]
            rows.append(
                [
                    label.split(", ", 1)[1],
                    name,
                    row["offered_rps"],
                    row["requests"],
                    row["ok_rps"],
                    row["in_slo_rps"],
                    None if share is None else round(100 * share, 2),
                    latency["p50"],
                    latency["p99"],
                    latency["p99.9"],
                    latency["max"],
                    row["ok_after_slo_client"],
                    row["marked_late"],
                    lag_cell(row),
                    versus.get("in_slo"),
                    versus.get("p50"),
                ]
            )
    return rows


def lag_cell(row: dict[str, Any]) -> float | str | None:
    """The send lag p99, marked ``behind`` when the generator fell behind its schedule."""
    lag = row["send_lag_p99_ms"]
    return f"{lag} behind" if row.get("generator_behind") else lag


def behind_runs(result: dict[str, Any]) -> list[str]:
    """``system at point`` of every run whose generator fell behind its schedule."""
    return [f"{r['system']} at {r['point']}" for r in rows_of(result) if r.get("generator_behind")]


def slo_labels(result: dict[str, Any]) -> list[str]:
    seen: dict[str, float] = {}
    for row in rows_of(result):
        seen[row["slo_label"]] = row["slo_ms"]
    return sorted(seen, key=seen.__getitem__)


def _slo_title(result: dict[str, Any], label: str) -> str:
    slo_ms = next(r["slo_ms"] for r in rows_of(result) if r["slo_label"] == label)
    return f"SLO {label} = {slo_ms:g} ms"


def print_tables(result: dict[str, Any]) -> None:
    capacity = result["capacity"]
    print(f"model {result['model']['name']}, b1 {result['b1_ms']:.3f} ms (registration profile)")
    print(f"capacity {capacity['rps']} req/s ({capacity['how']})")
    ray = result.get("ray", {})
    if "config" in ray:
        print(f"Ray Serve configuration: {ray['config']} (tuning over HTTP, see the JSON)")
    for system, found in result["systems"].items():
        if "not_run" in found:
            print(f"{system}: not run: {found['not_run']}")
    for label in slo_labels(result):
        print(f"\n{_slo_title(result, label)}")
        print(table(HEADERS, table_rows(result, label)))
    print(f"\narrivals identical across systems: {result['arrivals_identical']}")
    if behind := behind_runs(result):
        print(f"generator behind its schedule (the daemon saw bursts): {', '.join(behind)}")
    print(json.dumps(result["goals"], indent=2))


def _md_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The tables (one per SLO) and the Ray tuning table, in Markdown."""
    parts = [
        f"{system}: not run: {found['not_run']}\n\n"
        for system, found in result["systems"].items()
        if "not_run" in found
    ]
    if behind := behind_runs(result):
        parts.append(f"Generator behind its schedule (lag p99 marked): {', '.join(behind)}\n\n")
    for label in slo_labels(result):
        parts.append(f"**{_slo_title(result, label)}**\n\n")
        parts.append(markdown_table(HEADERS, table_rows(result, label)) + "\n\n")
    tuning = result.get("ray", {}).get("tuning") or []
    if tuning:
        headers = ["execute", "max batch", "wait ms", "in SLO/s", "in SLO %", "p50 ms", "p99 ms"]
        headers += ["batches by size"]
        rows = [
            [
                t["config"]["execute"],
                t["config"]["max_batch_size"],
                t["config"]["batch_wait_timeout_s"] * 1000,
                t["row"]["in_slo_rps"],
                round(100 * (t["row"]["in_slo_share"] or 0), 2),
                t["row"]["latency_ms"]["p50"],
                t["row"]["latency_ms"]["p99"],
                " ".join(f"{b}:{n}" for b, n in t["row"]["replica"]["batch_sizes"].items()),
            ]
            for t in tuning
        ]
        parts.append("**Ray Serve tuning (HTTP)**\n\n" + markdown_table(headers, rows) + "\n")
    return "".join(parts)


# --- plots ---------------------------------------------------------------------------------------


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    """Goodput and ok latency vs offered load at the 10x b1 SLO; goodput and in-SLO share vs
    SLO at 200% load. None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    tight = next((label for label in slo_labels(result) if label.startswith("10x")), None)
    for system, found in result["systems"].items():
        rows = found.get("rows") or []
        sweep = sorted((r for r in rows if r["slo_label"] == tight), key=lambda r: r["target_rps"])
        offered = [r["offered_rps"] for r in sweep]
        axes[0][0].plot(offered, [r["in_slo_rps"] for r in sweep], "o-", label=system)
        (line,) = axes[0][1].plot(
            offered, [_ms(r, "p50") for r in sweep], "o-", label=f"{system} p50"
        )
        axes[0][1].plot(offered, [_ms(r, "p99") for r in sweep], "x--", color=line.get_color())
        overload = sorted((r for r in rows if r["load"] == 2.0), key=lambda r: r["slo_ms"])
        slo = [r["slo_ms"] for r in overload]
        axes[1][0].plot(slo, [r["in_slo_rps"] for r in overload], "o-", label=system)
        axes[1][1].plot(slo, [100 * (r["in_slo_share"] or 0) for r in overload], "o-", label=system)
    capacity = result["capacity"]["rps"]
    axes[0][0].axhline(capacity, color="gray", linestyle="--", label="our capacity")
    axes[0][0].set(xlabel="offered req/s", ylabel="replies in SLO /s", title=f"SLO {tight}")
    axes[0][1].set(xlabel="offered req/s", ylabel="ms (o p50, x p99)", yscale="log")
    axes[0][1].set_title(f"latency of ok replies (client), SLO {tight}")
    axes[1][0].set(xlabel="SLO ms", ylabel="replies in SLO /s", xscale="log", title="200% load")
    axes[1][1].set(xlabel="SLO ms", ylabel="% within SLO", xscale="log", title="200% load")
    for ax in (axes[0][0], axes[0][1], axes[1][0], axes[1][1]):
        ax.legend(fontsize=7)
    return save(plt, fig, path)


def _ms(row: dict[str, Any], key: str) -> float:
    value = row["latency_ms"][key]
    return float("nan") if value is None else value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peer_report",
        description="Re-report saved peer_ray or peer_mlserver results: tables printed, "
        "Markdown and plot written beside each.",
    )
    parser.add_argument("results", nargs="*", type=Path, help="results/peer_ray[-quick].json")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Re-report a saved result: tables printed, Markdown and plot written beside it."""
    for path in build_parser().parse_args(argv).results:
        result = json.loads(path.read_text())
        extra = ""
        if result.get("benchmark") == "peer_mlserver":  # its own goals and tuning table
            from benchmarks import peer_mlserver

            result["goals"] = peer_mlserver.goals(result)
            extra = peer_mlserver.tuning_markdown(result)
        else:
            result["goals"] = goals(result)
        print_tables(result)
        path.with_suffix(".md").write_text(markdown(result) + extra)
        write_plot(result, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

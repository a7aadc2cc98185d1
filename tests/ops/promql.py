"""A small, honest reader of PromQL: which series an expression selects and which labels it
groups by. It is not an evaluator and not a full parser; it knows enough of the grammar to
tell metric names from functions, aggregations and keywords, and to read label matchers,
grouping clauses and Grafana variables (``$group``, ``${datasource}``, ``$__rate_interval``).

Invariants: every identifier in an expression is either a metric name (returned as a
`Selector`), a function or aggregation (followed by ``(``, or an aggregation followed by
``by``/``without``), a keyword, or a label name inside ``{...}`` or a grouping clause; a
construct it does not know (a selector without a metric name, an unknown token) raises
`PromQLError` rather than being skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    }
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})
# Labels Prometheus attaches to every scraped series (target labels), beside `__name__`.
TARGET_LABELS = frozenset({"job", "instance"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<variable>\$\{\w+\}|\$\w+)
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=])
  | (?P<punct>[{}()\[\],:@])
    """,
    re.VERBOSE,
)


class PromQLError(ValueError):
    """An expression this reader does not understand."""


@dataclass(frozen=True, slots=True)
class Matcher:
    label: str
    op: str  # =, !=, =~, !~
    value: str  # unquoted

    @property
    def literal_values(self) -> tuple[str, ...] | None:
        """The values this matcher names, when it names them plainly (``a``, ``a|b|c``);
        None for a real regex or a Grafana variable."""
        if "$" in self.value:
            return None
        if self.op in ("=", "!="):
            return (self.value,)
        if re.fullmatch(r"[\w.-]+(?:\|[\w.-]+)*", self.value):
            return tuple(self.value.split("|"))
        return None


@dataclass(frozen=True, slots=True)
class Selector:
    metric: str
    matchers: tuple[Matcher, ...] = ()


@dataclass(frozen=True, slots=True)
class Uses:
    """What one expression refers to."""

    selectors: tuple[Selector, ...]
    grouping_labels: frozenset[str]  # labels of by / without / on / ignoring / group_x clauses


def tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) of each token, spaces left out. Raises PromQLError at an unknown character."""
    found: list[tuple[str, str]] = []
    at = 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise PromQLError(f"cannot read {expr[at : at + 20]!r} in {expr!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            found.append((kind, match.group()))
        at = match.end()
    return found


def uses(expr: str) -> Uses:
    """The selectors and grouping labels of ``expr``. Raises PromQLError."""
    items = tokens(expr)
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(items):
        kind, text = items[i]
        after = items[i + 1][1] if i + 1 < len(items) else ""
        if kind == "punct" and text == "[":
            i = _skip_past(items, i, "]")
        elif kind == "punct" and text == "{":
            raise PromQLError(f"a selector without a metric name in {expr!r}")
        elif kind != "ident":
            i += 1
        elif text in GROUPING:
            i = _grouping(items, i + 1, grouping) if after == "(" else i + 1
        elif text in KEYWORDS or after == "(" or (text in AGGREGATIONS and after in GROUPING):
            i += 1
        else:
            i = _selector(items, i, selectors)
    return Uses(tuple(selectors), frozenset(grouping))


def _skip_past(items: list[tuple[str, str]], i: int, closing: str) -> int:
    while i < len(items) and items[i][1] != closing:
        i += 1
    if i == len(items):
        raise PromQLError(f"no {closing!r}")
    return i + 1


def _grouping(items: list[tuple[str, str]], i: int, into: set[str]) -> int:
    """Read ``( label, ... )`` starting at the ``(``; returns the index after ``)``."""
    i += 1
    while items[i][1] != ")":
        kind, text = items[i]
        if kind == "ident":
            into.add(text)
        elif text != ",":
            raise PromQLError(f"unexpected {text!r} in a grouping clause")
        i += 1
    return i + 1


def _selector(items: list[tuple[str, str]], i: int, into: list[Selector]) -> int:
    """Read ``metric`` or ``metric{matchers}`` at ``i``; returns the index after it."""
    metric = items[i][1]
    i += 1
    matchers: list[Matcher] = []
    if i < len(items) and items[i][1] == "{":
        i += 1
        while items[i][1] != "}":
            (label_kind, label), (_, op), (value_kind, value) = items[i : i + 3]
            if label_kind != "ident" or op not in ("=", "!=", "=~", "!~") or value_kind != "string":
                raise PromQLError(f"cannot read the matcher after {metric!r}")
            matchers.append(Matcher(label, op, value[1:-1]))
            i += 3
            if items[i][1] == ",":
                i += 1
        i += 1
    into.append(Selector(metric, tuple(matchers)))
    return i


def is_recording_rule_name(metric: str) -> bool:
    """Recording rules are named level:metric:operations; scraped names have no colon."""
    return ":" in metric


def level_labels(rule_name: str) -> frozenset[str]:
    """The labels a recording rule keeps, from its level (``job_group:...`` -> job, group)."""
    return frozenset(rule_name.split(":")[0].split("_"))

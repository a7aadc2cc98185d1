"""Declared dynamic axes: the lengths each non-batch dynamic axis of a model's inputs takes,
from ``[inputs.NAME.axes]`` in model.toml (docs/configuration.md, "Dynamic axes"). Pure:
parsed tables in, checked declarations and servable input shapes out.

Invariants: every dynamic axis of every input, except a dynamic axis 0 (the batch), is declared
or the model is refused, with an error naming the input, the axis and the key to set; a
declaration's buckets are distinct, ascending and inside ``[min, max]``; the input shapes that
`resolve_axes` returns have no dynamic axis but axis 0, so a model is profiled and served at
shapes a request can actually have.

Buckets: an axis declared with several lengths (or a model that pads, ``pad = true``) is
served by buckets (`ShapePlan`, core/buckets.py): axes of several inputs with the same name in
the file are one *dimension* (ONNX: one length), declared alike; an axis keyed by its index is a
dimension of its own, named ``INPUT.INDEX``. ``[outputs.NAME.axes] KEY = "DIMENSION"`` says an
output's axis has a dimension's length, so a padded request's output is cut back to its own.
``ModelInfo.inputs`` hold the largest bucket's lengths (what a single length serves, as before).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from clockwork_async.wire.messages import TensorSpec

MAX_AXIS_LENGTH = 1 << 24  # a sanity bound on a declared length (16 Mi elements)
DOCS = 'docs/configuration.md, "Dynamic axes"'


class AxisError(ValueError):
    """A declaration that cannot be served; the message names the input, axis and key."""


@dataclass(frozen=True, slots=True)
class AxisDeclaration:
    """What model.toml says one dynamic axis of an input takes."""

    input: str
    axis: int  # its index in the input's shape (>= 1)
    key: str  # its key under [inputs.INPUT.axes]: the file's dim name, else the index
    min_length: int
    max_length: int
    buckets: tuple[int, ...]  # ascending; the lengths a request is served at

    @property
    def serving_length(self) -> int:
        """The length ``ModelInfo.inputs`` hold: the largest bucket."""
        return self.buckets[-1]

    @property
    def dimension(self) -> str:
        """The dimension it belongs to: its name in the file (shared by every input with an
        axis of that name), or ``INPUT.INDEX`` for an axis without one."""
        return f"{self.input}.{self.key}" if self.key.isdigit() else self.key


@dataclass(frozen=True, slots=True)
class Dimension:
    """One length a request has, at one or more (input, axis) places."""

    name: str
    lengths: tuple[int, ...]  # ascending: its buckets
    places: tuple[tuple[str, int], ...]  # (input, axis index)
    min_length: int = 1  # shorter requests are refused, even where padding would fit them


@dataclass(frozen=True, slots=True)
class OutputAxis:
    """An output axis whose length is a dimension's: cut back to a padded request's own."""

    output: str
    axis: int
    dimension: int  # index into ShapePlan.dimensions


@dataclass(frozen=True, slots=True)
class ShapePlan:
    """How a model with declared axes is served by buckets (core/buckets.py)."""

    dimensions: tuple[Dimension, ...]
    pad: bool = False  # pad a request up to its bucket (the model masks padding)
    output_axes: tuple[OutputAxis, ...] = ()

    @property
    def bucketed(self) -> bool:
        """Whether it is served as one variant per bucket: several lengths, or padding."""
        return self.pad or any(len(d.lengths) > 1 for d in self.dimensions)

    def inputs_at(
        self, specs: Sequence[TensorSpec], bucket: Sequence[int]
    ) -> tuple[TensorSpec, ...]:
        """``specs`` with every declared axis at ``bucket``'s length of its dimension."""
        lengths = {
            place: length
            for dimension, length in zip(self.dimensions, bucket, strict=True)
            for place in dimension.places
        }
        return tuple(
            TensorSpec(
                spec.name,
                spec.dtype,
                tuple(lengths.get((spec.name, axis), d) for axis, d in enumerate(spec.shape)),
            )
            for spec in specs
        )


def shape_plan(
    model: str,
    declarations: Sequence[AxisDeclaration],
    pad: bool,
    outputs: Sequence[TensorSpec],
    output_keys: Mapping[str, Mapping[int, str]],
    declared_outputs: Mapping[str, Any],
) -> ShapePlan | None:
    """The plan of a model's declared axes (None when it declares none), with the output
    axes ``[outputs.NAME.axes]`` ties to dimensions. Raises AxisError."""
    if not declarations:
        if pad or declared_outputs:
            raise AxisError(
                f"model {model!r}: pad and [outputs.NAME.axes] need declared input axes ({DOCS})"
            )
        return None
    dimensions: dict[str, Dimension] = {}
    for declaration in declarations:
        name = declaration.dimension
        found = dimensions.get(name)
        place = (declaration.input, declaration.axis)
        if found is None:
            dimensions[name] = Dimension(
                name, declaration.buckets, (place,), declaration.min_length
            )
        elif (found.lengths, found.min_length) != (declaration.buckets, declaration.min_length):
            raise AxisError(
                f"model {model!r}: axis {name!r} of input {declaration.input!r} is declared "
                f"{list(declaration.buckets)} (min {declaration.min_length}), another input's "
                f"{list(found.lengths)} (min {found.min_length}): an axis name is one length, "
                "declare it alike"
            )
        else:
            dimensions[name] = replace(found, places=(*found.places, place))
    order = list(dimensions)
    axes = _output_axes(model, order, outputs, output_keys, declared_outputs)
    return ShapePlan(tuple(dimensions.values()), pad, axes)


def _output_axes(
    model: str,
    dimensions: Sequence[str],
    outputs: Sequence[TensorSpec],
    output_keys: Mapping[str, Mapping[int, str]],
    declared: Mapping[str, Any],
) -> tuple[OutputAxis, ...]:
    names = {spec.name for spec in outputs}
    found: list[OutputAxis] = []
    for output, table in declared.items():
        where = f"model {model!r}: [outputs.{_key(output)}.axes]"
        if output not in names:
            raise AxisError(f"{where}: the model has no output {output!r} ({sorted(names)})")
        if (
            not isinstance(table, dict)
            or set(table) != {"axes"}
            or not isinstance(table["axes"], dict)
        ):
            raise AxisError(f'{where}: takes one table, axes, of axis = "DIMENSION"')
        keys = {k: axis for axis, k in output_keys.get(output, {}).items() if axis >= 1}
        for key, dimension in table["axes"].items():
            if key not in keys:
                raise AxisError(
                    f"{where} {_key(key)}: output {output!r} has no dynamic axis {key!r} "
                    f"besides the batch (its dynamic axes: {sorted(keys) or 'none'})"
                )
            if dimension not in dimensions:
                raise AxisError(
                    f"{where} {_key(key)} = {dimension!r}: not a declared input axis "
                    f"({list(dimensions)})"
                )
            found.append(OutputAxis(output, keys[key], dimensions.index(dimension)))
    return tuple(found)


def resolve_axes(
    model: str,
    inputs: Sequence[TensorSpec],
    axis_keys: Mapping[str, Mapping[int, str]],
    declared: Mapping[str, Any],
) -> tuple[tuple[TensorSpec, ...], tuple[AxisDeclaration, ...]]:
    """The inputs with every declared axis set to its length, and the declarations.

    ``axis_keys`` names each dynamic axis of each input (the file's ``dim_param`` or the
    index as text); ``declared`` is model.toml's ``inputs`` table. Raises AxisError naming
    the first problem: an unknown input or axis, a bad value, an undeclared dynamic axis.
    """
    by_name = {spec.name: spec for spec in inputs}
    declarations = [
        _declaration(model, by_name, axis_keys, input_name, key, value)
        for input_name, table in _input_tables(model, by_name, declared)
        for key, value in table.items()
    ]
    chosen = {(d.input, d.axis): d for d in declarations}
    specs = tuple(_resolved(model, spec, axis_keys.get(spec.name, {}), chosen) for spec in inputs)
    return specs, tuple(declarations)


def _input_tables(
    model: str, by_name: Mapping[str, TensorSpec], declared: Mapping[str, Any]
) -> list[tuple[str, Mapping[str, Any]]]:
    """(input, its ``axes`` table) for each ``[inputs.NAME]`` table. Raises AxisError."""
    tables: list[tuple[str, Mapping[str, Any]]] = []
    for input_name, table in declared.items():
        where = f"model {model!r}: [inputs.{_key(input_name)}]"
        if input_name not in by_name:
            raise AxisError(f"{where}: the model has no input {input_name!r} ({sorted(by_name)})")
        if not isinstance(table, dict) or set(table) - {"axes"}:
            raise AxisError(f"{where} takes one table, axes")
        axes = table.get("axes", {})
        if not isinstance(axes, dict):
            raise AxisError(f"{where}: axes must be a table of axis = lengths")
        tables.append((input_name, axes))
    return tables


def _declaration(
    model: str,
    by_name: Mapping[str, TensorSpec],
    axis_keys: Mapping[str, Mapping[int, str]],
    input_name: str,
    key: str,
    value: Any,
) -> AxisDeclaration:
    where = f"model {model!r}: [inputs.{_key(input_name)}.axes] {_key(key)}"
    keys = {k: axis for axis, k in axis_keys.get(input_name, {}).items() if axis >= 1}
    if key not in keys:
        shape = by_name[input_name].shape
        known = sorted(keys) or "none"
        raise AxisError(
            f"{where}: input {input_name!r} {list(shape)} has no dynamic axis {key!r} "
            f"besides the batch (its dynamic axes: {known})"
        )
    min_length, max_length, buckets = _lengths(where, value)
    return AxisDeclaration(input_name, keys[key], key, min_length, max_length, buckets)


def _lengths(where: str, value: Any) -> tuple[int, int, tuple[int, ...]]:
    """(min, max, buckets) of ``value``: a length, a list of lengths or a table of min, max
    and buckets (default: [max]). Raises AxisError."""
    if _is_length(value):
        return value, value, (value,)
    if isinstance(value, list):
        buckets = _buckets(where, value)
        return buckets[0], buckets[-1], buckets
    if not isinstance(value, dict) or not {"min", "max"} <= set(value) <= {"min", "max", "buckets"}:
        raise AxisError(
            f"{where} must be a length, a list of lengths or a table of min, max and buckets"
            f" ({DOCS})"
        )
    low, high = value["min"], value["max"]
    if not (_is_length(low) and _is_length(high)) or low > high:
        raise AxisError(f"{where}: min and max must be lengths in 1..{MAX_AXIS_LENGTH}, min <= max")
    buckets = _buckets(where, value.get("buckets", [high]))
    if buckets[0] < low or buckets[-1] != high:
        raise AxisError(
            f"{where}: buckets {list(buckets)} must lie in [{low}, {high}], ending at max"
        )
    return low, high, buckets


def _buckets(where: str, value: Any) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or not value
        or not all(_is_length(v) for v in value)
        or value != sorted(set(value))
    ):
        raise AxisError(
            f"{where}: lengths must be a non-empty list of distinct, ascending integers in "
            f"1..{MAX_AXIS_LENGTH}"
        )
    return tuple(value)


def _is_length(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_AXIS_LENGTH


def _resolved(
    model: str,
    spec: TensorSpec,
    keys: Mapping[int, str],
    chosen: Mapping[tuple[str, int], AxisDeclaration],
) -> TensorSpec:
    """``spec`` with each declared axis at its length. Raises AxisError for one undeclared."""
    shape = list(spec.shape)
    for axis, dim in enumerate(spec.shape):
        if dim != -1 or axis == 0:
            continue
        declaration = chosen.get((spec.name, axis))
        if declaration is None:
            key = keys.get(axis, str(axis))
            raise AxisError(
                f"model {model!r}: input {spec.name!r} {list(spec.shape)} has a dynamic axis "
                f"{axis} ({key!r}) besides the batch; declare the lengths it takes in "
                f"model.toml: [inputs.{_key(spec.name)}.axes] {_key(key)} = [LENGTH] ({DOCS})"
            )
        shape[axis] = declaration.serving_length
    return TensorSpec(spec.name, spec.dtype, tuple(shape))


def _key(name: str) -> str:
    """``name`` as a TOML key: bare when it can be, else quoted."""
    if name and all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        return name
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'

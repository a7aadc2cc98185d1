"""What a model file says: ONNX inputs and outputs, supported batch sizes and the settings of
its optional ``model.toml``. Pure: bytes in, a ``ModelInfo`` out; no file is opened here.

Invariants: an ONNX model that refers to external data is refused (the runtime would open paths
the file names); batch sizes are inferred conservatively: only a model whose every input and
output has a leading dynamic axis is offered sizes above 1, unless model.toml declares them;
every tensor has a type the wire carries (`wire.dtypes`); every dynamic input axis but the batch
is declared (`model_axes`), so ``ModelInfo.inputs`` have no dynamic axis besides axis 0.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import external_data_helper

from clockwork_async.config.fields import ConfigError, Raw, build_section, ranged
from clockwork_async.models.axes import (
    AxisDeclaration,
    AxisError,
    ShapePlan,
    resolve_axes,
    shape_plan,
)
from clockwork_async.sim.profiles import BUILTIN_PROFILES, TINY_SIM
from clockwork_async.wire.dtypes import WIRE_DTYPES, onnx_wire_name, supported_names
from clockwork_async.wire.messages import TensorSpec

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
TOML_FILE = "model.toml"
MAX_BATCH_SIZE = 1024
BATCHED_SIZES = (1, 2, 4, 8, 16)  # offered to a model whose every tensor has a batch axis
MS_NS = 1_000_000
DEFAULT_SIM_PROFILE = TINY_SIM.name  # what simulated executors run a model as by default


class RepositoryError(Exception):
    """Base of the repository's named errors; ``code`` is a wire ErrorCode value."""

    code = "bad_model"


class InvalidModel(RepositoryError):
    """A model.onnx or model.toml that cannot be registered; the message says why."""


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """The optional ``model.toml`` (tensors, if declared, are read separately)."""

    name: str = ""
    group: str = ""
    copies: int = ranged(1, 1, 65536)
    batch_sizes: tuple[int, ...] = ()
    default_slo_ms: float = ranged(100.0, 0.001, 3_600_000.0)
    sim_profile: str = DEFAULT_SIM_PROFILE  # simulated executors: the built-in profile to run
    pad: bool = False  # pad requests up to their bucket (only for a model that masks padding)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model file and its model.toml, validated."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_sizes: tuple[int, ...]  # ascending
    batch_sizes_declared: bool  # from model.toml rather than inferred
    default_slo_ns: int
    copies: int
    group: str
    sim_profile: str = DEFAULT_SIM_PROFILE
    axes: tuple[AxisDeclaration, ...] = ()  # declared dynamic input axes (model.toml)
    default_slo_declared: bool = False  # model.toml set default_slo_ms (else it may be derived)
    shapes: ShapePlan | None = None  # its declared axes as dimensions and buckets (axes.py)


def read_model_info(name: str, onnx_bytes: bytes, toml_bytes: bytes | None) -> ModelInfo:
    """Validate model ``name``'s files; raises InvalidModel saying what is wrong."""
    model = _parse_onnx(name, onnx_bytes)
    settings, declared = _parse_toml(name, toml_bytes)
    inputs, axes = _inputs(name, model, declared.get("inputs"))
    declared_outputs = declared.get("outputs")
    output_axes = declared_outputs if isinstance(declared_outputs, dict) else {}
    outputs = _tensors(name, "output", model, None if output_axes else declared_outputs)
    try:
        shapes = shape_plan(
            name, axes, settings.pad, outputs, _axis_keys(model, "output"), output_axes
        )
    except AxisError as error:
        raise InvalidModel(str(error)) from None
    return ModelInfo(
        inputs=inputs,
        outputs=outputs,
        batch_sizes=settings.batch_sizes or _inferred_batch_sizes(inputs + outputs),
        batch_sizes_declared=bool(settings.batch_sizes),
        default_slo_ns=round(settings.default_slo_ms * MS_NS),
        copies=settings.copies,
        group=settings.group or name,
        sim_profile=settings.sim_profile,
        axes=axes,
        default_slo_declared=_declares(toml_bytes, "default_slo_ms"),
        shapes=shapes,
    )


def _declares(toml_bytes: bytes | None, key: str) -> bool:
    """Whether a model.toml (valid: `_parse_toml` read it first) sets ``key``."""
    return toml_bytes is not None and key in tomllib.loads(toml_bytes.decode("utf-8"))


def _inputs(
    name: str, model: onnx.ModelProto, declared: Any
) -> tuple[tuple[TensorSpec, ...], tuple[AxisDeclaration, ...]]:
    """The inputs at the shapes they are served at, and the declared axes. ``declared`` is
    model.toml's ``inputs``: an array of tensor tables (``[[inputs]]``, shapes given in full)
    or a table of per-input settings (``[inputs.NAME.axes]``). Raises InvalidModel."""
    if isinstance(declared, list):
        specs = _tensors(name, "input", model, declared)
        _check_given_lengths(name, specs)
        return specs, ()
    tables = declared if declared is not None else {}
    if not isinstance(tables, dict):
        raise InvalidModel(f"model {name!r}: {TOML_FILE} inputs must be tables")
    try:
        return resolve_axes(name, _graph_tensors(name, "input", model), _axis_keys(model), tables)
    except AxisError as error:
        raise InvalidModel(str(error)) from None


def _check_given_lengths(name: str, specs: Iterable[TensorSpec]) -> None:
    """``[[inputs]]`` give whole shapes: a dynamic axis besides the batch needs its length."""
    for spec in specs:
        if -1 in spec.shape[1:]:
            axis = spec.shape.index(-1, 1)
            raise InvalidModel(
                f"model {name!r}: [[inputs]] {spec.name!r} {list(spec.shape)} has a dynamic "
                f"axis {axis} besides the batch; give its length in the shape"
            )


def _axis_keys(model: onnx.ModelProto, kind: str = "input") -> dict[str, dict[int, str]]:
    """Per graph input (output), each dynamic axis's key: its dim name in the file, else its
    index."""
    values = model.graph.output if kind == "output" else model.graph.input
    return {
        value.name: {
            axis: dim.dim_param or str(axis)
            for axis, dim in enumerate(value.type.tensor_type.shape.dim)
            if not dim.HasField("dim_value")
        }
        for value in values
    }


def _parse_onnx(name: str, data: bytes) -> onnx.ModelProto:
    try:
        model = onnx.load_model_from_string(data)
    except Exception as error:  # protobuf raises DecodeError and others
        raise InvalidModel(f"model {name!r}: not an ONNX file ({error})") from None
    if model.ir_version <= 0 or not model.opset_import or not model.graph.output:
        raise InvalidModel(f"model {name!r}: not an ONNX model (no IR version, opset or output)")
    if any(external_data_helper.uses_external_data(t) for t in _all_tensors(model.graph)):
        raise InvalidModel(f"model {name!r}: external data is not supported; embed the weights")
    return model


def _all_tensors(graph: onnx.GraphProto) -> Iterable[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _all_tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from _all_tensors(subgraph)


def _parse_toml(name: str, data: bytes | None) -> tuple[ModelSettings, dict[str, Any]]:
    """Settings and the raw ``inputs``/``outputs`` arrays, if declared."""
    if data is None:
        return ModelSettings(), {}
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise InvalidModel(f"model {name!r}: {TOML_FILE} is not valid TOML ({error})") from None
    tensors: dict[str, Any] = {k: document.pop(k) for k in ("inputs", "outputs") if k in document}
    raw = {key: Raw(value, f"{name}/{TOML_FILE}") for key, value in document.items()}
    try:
        settings: ModelSettings = build_section(ModelSettings, TOML_FILE, raw)
    except ConfigError as error:
        raise InvalidModel(f"model {name!r}: {error}") from None
    _check_settings(name, settings)
    return settings, tensors


def _check_settings(name: str, settings: ModelSettings) -> None:
    if settings.name and settings.name != name:
        raise InvalidModel(f"model {name!r}: {TOML_FILE} says name = {settings.name!r}")
    if settings.group and not MODEL_NAME.match(settings.group):
        raise InvalidModel(f"model {name!r}: group {settings.group!r} is not a valid name")
    if settings.sim_profile not in BUILTIN_PROFILES:
        known = ", ".join(sorted(BUILTIN_PROFILES))
        raise InvalidModel(
            f"model {name!r}: sim_profile {settings.sim_profile!r} is not a built-in profile "
            f"({known})"
        )
    sizes = settings.batch_sizes
    if sizes and (list(sizes) != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > MAX_BATCH_SIZE):
        raise InvalidModel(
            f"model {name!r}: batch_sizes {list(sizes)} must be distinct, ascending, "
            f"in 1..{MAX_BATCH_SIZE}"
        )


def _tensors(name: str, kind: str, model: onnx.ModelProto, declared: Any) -> tuple[TensorSpec, ...]:
    found = _graph_tensors(name, kind, model)
    if declared is None:
        return found
    specs = _declared_tensors(name, kind, declared)
    if sorted(s.name for s in specs) != sorted(s.name for s in found):
        raise InvalidModel(
            f"model {name!r}: declared {kind}s {[s.name for s in specs]} differ from the "
            f"file's {[s.name for s in found]}"
        )
    dtypes = {s.name: s.dtype for s in found}
    for spec in specs:
        if dtypes[spec.name] != spec.dtype:
            raise InvalidModel(
                f"model {name!r}: {kind} {spec.name!r} is {dtypes[spec.name]} in the file, "
                f"not {spec.dtype}"
            )
    return specs


def _graph_tensors(name: str, kind: str, model: onnx.ModelProto) -> tuple[TensorSpec, ...]:
    graph = model.graph
    if kind == "output":
        values = list(graph.output)
    else:
        constants = {t.name for t in graph.initializer}
        values = [v for v in graph.input if v.name not in constants]
    return tuple(_tensor_spec(name, kind, value) for value in values)


def _tensor_spec(name: str, kind: str, value: onnx.ValueInfoProto) -> TensorSpec:
    what = f"model {name!r}: {kind} {value.name!r}"
    if not value.type.HasField("tensor_type"):
        raise InvalidModel(f"{what} is not a tensor (sequences and maps are not supported)")
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        raise InvalidModel(f"{what} has no shape in the file; declare it in {TOML_FILE}")
    dtype = onnx_wire_name(tensor.elem_type)
    if dtype is None:
        names = {number: text for text, number in onnx.TensorProto.DataType.items()}
        kind = names.get(tensor.elem_type, str(tensor.elem_type))
        raise InvalidModel(
            f"{what} has element type {kind}, which is not served (types: {supported_names()})"
        )
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
    return TensorSpec(value.name, dtype, shape)


def _declared_tensors(name: str, kind: str, declared: Any) -> tuple[TensorSpec, ...]:
    where = f"model {name!r}: {TOML_FILE} [[{kind}s]]"
    if not isinstance(declared, list):
        raise InvalidModel(f"{where} must be an array of tables")
    specs = []
    for table in declared:
        if not isinstance(table, dict) or set(table) != {"name", "dtype", "shape"}:
            raise InvalidModel(f"{where} entries need exactly name, dtype and shape")
        shape = table["shape"]
        if not isinstance(shape, list) or not all(_is_dim(d) for d in shape):
            raise InvalidModel(f"{where} {table['name']!r}: shape must be integers >= 1 or -1")
        dtype = table["dtype"]
        if dtype not in WIRE_DTYPES:
            raise InvalidModel(
                f"{where} {table['name']!r}: dtype {dtype!r} is not one of {supported_names()}"
            )
        specs.append(TensorSpec(str(table["name"]), dtype, tuple(shape)))
    return tuple(specs)


def _is_dim(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1)


def _inferred_batch_sizes(tensors: Iterable[TensorSpec]) -> tuple[int, ...]:
    """Batched sizes only if every tensor has a leading dynamic axis; else batch 1."""
    if all(len(t.shape) >= 1 and t.shape[0] == -1 for t in tensors):
        return BATCHED_SIZES
    return (1,)

"""The Open Inference Protocol's tensor codec (`api.v2_tensors`), bytes in and out, no sockets:
JSON and binary tensors both ways, each broken body refused with a sentence, any bytes either
parse or raise `TensorError`."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clockwork_async.api.v2_tensors import (
    DATATYPES,
    TensorError,
    array_from_bytes,
    build_inputs,
    dtype_of,
    encode_response,
    json_data,
    parse_request,
    select_outputs,
)


def body(*inputs: dict[str, object], **rest: object) -> bytes:
    return json.dumps({"inputs": list(inputs), **rest}).encode()


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_json_data_of_every_datatype_becomes_an_array_of_its_dtype(datatype: str) -> None:
    values = [True, False, True, False] if datatype == "BOOL" else [1, 2, 3, 4]
    header = parse_request(
        body({"name": "x", "shape": [2, 2], "datatype": datatype, "data": values})
    )
    (array,) = build_inputs(header).values()
    assert array.dtype == np.dtype(DATATYPES[datatype]) and array.shape == (2, 2)
    assert array.ravel().tolist() == values


def test_nested_json_data_is_accepted_as_triton_sends_it() -> None:
    header = parse_request(
        body({"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3, 4]]})
    )
    np.testing.assert_array_equal(build_inputs(header)["x"], [[1, 2], [3, 4]])


def test_binary_inputs_are_views_of_the_bytes_after_the_header_in_order() -> None:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    b = np.arange(3, dtype=np.int64)
    header = parse_request(
        body(
            {
                "name": "a",
                "shape": [1, 4],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 16},
            },
            {"name": "j", "shape": [2], "datatype": "INT32", "data": [7, 8]},
            {
                "name": "b",
                "shape": [3],
                "datatype": "INT64",
                "parameters": {"binary_data_size": 24},
            },
        )
    )
    arrays = build_inputs(header, a.tobytes() + b.tobytes())
    np.testing.assert_array_equal(arrays["a"], a)
    np.testing.assert_array_equal(arrays["b"], b)
    assert arrays["j"].tolist() == [7, 8]
    assert not arrays["a"].flags.writeable  # a view of the body, not a copy


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ({"inputs": []}, "inputs must be a list"),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
            "not supported",
        ),
        ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1]}]}, "do not fill"),
        ({"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": []}]}, ">= 0"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": ["a"]}]}, "not FP32"),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}]},
            "true or false",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, "neither data"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}]}, "not INT8"),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [2],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 4},
                    }
                ]
            },
            "does not match",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "id": 5}, "id"),
        ([1, 2], "JSON object"),
    ],
)
def test_a_broken_request_names_its_first_problem(document: object, words: str) -> None:
    with pytest.raises(TensorError, match=words):
        build_inputs(parse_request(json.dumps(document).encode()))


def test_binary_bytes_that_disagree_with_the_sizes_are_refused() -> None:
    header = parse_request(
        body({"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}})
    )
    for wrong in (b"", bytes(4), bytes(12)):
        with pytest.raises(TensorError, match="binary section holds"):
            build_inputs(header, wrong)


def test_raw_contents_must_fit_the_shape() -> None:
    array = array_from_bytes("x", "FP16", [2, 2], np.ones(4, np.float16).tobytes())
    assert array.dtype == np.float16 and array.shape == (2, 2)
    with pytest.raises(TensorError, match="do not match"):
        array_from_bytes("x", "FP16", [2, 2], bytes(6))


def test_a_response_carries_json_and_binary_outputs_as_asked() -> None:
    outputs = {"y": np.arange(3, dtype=np.float32), "z": np.array([[True, False]])}
    header = parse_request(
        body(
            {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
            outputs=[{"name": "y", "parameters": {"binary_data": True}}, {"name": "z"}],
        )
    )
    encoded = encode_response({"model_name": "m"}, select_outputs(outputs, header))
    document = json.loads(encoded.json)
    y, z = document["outputs"]
    assert y == {
        "name": "y",
        "datatype": "FP32",
        "shape": [3],
        "parameters": {"binary_data_size": 12},
    }
    assert z == {"name": "z", "datatype": "BOOL", "shape": [1, 2], "data": [True, False]}
    assert encoded.header_bytes == len(encoded.json)
    assert b"".join(encoded.binary) == outputs["y"].tobytes()


def test_binary_data_output_sends_every_output_binary_and_unknown_names_are_refused() -> None:
    outputs = {"y": np.ones(2, np.int16)}
    header = parse_request(
        body(
            {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
            parameters={"binary_data_output": True},
        )
    )
    assert [binary for _, _, binary in select_outputs(outputs, header)] == [True]
    named = parse_request(
        body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}, outputs=[{"name": "q"}])
    )
    with pytest.raises(TensorError, match="unknown output 'q'"):
        select_outputs(outputs, named)


@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_the_codecs_own_error(data: bytes) -> None:
    try:
        header = parse_request(data)
        build_inputs(header, b"")
    except TensorError:
        pass


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "name",
                        "shape",
                        "datatype",
                        "data",
                        "parameters",
                        "inputs",
                        "binary_data_size",
                        "id",
                    ]
                ),
                inner,
                max_size=5,
            )
        ),
        max_leaves=20,
    )
)
def test_any_json_document_parses_or_raises_the_codecs_own_error(document: object) -> None:
    with contextlib.suppress(TensorError):
        build_inputs(parse_request(json.dumps({"inputs": [document]}).encode()), b"")


def test_values_the_datatype_cannot_hold_are_refused_not_wrapped() -> None:
    for datatype, value in (("FP16", 1e300), ("UINT8", -1), ("INT32", float("nan"))):
        spec = {"name": "x", "shape": [1], "datatype": datatype, "data": [value]}
        with pytest.raises(TensorError, match=f"not {datatype}"):
            build_inputs(parse_request(body(spec)))


def test_every_wire_dtype_has_a_datatype_and_back() -> None:
    from clockwork_async.api.v2_tensors import datatype_of, dtype_of
    from clockwork_async.wire.dtypes import WIRE_DTYPES

    assert sorted(DATATYPES.values()) == sorted(WIRE_DTYPES)
    for name in DATATYPES:
        assert datatype_of(dtype_of(name)) == name


def _json_values_back(encoded_json: bytes, datatype: str) -> np.ndarray:
    """What a client does with a JSON ``data`` list: Python numbers, cast to the dtype."""
    (output,) = json.loads(encoded_json)["outputs"]
    return np.array(output["data"], dtype=dtype_of(datatype).newbyteorder("="))


@pytest.mark.parametrize("datatype", sorted(set(DATATYPES) - {"BOOL"}))
def test_json_outputs_read_back_bit_for_bit_in_every_datatype(datatype: str) -> None:
    dtype = dtype_of(datatype).newbyteorder("=")
    rng = np.random.default_rng(7)
    if dtype.kind == "f":
        # both sides of the float32 short-decimal range, its edges, subnormals and extremes
        scales = np.array([1e-45, 1e-38, 1e-7, 1.9e-4, 2e-4, 1.0, 1e3, 1e18, 1.1e18, 3e38])
        values = rng.standard_normal(2000) * rng.choice(scales, 2000)
        with np.errstate(over="ignore"):  # values past the dtype's range become inf: dropped
            array = values.astype(dtype)
        array = array[np.isfinite(array)]
    else:
        info = np.iinfo(dtype)
        array = rng.integers(info.min, info.max, 2000, dtype=dtype, endpoint=True)
    encoded = encode_response({"model_name": "m"}, [("y", array, False)])
    back = _json_values_back(encoded.json, datatype)
    assert back.tobytes() == array.tobytes()


def test_json_outputs_write_nan_and_infinity_as_the_standard_library_does() -> None:
    array = np.array([np.nan, np.inf, -np.inf, 1.5], np.float32)
    encoded = encode_response({"model_name": "m"}, [("y", array, False)])
    assert b'"data":[NaN,Infinity,-Infinity,1.5]' in encoded.json


def test_json_requests_with_nan_or_huge_integers_parse_as_the_standard_library_reads_them() -> None:
    spec = {"name": "x", "shape": [2], "datatype": "FP64", "data": [float("nan"), 2**70]}
    header = parse_request(body(spec))
    assert header.inputs[0].data[1] == 2**70
    with pytest.raises(TensorError, match="not valid JSON"):
        parse_request(b'{"inputs": [}')


def test_float32_json_outputs_in_the_short_decimal_range_read_back_bit_for_bit() -> None:
    bits = np.random.default_rng(11).integers(0, 2**32, 200_000, dtype=np.uint32)
    values = bits.view(np.float32)
    magnitude = np.abs(values)
    array = values[(magnitude >= 2e-4) & (magnitude <= 1e18)]
    assert array.size > 50_000
    encoded = encode_response({"model_name": "m"}, [("y", array, False)])
    assert len(encoded.json) < len(json.dumps(array.tolist()))  # short decimals, not doubles
    assert _json_values_back(encoded.json, "FP32").tobytes() == array.tobytes()


@pytest.mark.parametrize(
    ("value", "short"),
    [(0.0, True), (-0.0, True), (2e-4, True), (-5.0, True), (1e18, True), (1.9e-4, False),
     (1.1e18, False), (1e-45, False), (float("nan"), False), (float("inf"), False),
     (float("-inf"), False)],
)  # fmt: skip
def test_float32_json_data_is_written_short_only_within_its_exact_range(
    value: float, short: bool
) -> None:
    data = json_data(np.array([value, 1.0, 0.0], np.float32))
    assert data.dtype == (np.float32 if short else np.float64)


_F32_LOW = float(np.float32(2e-4))
_F32_HIGH = float(np.float32(1e18))


@pytest.mark.parametrize(
    "value",
    [0.0, -0.0, _F32_LOW, -_F32_HIGH, float(np.nextafter(np.float32(_F32_LOW), np.float32(0))),
     float(np.nextafter(np.float32(_F32_HIGH), np.float32(np.inf))), 1e-45, float("nan"),
     float("inf"), -5.0],
)  # fmt: skip
def test_float32_json_data_takes_the_same_form_for_few_values_and_many(value: float) -> None:
    few = json_data(np.array([value, 1.0], np.float32))  # checked value by value
    many = json_data(np.array([value] + [1.0] * 99, np.float32))  # checked by numpy
    assert few.dtype == many.dtype

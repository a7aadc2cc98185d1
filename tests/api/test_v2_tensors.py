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
    encode_response,
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

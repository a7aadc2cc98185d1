"""Declared dynamic axes and served tensor types at registration: `model_info` with
`model_axes`, on generated models (docs/configuration.md, "Dynamic axes")."""

from __future__ import annotations

from pathlib import Path

import pytest
from onnx import TensorProto, helper

from clockwork_async.models.axes import AxisDeclaration, Dimension, OutputAxis, ShapePlan
from clockwork_async.models.info import InvalidModel, read_model_info
from clockwork_async.models.repository import Repository
from clockwork_async.wire.messages import TensorSpec
from typed_models import (
    AUDIO_TOML,
    BUCKETS,
    MASKED_TOKENS_TOML,
    SAMPLES,
    SEQUENCE_BUCKETS_TOML,
    SEQUENCE_TOML,
    TOKENS,
    audio_model,
    fp16_model,
    ids_mask_scale_model,
    masked_tokens_model,
    mixed_model,
    sequence_model,
)


def test_a_declared_length_fixes_the_axis_the_model_is_served_at() -> None:
    info = read_model_info("seq", sequence_model(), SEQUENCE_TOML.encode())
    assert info.inputs == (TensorSpec("ids", "int64", (-1, TOKENS)),)
    assert info.axes == (AxisDeclaration("ids", 1, "tokens", TOKENS, TOKENS, (TOKENS,)),)
    assert info.batch_sizes == (1, 2, 4, 8, 16)  # one length: rows stack


@pytest.mark.parametrize(
    "value",
    [
        f"{SAMPLES}",
        f"[{SAMPLES}]",
        f"{{ min = 2, max = {SAMPLES} }}",
        f"{{ min = 8, max = {SAMPLES}, buckets = [{SAMPLES}] }}",
    ],
)
def test_one_length_may_be_a_number_a_list_or_a_range_with_one_bucket(value: str) -> None:
    info = read_model_info("vad", audio_model(), f"[inputs.audio.axes]\nsamples = {value}".encode())
    assert info.inputs == (TensorSpec("audio", "float32", (-1, SAMPLES)),)
    assert info.axes[0].serving_length == SAMPLES


@pytest.mark.parametrize(
    ("model", "input_name", "key"),
    [(sequence_model, "ids", "tokens"), (audio_model, "audio", "samples")],
)
def test_an_undeclared_dynamic_axis_is_refused_naming_input_axis_and_key(
    model: object, input_name: str, key: str
) -> None:
    with pytest.raises(InvalidModel) as caught:
        read_model_info("m", model(), None)  # type: ignore[operator]
    message = str(caught.value)
    assert f"input {input_name!r}" in message
    assert f"dynamic axis 1 ({key!r})" in message
    assert f"[inputs.{input_name}.axes] {key} = [LENGTH]" in message


def test_an_unnamed_dynamic_axis_is_keyed_by_its_index() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", None])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(InvalidModel, match=r"\[inputs.x.axes\] 1 = \[LENGTH\]"):
        read_model_info("m", data, None)
    info = read_model_info("m", data, b'[inputs.x.axes]\n"1" = [5]')
    assert info.inputs[0].shape == (-1, 5)


def test_several_lengths_are_served_by_buckets_at_the_largest_shape(tmp_path: Path) -> None:
    info = read_model_info("seq", sequence_model(), SEQUENCE_BUCKETS_TOML.encode())
    assert info.inputs == (TensorSpec("ids", "int64", (-1, BUCKETS[-1])),)
    tokens = Dimension("tokens", BUCKETS, (("ids", 1),), min_length=BUCKETS[0])  # a list's min
    assert info.shapes == ShapePlan((tokens,))
    assert info.shapes.bucketed and not info.shapes.pad
    entry = Repository(tmp_path).add("seq", sequence_model(), SEQUENCE_BUCKETS_TOML)
    assert entry.buckets == tuple((length,) for length in BUCKETS)
    assert entry.at_bucket((4,)).inputs == (TensorSpec("ids", "int64", (-1, 4)),)
    assert entry.at_bucket((4,)).profile_key != entry.at_bucket((8,)).profile_key


def test_inputs_sharing_an_axis_name_are_one_dimension_and_outputs_may_follow_it() -> None:
    info = read_model_info("tok", masked_tokens_model(), MASKED_TOKENS_TOML.encode())
    assert info.shapes is not None and info.shapes.pad
    places = (("ids", 1), ("mask", 1))
    assert info.shapes.dimensions == (Dimension("tokens", BUCKETS, places, min_length=1),)
    assert info.shapes.output_axes == (OutputAxis("hidden", 1, 0),)
    spec = info.shapes.inputs_at(info.inputs, (8,))
    assert [s.shape for s in spec] == [(-1, 8), (-1, 8)]


def test_one_length_is_served_as_before_unless_padded() -> None:
    info = read_model_info("seq", sequence_model(), SEQUENCE_TOML.encode())
    assert info.shapes is not None and not info.shapes.bucketed
    padded = read_model_info("seq", sequence_model(), ("pad = true\n" + SEQUENCE_TOML).encode())
    assert padded.shapes is not None and padded.shapes.bucketed


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        (
            MASKED_TOKENS_TOML.replace(
                "buckets = [4, 8, 12] }\n[outputs", "buckets = [6, 12] }\n[outputs"
            ),
            r"input 'mask' is declared \[6, 12\] \(min 1\), another input's \[4, 8, 12\]",
        ),
        (MASKED_TOKENS_TOML.replace('= "tokens"', '= "words"'), "not a declared input axis"),
        (MASKED_TOKENS_TOML.replace("[outputs.hidden", "[outputs.nope"), "has no output 'nope'"),
        (
            MASKED_TOKENS_TOML.replace('tokens = "tokens"', '"2" = "tokens"'),
            "output 'hidden' has no dynamic axis '2'",
        ),
    ],
)
def test_bad_bucket_declarations_are_named_errors(toml: str, says: str) -> None:
    with pytest.raises(InvalidModel, match=says):
        read_model_info("tok", masked_tokens_model(), toml.encode())


def test_padding_without_a_declared_axis_is_refused() -> None:
    with pytest.raises(InvalidModel, match=r"pad and \[outputs.NAME.axes\] need declared"):
        read_model_info("h", fp16_model(), b"pad = true")


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ("[inputs.nope.axes]\ntokens = [4]", "has no input 'nope'"),
        ("[inputs.ids.axes]\nlength = [4]", "has no dynamic axis 'length'"),
        ("[inputs.ids.axes]\nN = [4]", "has no dynamic axis 'N' besides the batch"),
        ("[inputs.ids.axes]\ntokens = []", "non-empty list"),
        ("[inputs.ids.axes]\ntokens = [0]", "1..16777216"),
        ("[inputs.ids.axes]\ntokens = true", "a length, a list of lengths or a table"),
        ("[inputs.ids.axes]\ntokens = { min = 9, max = 4 }", "min <= max"),
        ("[inputs.ids.axes]\ntokens = { min = 4, max = 9, buckets = [2, 9] }", "must lie in"),
        ("[inputs.ids.axes]\ntokens = { max = 9 }", "table of min, max and buckets"),
        ("[inputs.ids]\nshape = [1]", "takes one table, axes"),
        ("inputs = 3", "inputs must be tables"),
    ],
)
def test_bad_declarations_are_named_errors(toml: str, says: str) -> None:
    with pytest.raises(InvalidModel, match=says):
        read_model_info("seq", sequence_model(), toml.encode())


def test_a_declared_tensor_table_must_give_the_length_in_its_shape() -> None:
    toml = b"[[inputs]]\nname = 'ids'\ndtype = 'int64'\nshape = [-1, -1]"
    with pytest.raises(
        InvalidModel,
        match=r"'ids' \[-1, -1\] has a dynamic axis 1 besides the batch; give its length",
    ):
        read_model_info("seq", sequence_model(), toml)
    info = read_model_info("seq", sequence_model(), toml.replace(b"-1]", b"7]"))
    assert info.inputs == (TensorSpec("ids", "int64", (-1, 7)),)


def test_every_served_tensor_type_is_read_from_the_file() -> None:
    assert read_model_info("h", fp16_model(), None).inputs == (TensorSpec("x", "float16", (-1, 8)),)
    info = read_model_info("m", ids_mask_scale_model(), None)
    assert [(s.dtype, s.shape) for s in info.inputs] == [
        ("int64", (-1, 6)),
        ("bool", (-1, 6)),
        ("float32", ()),
    ]
    assert info.batch_sizes == (1,)  # a scalar input has no batch axis
    mixed = read_model_info("x", mixed_model(), None)
    assert [s.dtype for s in mixed.inputs] == [
        "int8",
        "uint8",
        "int16",
        "int32",
        "float32",
        "float64",
    ]
    assert [s.dtype for s in mixed.outputs] == ["float64", "bool", "int32"]


@pytest.mark.parametrize(
    ("elem_type", "name"), [(TensorProto.STRING, "STRING"), (TensorProto.BFLOAT16, "BFLOAT16")]
)
def test_a_type_the_wire_cannot_carry_is_refused(elem_type: int, name: str) -> None:
    x = helper.make_tensor_value_info("x", elem_type, ["N"])
    y = helper.make_tensor_value_info("y", elem_type, ["N"])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(
        InvalidModel, match=f"input 'x' has element type {name}, which is not served"
    ):
        read_model_info("m", data, None)


def test_declared_lengths_key_the_profile_cache(tmp_path: Path) -> None:
    root = tmp_path / "models"
    repository = Repository(root)
    plain = repository.add("a", audio_model(), AUDIO_TOML)
    longer = repository.add("b", audio_model(), AUDIO_TOML.replace(str(SAMPLES), "128"))
    fp16 = repository.add("c", fp16_model())
    assert plain.sha256 == longer.sha256
    assert plain.profile_key != longer.profile_key
    assert fp16.profile_key == fp16.sha256  # nothing declared: the file's hash, as before

"""A bucketed model's registration and door without a daemon: the buckets registered largest
first within one profiling cap, the rest seeded by the neighbour rule (daemon/instances.py);
the door's choice of variant, its padding and its cutting back (runtime/buckets.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.events import ModelProfile
from clockwork_async.core.outcomes import Outcome
from clockwork_async.daemon.instances import register_variants
from clockwork_async.models.repository import ModelEntry, Repository
from clockwork_async.runtime.buckets import BucketedModel, route
from clockwork_async.runtime.driver import RegisteredModel
from clockwork_async.runtime.profiler import RegistrationProfile
from typed_models import (
    BUCKETS,
    MASKED_TOKENS_TOML,
    SEQUENCE_BUCKETS_TOML,
    masked_tokens_model,
    sequence_model,
)

PROFILING_NS = 60  # what profiling one bucket takes on the fake clock
SIZES = (1, 2, 4)


def measured(length: int) -> RegistrationProfile:
    return RegistrationProfile(SIZES, {"cpu": ModelProfile({b: b * length for b in SIZES}, 7)})


class FakeRegistration:
    """Registers instantly from a given profile, or 'profiles' for PROFILING_NS."""

    def __init__(self) -> None:
        self.clock_ns = 0
        self.given: dict[str, RegistrationProfile | None] = {}

    def now_ns(self) -> int:
        return self.clock_ns

    async def register_one(
        self, entry: ModelEntry, name: str, profile: RegistrationProfile | None
    ) -> RegisteredModel:
        self.given[name] = profile
        if profile is None:
            self.clock_ns += PROFILING_NS
            profile = measured(entry.inputs[0].shape[1])
        return RegisteredModel(
            name, "", "", 1, profile.batch_sizes, entry.inputs, entry.outputs, 0, 1, profile
        )


@pytest.fixture
def entry(tmp_path: Path) -> ModelEntry:
    return Repository(tmp_path).add("seq", sequence_model(), SEQUENCE_BUCKETS_TOML)


@pytest.mark.parametrize(
    ("cap_ns", "profiled"), [(1000, BUCKETS), (150, (8, 12)), (100, (12,)), (1, (12,))]
)
async def test_buckets_are_profiled_largest_first_while_the_cap_allows_the_rest_seeded(
    entry: ModelEntry, cap_ns: int, profiled: tuple[int, ...]
) -> None:
    fake = FakeRegistration()
    profiles: dict[tuple[int, ...], RegistrationProfile | None] = {}
    seeded: set[tuple[int, ...]] = set()
    models = await register_variants(
        entry, "seq", fake.register_one, profiles, seeded, cap_ns, fake.now_ns
    )
    assert [m.name for m in models] == ["seq~4", "seq~8", "seq~12"]
    assert list(fake.given) == ["seq~12", "seq~8", "seq~4"]
    assert [m.inputs[0].shape for m in models] == [(-1, 4), (-1, 8), (-1, 12)]
    for model, length in zip(models, BUCKETS, strict=True):
        if length in profiled:
            assert fake.given[model.name] is None and profiles[(length,)] == measured(length)
        else:  # the next longer profiled bucket's times, not to be cached
            longer = min(b for b in profiled if b > length)
            assert model.profile.kinds == measured(longer).kinds
            assert (length,) in seeded
    assert len(seeded) == len(BUCKETS) - len(profiled)
    again = FakeRegistration()  # a second copy reuses every profile, seeded ones too
    await register_variants(entry, "seq-1", again.register_one, profiles, seeded, 1, again.now_ns)
    assert all(profile is not None for profile in again.given.values())


async def test_a_cached_bucket_is_not_profiled_again(entry: ModelEntry) -> None:
    fake = FakeRegistration()
    profiles: dict[tuple[int, ...], RegistrationProfile | None] = {(8,): measured(8)}
    await register_variants(entry, "seq", fake.register_one, profiles, set(), 1000, fake.now_ns)
    assert fake.given["seq~8"] == measured(8)
    assert fake.given["seq~12"] is None and fake.given["seq~4"] is None


# --- the door -----------------------------------------------------------------------------------


def bucketed(tmp_path: Path, toml: str, data: bytes) -> BucketedModel:
    entry = Repository(tmp_path).add("m", data, toml)
    assert entry.shapes is not None
    names = {bucket: f"m~{bucket[0]}" for bucket in entry.buckets}
    return BucketedModel("m", entry.shapes, names)


def never(outcome: InferOutcome) -> None:
    raise AssertionError("not called")


def test_an_exact_length_goes_to_its_variant_untouched(tmp_path: Path) -> None:
    model = bucketed(tmp_path, SEQUENCE_BUCKETS_TOML, sequence_model())
    ids = np.ones((1, 8), np.int64)
    routed = route(model, {"ids": ids}, never)
    assert routed.model == "m~8" and not routed.bad_input
    assert routed.inputs["ids"] is ids and routed.on_reply is never
    assert model.largest == "m~12"


def test_without_padding_a_length_between_buckets_is_bad_input(tmp_path: Path) -> None:
    model = bucketed(tmp_path, SEQUENCE_BUCKETS_TOML, sequence_model())
    routed = route(model, {"ids": np.ones((1, 5), np.int64)}, never)
    assert routed.model == "m"
    assert routed.bad_input == (
        "input 'ids' axis 1 ('tokens') has length 5; it takes only [4, 8, 12] "
        "(this model does not pad)"
    )


def test_unreadable_inputs_go_to_the_largest_variant_whose_check_names_them(
    tmp_path: Path,
) -> None:
    model = bucketed(tmp_path, SEQUENCE_BUCKETS_TOML, sequence_model())
    routed = route(model, {"ids": np.ones(3, np.int64)}, never)  # no axis 1
    assert routed.model == "m~12" and not routed.bad_input


def test_padding_fills_zeros_up_to_the_bucket_and_cuts_shared_outputs_back(
    tmp_path: Path,
) -> None:
    model = bucketed(tmp_path, MASKED_TOKENS_TOML, masked_tokens_model())
    got: list[InferOutcome] = []
    ids = np.arange(1, 6, dtype=np.int64).reshape(1, 5)
    routed = route(model, {"ids": ids, "mask": np.ones((1, 5), np.float32)}, got.append)
    assert routed.model == "m~8"
    assert routed.inputs["ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert routed.inputs["mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    hidden = np.arange(32, dtype=np.float32).reshape(1, 8, 4)
    pooled = np.ones((1, 4), np.float32)
    outcome = InferOutcome(1, Outcome.OK, "", {"hidden": hidden, "pooled": pooled}, {}, None, 1)
    routed.on_reply(outcome)
    (answer,) = got
    assert answer.outputs["hidden"].shape == (1, 5, 4)
    np.testing.assert_array_equal(answer.outputs["hidden"], hidden[:, :5])
    assert answer.outputs["pooled"] is pooled


def test_inputs_disagreeing_on_one_axis_are_bad_input(tmp_path: Path) -> None:
    model = bucketed(tmp_path, MASKED_TOKENS_TOML, masked_tokens_model())
    inputs = {"ids": np.ones((1, 3), np.int64), "mask": np.ones((1, 5), np.float32)}
    routed = route(model, inputs, never)
    assert routed.model == "m" and "along axis 'tokens'" in routed.bad_input


def test_a_length_under_the_declared_min_is_bad_input_though_padding_would_fit(
    tmp_path: Path,
) -> None:
    model = bucketed(
        tmp_path, MASKED_TOKENS_TOML.replace("min = 1", "min = 3"), masked_tokens_model()
    )
    short = {"ids": np.ones((1, 2), np.int64), "mask": np.ones((1, 2), np.float32)}
    routed = route(model, short, never)
    assert (
        routed.bad_input == "input 'ids' axis 1 ('tokens') has length 2, under its declared min 3"
    )
    enough = {"ids": np.ones((1, 3), np.int64), "mask": np.ones((1, 3), np.float32)}
    assert route(model, enough, never).model == "m~4"

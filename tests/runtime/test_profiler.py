"""Registration profiling against a scripted executor: which samples count, which batch sizes
are offered, what happens on failure; the profile's JSON form."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from clockwork_async.core.events import ModelProfile
from clockwork_async.runtime.profiler import (
    Build,
    ProfilerConfig,
    ProfilingError,
    ProfilingTarget,
    RegistrationProfile,
    measure,
    percentile_ns,
    zero_batch,
)
from clockwork_async.wire.messages import (
    ActionResult,
    Infer,
    Load,
    Message,
    TensorSpec,
    Unload,
)

SPECS = (TensorSpec("x", "float32", (-1, 3, -1)),)


class ScriptedExecutor:
    """Answers Load/Infer/Unload with durations from tables; records what it was sent."""

    def __init__(
        self, execute_ns: Mapping[int, list[int]], load_ns: list[int], fail: str = ""
    ) -> None:
        self.execute_ns = {b: list(v) for b, v in execute_ns.items()}
        self.load_ns = list(load_ns)
        self.fail = fail
        self.sent: list[Message] = []
        self.reserved: list[tuple[str, int]] = []  # (lane, ns) of each action's reservation
        self.now_ns = 0
        self._ids = iter(range(1, 10_000))

    async def run(self, lane: str, reserve_ns: int, wait_ns: int, build: Build) -> Message:
        self.reserved.append((lane, reserve_ns))
        reply = await self.act(build(1_000, 1_000))
        self.now_ns += sum(getattr(reply, "durations_ns", {}).values())
        return reply

    async def act(self, message: Message) -> Message:
        self.sent.append(message)
        action_id = getattr(message, "action_id")  # noqa: B009
        if isinstance(message, Load):
            if self.fail == "load":
                return ActionResult(action_id, "no_pages", "full")
            return ActionResult(action_id, durations_ns={"load": self.load_ns.pop(0)})
        if isinstance(message, Infer):
            assert message.inputs["x"].shape == (message.batch_size, 3, 1)
            if self.fail == "infer":
                return ActionResult(action_id, "internal", "boom")
            return ActionResult(
                action_id, durations_ns={"execute": self.execute_ns[message.batch_size].pop(0)}
            )
        assert isinstance(message, Unload)
        return ActionResult(action_id)

    def target(self) -> ProfilingTarget:
        return ProfilingTarget(self.run, lambda: next(self._ids), lambda: self.now_ns)


CONFIG = ProfilerConfig(
    warmup_iterations=1, iterations=3, load_iterations=2, percentile=50.0, max_execute_ns=10_000
)


async def test_warmup_is_discarded_and_the_percentile_kept() -> None:
    executor = ScriptedExecutor(
        {1: [99_999, 100, 300, 200], 2: [99_999, 400, 500, 600]}, load_ns=[7_000, 5_000]
    )
    profile, sizes = await measure(executor.target(), "m", SPECS, (2, 1), CONFIG)
    assert sizes == (1, 2)
    assert profile == ModelProfile(execute_ns={1: 200, 2: 500}, load_ns=5_000)
    kinds = [type(m).__name__ for m in executor.sent]
    assert kinds == ["Load", "Unload", "Load", *["Infer"] * 8, "Unload"]
    windows = [(m.earliest_ns, m.latest_ns) for m in executor.sent if isinstance(m, Infer)]
    assert all(window == (1_000, 1_000 + CONFIG.window_ns) for window in windows)


async def test_batch_sizes_over_the_maximum_are_not_offered() -> None:
    executor = ScriptedExecutor(
        {1: [0, 5_000] * 2, 2: [0, 20_000] * 2, 4: [0, 1] * 2}, load_ns=[1, 1]
    )
    config = ProfilerConfig(
        warmup_iterations=1, iterations=1, load_iterations=1, max_execute_ns=10_000
    )
    profile, sizes = await measure(executor.target(), "m", SPECS, (1, 2, 4), config)
    assert sizes == (1,)
    assert dict(profile.execute_ns) == {1: 5_000}
    assert not any(isinstance(m, Infer) and m.batch_size == 4 for m in executor.sent)


async def test_the_smallest_batch_is_offered_however_slow() -> None:
    executor = ScriptedExecutor({1: [0, 50_000], 2: [0, 60_000]}, load_ns=[1])
    config = ProfilerConfig(
        warmup_iterations=1, iterations=1, load_iterations=1, max_execute_ns=10_000
    )
    _, sizes = await measure(executor.target(), "m", SPECS, (1, 2), config)
    assert sizes == (1,)


@pytest.mark.parametrize("fail", ["load", "infer"])
async def test_a_failed_action_raises_and_unloads(fail: str) -> None:
    executor = ScriptedExecutor({1: [1] * 10}, load_ns=[1] * 4, fail=fail)
    with pytest.raises(ProfilingError, match="failed"):
        await measure(executor.target(), "m", SPECS, (1,), CONFIG)
    assert isinstance(executor.sent[-1], Unload)


def test_percentile_is_nearest_rank() -> None:
    assert percentile_ns([5, 1, 3, 2, 4], 50.0) == 3
    assert percentile_ns([5, 1, 3, 2, 4], 99.0) == 5
    assert percentile_ns([5, 1, 3, 2, 4], 1.0) == 1
    assert percentile_ns(list(range(1, 11)), 90.0) == 9


def test_zero_batch_fills_dynamic_axes_with_one() -> None:
    batch = zero_batch((TensorSpec("a", "int64", (-1, 2, -1)),), 4)
    assert batch["a"].shape == (4, 2, 1) and str(batch["a"].dtype) == "int64"


def _profile() -> RegistrationProfile:
    return RegistrationProfile(
        (1, 2, 4),
        {"cpu": ModelProfile({1: 10, 2: 20, 4: 40}, 5), "sim": ModelProfile({1: 1, 2: 2, 4: 4}, 9)},
    )


def test_profile_json_round_trip() -> None:
    profile = _profile()
    assert RegistrationProfile.from_json(profile.to_json()) == profile


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        '{"version": 2}',
        '{"version": 1, "batch_sizes": [0], "kinds": {}}',
        '{"version": 1, "batch_sizes": [], "kinds": {}}',
        '{"version": 1, "batch_sizes": [1], "kinds": {"k": {"load_ns": 1, "execute_ns": {}}}}',
    ],
)
def test_bad_profile_json_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        RegistrationProfile.from_json(text)


def test_merge_offers_common_sizes_and_keeps_every_kind() -> None:
    other = RegistrationProfile((1, 2), {"gpu": ModelProfile({1: 3, 2: 4}, 1)})
    merged = _profile().merged(other)
    assert merged.batch_sizes == (1, 2)
    assert set(merged.kinds) == {"cpu", "sim", "gpu"}
    assert dict(merged.kinds["cpu"].execute_ns) == {1: 10, 2: 20}


def test_a_kind_missing_a_batch_size_is_refused() -> None:
    with pytest.raises(ValueError, match="lacks"):
        RegistrationProfile((1, 2), {"cpu": ModelProfile({1: 3}, 1)})


MS_NS = 1_000_000


async def test_each_action_reserves_its_lane_for_what_is_known_of_it() -> None:
    executor = ScriptedExecutor({1: [4 * MS_NS] * 4, 2: [6 * MS_NS] * 4}, load_ns=[MS_NS] * 2)
    config = ProfilerConfig(warmup_iterations=1, iterations=3, load_iterations=2)
    await measure(executor.target(), "m", SPECS, (1, 2), config)
    timed = [r for r in executor.reserved if r[0]]
    assert ("", 0) in executor.reserved  # UNLOADs hold no lane
    first_load, second_load, first_infer, second_infer = timed[:4]
    assert first_load == ("load", config.slow_execute_ns)  # nothing to go by: a guess
    assert second_load == ("load", 2 * MS_NS + 5 * MS_NS)  # twice the slowest seen, + 5 ms
    assert first_infer == ("execute", config.slow_execute_ns)
    assert second_infer == ("execute", 2 * 4 * MS_NS + 5 * MS_NS)
    first_b2 = timed[2 + 4]
    assert first_b2 == ("execute", 2 * 8 * MS_NS + 5 * MS_NS)  # linear bound from b1: 8 ms


async def test_a_slow_model_gets_one_warm_up_fewer_runs_and_fewer_batch_sizes() -> None:
    slow_ns = 400 * MS_NS
    executor = ScriptedExecutor({1: [slow_ns] * 10, 2: [2 * slow_ns] * 10}, load_ns=[MS_NS] * 2)
    config = ProfilerConfig(warmup_iterations=2, iterations=10, load_iterations=1)
    profile, sizes = await measure(executor.target(), "m", SPECS, (1, 2, 4, 8), config)
    infers = [m.batch_size for m in executor.sent if isinstance(m, Infer)]
    # b1: its first run is the warm-up, then slow_iterations (2); b2 likewise; b4's bound,
    # 4 x 400 ms = 1.6 s, is over max_execute_ns (1 s): not measured.
    assert infers == [1, 1, 1, 2, 2, 2]
    assert sizes == (1, 2) and profile.execute_ns[2] == 2 * slow_ns


async def test_what_the_time_cap_leaves_unmeasured_is_not_offered() -> None:
    executor = ScriptedExecutor({1: [30 * MS_NS] * 10, 2: [60 * MS_NS] * 10}, load_ns=[MS_NS])
    config = ProfilerConfig(
        warmup_iterations=1, iterations=2, load_iterations=1, max_profile_ns=200 * MS_NS
    )
    _, sizes = await measure(executor.target(), "m", SPECS, (1, 2), config)
    assert sizes == (1,)  # b2 (3 runs of a 60 ms bound) would not fit in what was left


async def test_a_batch_one_that_cannot_finish_within_the_cap_fails() -> None:
    executor = ScriptedExecutor({1: [300 * MS_NS] * 10}, load_ns=[MS_NS])
    config = ProfilerConfig(
        warmup_iterations=1, iterations=2, load_iterations=1, max_profile_ns=500 * MS_NS
    )
    with pytest.raises(ProfilingError, match="max_profile_ns"):
        await measure(executor.target(), "m", SPECS, (1,), config)
    assert isinstance(executor.sent[-1], Unload)

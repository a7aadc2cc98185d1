"""Clock offset estimation: exact arithmetic on hand-made ping exchanges."""

from __future__ import annotations

import pytest

from clockwork_async.runtime.clock_sync import ClockSample, ClockSync, ClockSyncError


def test_symmetric_round_trip_gives_exact_offset() -> None:
    sample = ClockSample.from_ping(sent_ns=1_000, peer_ns=50_500, received_ns=2_000)
    assert sample.offset_ns == 49_000
    assert sample.rtt_ns == 1_000


def test_pong_before_ping_is_rejected() -> None:
    with pytest.raises(ClockSyncError):
        ClockSample.from_ping(sent_ns=2_000, peer_ns=0, received_ns=1_000)


def test_no_samples_has_no_offset() -> None:
    sync = ClockSync()
    assert not sync.synced
    with pytest.raises(ClockSyncError):
        _ = sync.offset_ns


def test_minimum_rtt_sample_wins() -> None:
    sync = ClockSync(window=8)
    true_offset_ns = 7_000_000
    # A slow return leg biases the naive offset low; the fast sample is nearly exact.
    sync.add(0, 0 + 100 + true_offset_ns, 100 + 5_000)  # rtt 5.1 us, skewed
    sync.add(10_000, 10_000 + 50 + true_offset_ns, 10_100)  # rtt 100 ns, symmetric
    sync.add(20_000, 20_000 + 4_000 + true_offset_ns, 20_000 + 4_100)  # rtt 4.1 us, skewed
    assert sync.offset_ns == true_offset_ns
    assert sync.error_bound_ns == 50
    assert sync.sample_count == 3


def test_best_sample_ages_out_of_the_window() -> None:
    sync = ClockSync(window=2)
    sync.add(0, 500, 10)  # rtt 10, offset 495
    sync.add(100, 900, 200)  # rtt 100, offset 750
    assert sync.offset_ns == 495
    sync.add(300, 1_300, 500)  # rtt 200, offset 900; the rtt-10 sample is evicted
    assert sync.offset_ns == 750
    sync.add(600, 1_500, 800)  # rtt 200, offset 800; now both have rtt 200
    assert sync.offset_ns in {800, 900}


def test_ties_prefer_the_newest_sample() -> None:
    sync = ClockSync(window=4)
    sync.add(0, 1_000, 100)
    sync.add(1_000, 3_000, 1_100)
    assert sync.offset_ns == 3_000 - 1_050


def test_conversions_round_trip() -> None:
    sync = ClockSync()
    sync.add(1_000, 101_500, 2_000)
    assert sync.to_executor_ns(5_000) == 105_000
    assert sync.to_controller_ns(sync.to_executor_ns(123_456)) == 123_456


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ClockSync(window=0)

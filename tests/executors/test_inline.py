"""Which INFERs run on the executor's loop thread: the fastest recent run within the bound."""

from __future__ import annotations

from clockwork_async.executors.inline import RECENT_RUNS, ShortInfers


def test_an_infer_is_short_once_its_fastest_recent_run_fits_the_bound() -> None:
    short = ShortInfers("sim", max_ns=100)
    assert short.spare_ns("m", 1) is None  # never ran: its length is unknown
    short.ran("m", 1, 150)
    assert short.spare_ns("m", 1) is None
    short.ran("m", 1, 60)
    assert short.spare_ns("m", 1) == 40  # what the loop may also wait for the window
    short.ran("m", 1, 5_000)  # preempted once: the fastest recent run still says short
    assert short.spare_ns("m", 1) == 40
    assert short.spare_ns("m", 2) is None and short.spare_ns("other", 1) is None


def test_a_fast_run_is_forgotten_after_the_recent_runs() -> None:
    short = ShortInfers("cpu", max_ns=100)
    short.ran("m", 1, 10)
    for _ in range(RECENT_RUNS - 1):
        short.ran("m", 1, 500)
    assert short.spare_ns("m", 1) == 90
    short.ran("m", 1, 500)  # the fast run is no longer among the recent ones
    assert short.spare_ns("m", 1) is None


def test_device_backends_never_run_inline_and_unregistered_models_are_forgotten() -> None:
    device = ShortInfers("cuda:0", max_ns=100)
    device.ran("m", 1, 1)
    assert device.spare_ns("m", 1) is None  # a CUDA context belongs to the lane thread
    host = ShortInfers("cpu", max_ns=100)
    host.ran("m", 1, 1)
    host.ran("m", 4, 1)
    host.ran("n", 1, 1)
    host.forget("m")
    assert host.spare_ns("m", 1) is None and host.spare_ns("m", 4) is None
    assert host.spare_ns("n", 1) == 99

"""Which INFERs the executor runs on its event loop thread instead of in the execute lane.

Handing an action to a lane thread and bringing its result back costs two thread wake-ups,
a GIL hand-off and a write to the loop's wake-up descriptor: about 30-40 µs on a quiet 2-vCPU
VM, and hundreds when other processes share the CPU (a lane thread running ``SCHED_IDLE``
waits behind all of them). For an action shorter than that the hop is most of its round trip,
so the host runs it where it was read (`host.py`, `lanes.Lane.run_now`).

Invariants:
- An INFER is short when the last run of its model at its batch size took at most
  ``max_ns`` (start to result built, as its lane would measure it); one never run is not.
  So the loop thread is never held longer than about the hop it saves, and longer actions
  leave it free for pings and the other lanes' actions.
- Only backends whose device is host memory (``cpu``, ``sim``) run inline: a device backend's
  calls may need state of the lane thread that made them (a CUDA context, its streams).
- Safe from any thread: one dict, single reads and writes (atomic under the GIL); a model's
  entries go when it is unregistered.
"""

from __future__ import annotations

# The hop measured on the 2-vCPU VM is 30-40 µs quiet, far more when shared; a bound of a few
# hops keeps the stall of the loop within what one hop costs under load.
INLINE_MAX_NS = 100_000
INLINE_DEVICES = frozenset({"cpu", "sim"})  # backends whose calls need no per-thread context


class ShortInfers:
    """The last measured run of each (model, batch size), and whether an INFER is short."""

    def __init__(self, device: str, max_ns: int = INLINE_MAX_NS) -> None:
        self._max_ns = max_ns if device in INLINE_DEVICES else 0  # 0: nothing is short
        self._last_ns: dict[tuple[str, int], int] = {}

    def short(self, model: str, batch_size: int) -> bool:
        last_ns = self._last_ns.get((model, batch_size))
        return last_ns is not None and last_ns <= self._max_ns

    def ran(self, model: str, batch_size: int, duration_ns: int) -> None:
        self._last_ns[(model, batch_size)] = duration_ns

    def forget(self, model: str) -> None:
        for key in list(self._last_ns):  # list(): one step, while other lanes may add
            if key[0] == model:
                self._last_ns.pop(key, None)

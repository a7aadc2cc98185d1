"""Which INFERs the executor runs on its event loop thread instead of in the execute lane.

Handing an action to a lane thread and bringing its result back costs two thread wake-ups,
a GIL hand-off and a write to the loop's wake-up descriptor: about 30-40 µs on a quiet 2-vCPU
VM, and hundreds when other processes share the CPU (a lane thread running ``SCHED_IDLE``
waits behind all of them). For an action shorter than that the hop is most of its round trip,
so the host runs it where it was read (`host.py`, `lanes.Lane.run_now`).

Invariants:
- An INFER is short when the fastest of the last ``RECENT_RUNS`` runs of its model at its
  batch size took at most ``max_ns`` (start to result built, as its lane measures it); one
  never run is not. The fastest, not the last: a run the kernel preempted (another process on
  the CPU) says nothing about the action, and would send every later one to the lane, where
  an idle-class thread runs slower still. Its window may open up to the spare time
  (``max_ns`` less that run) later: the loop thread waits for it. So the loop thread is held
  about ``max_ns`` at most, about the hop it saves, and longer actions leave it free for pings
  and the other lanes' actions.
- Only backends whose device is host memory (``cpu``, ``sim``) run inline: a device backend's
  calls may need state of the lane thread that made them (a CUDA context, its streams).
- Safe from any thread: dicts of immutable values, single reads and writes (atomic under the
  GIL); one INFER runs at a time per executor, so its runs are recorded one at a time; a
  model's entries go when it is unregistered.
"""

from __future__ import annotations

# The hop measured on the 2-vCPU VM is 30-40 µs quiet, far more when shared; a bound of a few
# hops keeps the stall of the loop within what one hop costs under load.
INLINE_MAX_NS = 100_000
INLINE_DEVICES = frozenset({"cpu", "sim"})  # backends whose calls need no per-thread context
RECENT_RUNS = 8


class ShortInfers:
    """The recent runs of each (model, batch size), and whether an INFER is short."""

    def __init__(self, device: str, max_ns: int = INLINE_MAX_NS) -> None:
        self._max_ns = max_ns if device in INLINE_DEVICES else 0  # 0: nothing is short
        self._recent_ns: dict[tuple[str, int], tuple[int, ...]] = {}
        self._fastest_ns: dict[tuple[str, int], int] = {}

    def spare_ns(self, model: str, batch_size: int) -> int | None:
        """How much shorter than ``max_ns`` the INFER's fastest recent run was (what the
        loop may also spend waiting for its window to open); None when it is not short."""
        fastest_ns = self._fastest_ns.get((model, batch_size))
        if fastest_ns is None or fastest_ns > self._max_ns:
            return None
        return self._max_ns - fastest_ns

    def ran(self, model: str, batch_size: int, duration_ns: int) -> None:
        key = (model, batch_size)
        recent_ns = (*self._recent_ns.get(key, ())[1 - RECENT_RUNS :], duration_ns)
        self._recent_ns[key] = recent_ns
        self._fastest_ns[key] = min(recent_ns)

    def forget(self, model: str) -> None:
        for key in list(self._recent_ns):  # list(): one step, while other lanes may add
            if key[0] == model:
                self._recent_ns.pop(key, None)
                self._fastest_ns.pop(key, None)

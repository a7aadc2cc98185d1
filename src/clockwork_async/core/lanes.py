"""One lane of an executor (execute or load), as the core predicts it: one action at a time.

Invariants: a lane runs one action at a time, in the order the core committed them; its
``end_ns`` is the predicted end of the last committed action, chained from the last measured
end (``base_ns``) through each outstanding action's ``max(earliest, previous end) + predicted``.
An action's ``earliest_ns`` is when it may start, not when it is planned to: an INFER may
start as soon as it is sent (the lane is work-conserving: an action that ends before its
prediction lets the next one start early, on the executor and in this chain).
Results correct the chain; a lane that falls behind (its first outstanding action is past
its predicted end without a result) is resynchronised: that action is assumed to end now.
"""

from __future__ import annotations

from .profiles import SlidingWindow

OVERRUN_WINDOW = 16  # executions whose overrun of their prediction a lane remembers


class Planned:
    """What a lane reads and writes of the work on it: the base of entities.Action and
    entities.Reservation, which set these fields. A base class, not a Protocol: compiled with
    mypyc, a field is then read and written in place instead of looked up by name (and each
    int boxed), several times per request."""

    __slots__ = ("earliest_ns", "planned_end_ns", "predicted_ns")

    earliest_ns: int
    predicted_ns: int
    planned_end_ns: int


class Lane:
    """One lane of an executor (execute or load): strictly one action at a time."""

    __slots__ = (
        "_overrun_slot",
        "base_ns",
        "cold_extra",
        "cold_extra_ns",
        "end_ns",
        "lead_ns",
        "outstanding",
        "overrun_ns",
        "overruns",
        "resyncs",
        "warm_gap_ns",
    )

    def __init__(self, warm_gap_ns: int = 0, size: int = 1, percentile: float = 100.0) -> None:
        # Committed, no result yet, in order (a list, not a deque: compiled with mypyc, a
        # deque's methods are generic calls; a lane holds a few actions).
        self.outstanding: list[Planned] = []
        self.base_ns = 0  # measured end of the last finished action
        self.end_ns = 0  # predicted end of all committed work
        self.lead_ns = 0  # an action sent now starts no earlier than this from now
        self.resyncs = 0
        # Cold starts (warm_gap_ns > 0): an action that follows more than warm_gap_ns of idle
        # time takes longer than its (back-to-back) prediction by about cold_extra_ns.
        self.warm_gap_ns = warm_gap_ns
        self.cold_extra = SlidingWindow(size, percentile, 0) if warm_gap_ns else None
        self.cold_extra_ns = 0
        # How far the last OVERRUN_WINDOW back-to-back executions ran over their predictions
        # (0 for those that did not), and the largest: admission leaves that much room. A
        # ring (a list, not a deque: compiled, a deque's methods are generic calls); once
        # full, ``_overrun_slot`` is the oldest's slot.
        self.overruns: list[int] = []
        self._overrun_slot = 0
        self.overrun_ns = 0

    def note_overrun(self, over_ns: int) -> None:
        """Count an execution's measured minus predicted duration in ``overrun_ns``."""
        overruns = self.overruns
        over_ns = max(over_ns, 0)
        if len(overruns) < OVERRUN_WINDOW:
            overruns.append(over_ns)
        else:  # the new value takes the oldest's slot
            slot = self._overrun_slot
            oldest_ns = overruns[slot]
            overruns[slot] = over_ns
            self._overrun_slot = (slot + 1) % OVERRUN_WINDOW
            # overrun_ns is the window's maximum. Only when the maximum leaves and the new
            # value is below it must the window be searched again (most executions end on
            # time: 0, 0).
            if oldest_ns == self.overrun_ns and over_ns < oldest_ns:
                self.overrun_ns = max(overruns)
                return
        self.overrun_ns = max(self.overrun_ns, over_ns)

    def free_at(self, now_ns: int) -> int:
        """Return when the lane is predicted to be free (may be before ``now_ns`` when idle)."""
        outstanding = self.outstanding
        if outstanding and outstanding[0].planned_end_ns < now_ns:
            self._resync(now_ns)
        return self.end_ns

    def start_for(self, now_ns: int) -> int:
        """Return the earliest start for a new action: ``max(now + lead, free_at)``; after an
        idle gap over ``warm_gap_ns``, ``cold_extra_ns`` later (it ends that much later)."""
        free_ns = self.free_at(now_ns)
        ready_ns = now_ns + self.lead_ns
        if free_ns >= ready_ns:
            return free_ns
        if ready_ns - free_ns > self.warm_gap_ns:
            ready_ns += self.cold_extra_ns
        return ready_ns

    def is_cold_now(self, now_ns: int) -> bool:
        """Return True when nothing is committed and an action starting now would be a cold
        start (``is_cold_start``)."""
        return not self.outstanding and self.is_cold_start(now_ns)

    def is_cold_start(self, start_ns: int) -> bool:
        """Return True when an action that started at ``start_ns`` (measured) followed more
        than ``warm_gap_ns`` of idle time; always False with cold starts off."""
        return self.cold_extra is not None and start_ns - self.base_ns > self.warm_gap_ns

    def learn_cold_extra(self, extra_ns: int, now_ns: int) -> None:
        """Add one cold start's measured minus predicted duration (``is_cold_start`` held)."""
        if self.cold_extra is not None:
            self.cold_extra.add(max(0, extra_ns), now_ns)
            self.cold_extra_ns = self.cold_extra.value_ns

    def relax_cold_extra(self, now_ns: int, stale_ns: int, factor: float) -> None:
        """Let a stale cold-start window forget an outlier (profiles.py "Recovery")."""
        if self.cold_extra is not None and self.cold_extra.forget_outlier(now_ns, stale_ns, factor):
            self.cold_extra_ns = self.cold_extra.value_ns

    def commit(self, action: Planned, start_ns: int) -> None:
        """Append ``action``, planned to start at ``start_ns`` (``start_for(now)``, no earlier
        than its ``earliest_ns``), to the lane."""
        action.planned_end_ns = start_ns + action.predicted_ns
        self.outstanding.append(action)
        self.end_ns = action.planned_end_ns

    def hold(self, action: Planned, until_ns: int) -> None:
        """``action`` (outstanding, past its predicted end, no result yet) is assumed to run
        until ``until_ns``: it is planned that much longer and the chain behind it moves
        (a lane reservation runs until released: reservations.py)."""
        if action.planned_end_ns < until_ns:
            action.predicted_ns += until_ns - action.planned_end_ns
            self._chain(self.base_ns)

    def finish(self, action: Planned, ended_ns: int) -> None:
        """Remove ``action`` (result in, or executor gone); re-chain from ``ended_ns``."""
        try:
            self.outstanding.remove(action)
        except ValueError:
            return
        self.base_ns = max(self.base_ns, ended_ns)
        self._chain(self.base_ns)

    def _resync(self, now_ns: int) -> None:
        self.resyncs += 1
        first = self.outstanding[0]
        first.planned_end_ns = now_ns
        end_ns = now_ns
        for action in self.outstanding[1:]:
            action.planned_end_ns = max(action.earliest_ns, end_ns) + action.predicted_ns
            end_ns = action.planned_end_ns
        self.end_ns = end_ns

    def _chain(self, from_ns: int) -> None:
        end_ns = from_ns
        for action in self.outstanding:
            action.planned_end_ns = max(action.earliest_ns, end_ns) + action.predicted_ns
            end_ns = action.planned_end_ns
        self.end_ns = end_ns

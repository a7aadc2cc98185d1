"""The ways to and from an executor, budgeted in every plan.

The way back: the core plans an action to *end* on its executor by a request's deadline, but
the answer is judged when it reaches the controller: after the result's write, the executor's
wake-up, the socket and the controller's decode (measured here at 0.2-0.5 ms on a 2-vCPU VM,
more under load). The dispatcher therefore tells the core the return hop's `HopEstimate`
(`ReturnHop`), which the core subtracts from each new request's deadline when it plans; the
core then judges each answer against the request's true deadline (an ``ok`` that would still
leave after it goes ``late``, and its way out is a sample: `Hops.on_late_way_out`).

The way there: an action sent now cannot start before the executor has read it (the rest of
the core's handling, the encode, the socket, the executor's wake-up and decode). Each executor
has a `HopEstimate` of sent-to-read (the executor reports ``received_ns``), and the core plans
new actions on an idle lane no earlier than that from now (`ExecutorLead`); without it an
INFER planned into an idle lane at a tight SLO reaches the executor after its latest start and
is rejected ``too_late`` (seen: at a 3.4 ms SLO and 50 req/s, 203 of 205 INFERs).

Invariant: the estimate is the ``percentile`` of the last ``window`` measured hops (nearest
rank), times ``1 + slack``, clamped to [``floor_ns``, ``ceiling_ns``], as of the last multiple
of ``refresh_every`` samples (or of the last relief); before that it is ``initial_ns``.

Recovery: hops are only measured when actions run, and a tail left by a burst of contention can
make every request look infeasible, so that nothing runs to correct it (seen: after an overload
at a 24 ms SLO, a daemon refused every request at 5-7 ms SLOs). ``relieve`` therefore lets a
window that has had no sample for ``stale_ns`` forget its upper half (the samples over its
median), once per ``stale_ns``: the estimate falls to the typical hop, and the tail comes back
only if the next actions measure it again.
"""

from __future__ import annotations

from collections import deque

from clockwork_async.core.events import Event, ExecutorLead, ReturnHop
from clockwork_async.core.percentile import nearest_rank_index
from clockwork_async.wire.messages import ActionResult

INITIAL_NS = 500_000
FLOOR_NS = 50_000
CEILING_NS = 10_000_000
STALE_NS = 1_000_000_000


class HopEstimate:
    """A running estimate of one hop between the controller and an executor."""

    def __init__(
        self,
        *,
        window: int = 256,
        percentile: float = 99.0,
        slack: float = 0.1,
        initial_ns: int = INITIAL_NS,
        floor_ns: int = FLOOR_NS,
        ceiling_ns: int = CEILING_NS,
        refresh_every: int = 16,
        stale_ns: int = STALE_NS,
    ) -> None:
        self._samples: deque[int] = deque(maxlen=window)
        self._percentile = percentile
        self._slack = slack
        self._floor_ns = floor_ns
        self._ceiling_ns = ceiling_ns
        self._refresh_every = refresh_every
        self._since_update = 0
        self._stale_ns = stale_ns
        self._sampled_ns = 0  # when the last sample came, or the window was last relieved
        self.estimate_ns = initial_ns

    def add(self, hop_ns: int, now_ns: int) -> None:
        """Add one measured hop; the estimate is recomputed every ``refresh_every`` samples
        (a sort of the window: kept off the per-request path)."""
        self._samples.append(max(0, hop_ns))
        self._sampled_ns = now_ns
        self._since_update += 1
        if self._since_update >= self._refresh_every:
            self._since_update = 0
            self._update()

    def relieve(self, now_ns: int) -> bool:
        """Forget the upper half of a window that has had no sample for ``stale_ns`` (see the
        module's "Recovery"); returns whether it did. One comparison when not stale."""
        if now_ns - self._sampled_ns < self._stale_ns or len(self._samples) < 2:
            return False
        median_ns = sorted(self._samples)[(len(self._samples) - 1) // 2]
        kept = [hop_ns for hop_ns in self._samples if hop_ns <= median_ns]
        self._samples.clear()
        self._samples.extend(kept)
        self._sampled_ns = now_ns
        self._update()
        return True

    def _update(self) -> None:
        ordered = sorted(self._samples)
        rank = nearest_rank_index(len(ordered), self._percentile)
        padded_ns = int(ordered[rank] * (1.0 + self._slack))
        self.estimate_ns = min(self._ceiling_ns, max(self._floor_ns, padded_ns))


# The lead is the typical way there, not its tail: an action that arrives after its latest
# start is refused `too_late` without running and its requests are answered in time, while a
# p99 lead stacked on the p99 execute and return-hop predictions refused at arrival half of the
# requests a 5.6 ms SLO at 50 req/s would have served (docs/runtime.md).
WAY_THERE_PERCENTILE = 50.0


class Hops:
    """Both ways between the controller and its executors: one estimate of the way back and
    one of the way there per executor. Each change the core must hear of is returned (new
    values that ride with a result, or `ReturnHop` / `ExecutorLead` events when tails are
    relieved) for the caller to hand over; nothing here feeds anything."""

    def __init__(self) -> None:
        self.back = HopEstimate()
        self._there: dict[str, HopEstimate] = {}

    def initial(self) -> ReturnHop:
        """The way back before anything was measured, for the core at start."""
        return ReturnHop(self.back.estimate_ns)

    def forget(self, executor_id: str) -> None:
        """The executor left: a re-join measures its way there afresh."""
        self._there.pop(executor_id, None)

    def on_result(
        self, executor_id: str, sent_ns: int, offset_ns: int, result: ActionResult, now_ns: int
    ) -> tuple[int | None, int | None]:
        """Learn both ways from a result read at ``now_ns`` of an action sent at ``sent_ns``
        (``offset_ns``: the executor's clock minus ours). Returns the way back's and this
        executor's way there's new estimates where they changed (None where not): they go to
        the core with the result (`ActionFinished`)."""
        back_ns = there_ns = None
        if result.end_ns and _changed(self.back, now_ns - (result.end_ns - offset_ns), now_ns):
            back_ns = self.back.estimate_ns
        if result.received_ns:
            there = self._there.get(executor_id)
            if there is None:
                there = HopEstimate(percentile=WAY_THERE_PERCENTILE, slack=0.0, initial_ns=0)
                self._there[executor_id] = there
            if _changed(there, result.received_ns - offset_ns - sent_ns, now_ns):
                there_ns = there.estimate_ns
        return back_ns, there_ns

    def on_late_way_out(self, ended_ns: int, now_ns: int) -> ReturnHop | None:
        """A reply the core judged on time left after its deadline (`RequestBook.outcome`):
        its whole way, from the executor's end (``ended_ns``, our clock) to the reply leaving
        now, is a sample of the way back the judgment should have allowed. Returns the new
        estimate for the core where it changed."""
        if _changed(self.back, now_ns - ended_ns, now_ns):
            return ReturnHop(self.back.estimate_ns)
        return None

    def relieve(self, now_ns: int) -> list[Event]:
        """Let stale tails go (`HopEstimate.relieve`); returns the lower estimates' events."""
        events: list[Event] = []
        if self.back.relieve(now_ns):
            events.append(ReturnHop(self.back.estimate_ns))
        for executor_id, there in self._there.items():
            if there.relieve(now_ns):
                events.append(ExecutorLead(executor_id, there.estimate_ns))
        return events


def _changed(estimate: HopEstimate, hop_ns: int, now_ns: int) -> bool:
    before_ns = estimate.estimate_ns
    estimate.add(hop_ns, now_ns)
    return estimate.estimate_ns != before_ns

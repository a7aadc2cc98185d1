"""Feeding the controller core its events in order, measuring what it costs.

Invariants: events are handled strictly one after another in the order fed; an event fed while
another is being handled (a callback that submits, a send that failed) is queued and handled
right after it, so commands are always performed in the order the core returned them and the
core is never re-entered. ``now_ns`` is read for each event accepted and again to schedule.
The executors' actions among a handling's commands are performed before its replies.

Arrivals (`feed_arrival`) are held until the ``defer``red flush, at the end of the event loop's
current round, until the next other event, or until ``max_held`` are held, whichever comes
first: requests decoded from one socket read reach the core together and are scheduled once,
so they can share a batch, and a burst still starts being served while the rest is decoded.
Each arrival is still accepted on its own (a refused one is answered alone).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from clockwork_async.core.controller import Controller
from clockwork_async.core.errors import ControllerError
from clockwork_async.core.events import (
    Command,
    Event,
    Reply,
    RequestArrived,
    StartInfer,
    StartLoad,
    StartUnload,
)
from clockwork_async.core.outcomes import Outcome

log = logging.getLogger(__name__)

Perform = Callable[[Command, int], int]  # (command, now_ns) -> ns spent in callers' callbacks
AfterEvent = Callable[[Event], None]
Defer = Callable[[Callable[[], None]], object]  # run this soon, once (e.g. loop.call_soon)
_ACTIONS = (StartUnload, StartLoad, StartInfer)
MAX_HELD_ARRIVALS = 32  # twice the largest usual batch; more are flushed at once


class CoreRunner:
    """Runs ``controller`` on fed events; ``perform`` carries out each command."""

    def __init__(
        self,
        controller: Controller,
        now_ns: Callable[[], int],
        perform: Perform,
        after: AfterEvent = lambda _event: None,
        *,
        defer: Defer | None = None,
        max_held: int = MAX_HELD_ARRIVALS,
        performed: Callable[[], None] = lambda: None,
    ) -> None:
        self.controller = controller
        self.core_ns = 0  # time inside the controller
        self.dispatch_ns = 0  # time handling events (core + performing), less callers' callbacks
        self._now_ns = now_ns
        self._perform = perform
        self._after = after
        self._defer = defer
        self._max_held = max_held
        self._performed = performed  # after each handling's commands (e.g. flush the writes)
        self._events: deque[Event | list[RequestArrived]] = deque()
        self._arrivals: list[RequestArrived] = []  # held for the deferred flush
        self._dispatching = False

    def feed(self, event: Event) -> None:
        """Handle ``event`` now (after any held arrivals), or right after the one being
        handled."""
        self._take_arrivals()
        self._events.append(event)
        self._run()

    def feed_arrival(self, event: RequestArrived) -> None:
        """Hold ``event`` for the deferred flush (handled at once without ``defer``)."""
        if self._defer is None:
            self.feed(event)
            return
        if not self._arrivals:
            self._defer(self.flush)
        self._arrivals.append(event)
        if len(self._arrivals) >= self._max_held:
            self.flush()  # a burst: schedule what came so far while the rest is decoded

    def flush(self) -> None:
        """Handle the held arrivals now, together."""
        self._take_arrivals()
        self._run()

    def _take_arrivals(self) -> None:
        if self._arrivals:
            self._events.append(self._arrivals)
            self._arrivals = []

    def _run(self) -> None:
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self._events:
                self._handle(self._events.popleft())
        finally:
            self._dispatching = False

    def _handle(self, item: Event | list[RequestArrived]) -> None:
        started_ns = time.perf_counter_ns()
        events = item if isinstance(item, list) else [item]
        refused: list[Command] = []
        for event in events:
            try:
                self.controller.accept(event, self._now_ns())
            except ControllerError:
                log.exception("the controller refused %r", event)
                refused += _after_refusal(event)
        now_ns = self._now_ns()  # accepting many takes a while: schedule from the time now
        commands = self.controller.schedule(now_ns) + refused
        self.core_ns += time.perf_counter_ns() - started_ns
        callbacks_ns = 0
        for command in _actions_first(commands):
            callbacks_ns += self._perform(command, now_ns)
        self._performed()
        for event in events:
            self._after(event)
        self.dispatch_ns += time.perf_counter_ns() - started_ns - callbacks_ns


def _actions_first(commands: list[Command]) -> list[Command]:
    """``commands`` with the executors' actions first (in their order: an unload stays before
    the load that needs its pages): answering many requests takes a while, and an action's
    window is reckoned from the moment the core returned it."""
    actions = [c for c in commands if isinstance(c, _ACTIONS)]
    if not actions or len(actions) == len(commands):
        return commands
    return actions + [c for c in commands if not isinstance(c, _ACTIONS)]


def _after_refusal(event: Event) -> list[Command]:
    """A refused arrival is still answered (the core keeps no state of it)."""
    if isinstance(event, RequestArrived):
        return [Reply(event.request_id, Outcome.FAILED, "the controller refused it")]
    return []

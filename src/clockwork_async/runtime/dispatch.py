"""Feeding the controller core one event at a time, in order, measuring what it costs.

Invariants: events are handled strictly one after another in the order fed; an event fed while
another is being handled (a callback that submits, a send that failed) is queued and handled
right after it, so commands are always performed in the order the core returned them and the
core is never re-entered. ``now_ns`` is read once per event, when its handling starts.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from clockwork_async.core.controller import Controller
from clockwork_async.core.errors import ControllerError
from clockwork_async.core.events import Command, Event, Reply, RequestArrived
from clockwork_async.core.outcomes import Outcome

log = logging.getLogger(__name__)

Perform = Callable[[Command, int], int]  # (command, now_ns) -> ns spent in callers' callbacks
AfterEvent = Callable[[Event], None]


class CoreRunner:
    """Runs ``controller`` on fed events; ``perform`` carries out each command."""

    def __init__(
        self,
        controller: Controller,
        now_ns: Callable[[], int],
        perform: Perform,
        after: AfterEvent = lambda _event: None,
    ) -> None:
        self.controller = controller
        self.core_ns = 0  # time inside Controller.handle
        self.dispatch_ns = 0  # time handling events (core + performing), less callers' callbacks
        self._now_ns = now_ns
        self._perform = perform
        self._after = after
        self._events: deque[Event] = deque()
        self._dispatching = False

    def feed(self, event: Event) -> None:
        """Handle ``event`` now, or right after the event being handled."""
        self._events.append(event)
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self._events:
                self._handle(self._events.popleft())
        finally:
            self._dispatching = False

    def _handle(self, event: Event) -> None:
        started_ns = time.perf_counter_ns()
        now_ns = self._now_ns()
        try:
            commands = self.controller.handle(event, now_ns)
        except ControllerError:
            log.exception("the controller refused %r", event)
            commands = _after_refusal(event)
        self.core_ns += time.perf_counter_ns() - started_ns
        callbacks_ns = 0
        for command in commands:
            callbacks_ns += self._perform(command, now_ns)
        self._after(event)
        self.dispatch_ns += time.perf_counter_ns() - started_ns - callbacks_ns


def _after_refusal(event: Event) -> list[Command]:
    """A refused arrival is still answered (the core keeps no state of it)."""
    if isinstance(event, RequestArrived):
        return [Reply(event.request_id, Outcome.FAILED, "the controller refused it")]
    return []

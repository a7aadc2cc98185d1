"""The core's action commands, sent to executors, and their results, back to the core.

Invariants:
- An action is in the book from the moment it is sent until its ActionFinished is handled or
  its executor leaves; a result for an action no longer in the book is ignored, so an action
  is resolved once.
- An action that cannot be sent (no such executor or model, its requests gone, a message that
  cannot be encoded) is reported to the core at once as ``internal``; a link found dead while
  sending is failed, and the core re-plans its work when the executor leaves.
- The actions of one handling are written together at its end (`flush`), never held for the
  rest of a loop round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from clockwork_async.connection import ConnectionClosed
from clockwork_async.core.events import (
    ActionFinished,
    Event,
    ExecutorLead,
    StartInfer,
    StartLoad,
    StartUnload,
)
from clockwork_async.runtime.executor_link import ExecutorLink, LinkDown
from clockwork_async.runtime.executors import ExecutorPool
from clockwork_async.runtime.hop import HopEstimate
from clockwork_async.runtime.models import RegisteredModel
from clockwork_async.runtime.requests import ActionRecord, RequestBook
from clockwork_async.runtime.snapshot import PredictionErrors
from clockwork_async.wire.messages import ActionResult, Message

log = logging.getLogger(__name__)

# The lead is the typical way there, not its tail: an action that arrives after its latest
# start is refused `too_late` without running and its requests are answered in time, while a
# p99 lead stacked on the p99 execute and return-hop predictions refused at arrival half of the
# requests a 5.6 ms SLO at 50 req/s would have served (docs/runtime.md).
WAY_THERE_PERCENTILE = 50.0

ActionListener = Callable[[ActionRecord, ActionResult], None]


class Actions:
    """Sends the core's actions over executor links and feeds their results back."""

    def __init__(
        self,
        book: RequestBook,
        pool: ExecutorPool,
        models: Mapping[str, RegisteredModel],
        feed: Callable[[Event], None],
        now_ns: Callable[[], int],
        listeners: Sequence[ActionListener],
    ) -> None:
        self._book = book
        self._pool = pool
        self._models = models
        self._feed = feed
        self._now_ns = now_ns
        self._listeners = listeners
        self._written: set[ExecutorLink] = set()  # links with actions held back this round
        self.send_ns = 0  # time encoding and writing actions to executor sockets
        self.return_hop = HopEstimate()
        self.way_there: dict[str, HopEstimate] = {}  # by executor id: sent -> read there
        self.prediction_errors = PredictionErrors()

    def start_infer(self, command: StartInfer, now_ns: int) -> None:
        link = self._pool.link_for(command.executor_id)
        model = self._models.get(command.model)
        if link is None or model is None:
            self._failed(command.executor_id, command.action_id, "no such executor/model")
            return
        action = ActionRecord.infer(command, now_ns)
        message = self._book.infer_message(action, model.inputs, link.clock.offset_ns)
        if message is None:
            self._failed(command.executor_id, command.action_id, "its requests are gone")
            return
        self._send(link, action, message)

    def start_weights(self, command: StartLoad | StartUnload, now_ns: int) -> None:
        link = self._pool.link_for(command.executor_id)
        if link is None:
            self._failed(command.executor_id, command.action_id, "no such executor")
        elif isinstance(command, StartLoad):
            action = ActionRecord.load(command, now_ns)
            self._send(link, action, action.load_message(link.clock.offset_ns))
        else:
            action = ActionRecord.unload(command, now_ns)
            self._send(link, action, action.unload_message())

    def flush(self) -> None:
        """The actions of one handling went out together; write them now, not at the end of
        a loop round that may be long (a burst of arrivals)."""
        for link in self._written:
            link.flush()
        self._written.clear()

    def _send(self, link: ExecutorLink, action: ActionRecord, message: Message) -> None:
        self._book.add_action(action)
        started_ns = time.perf_counter_ns()
        try:
            link.send_action(message, action.action_id, partial(self._on_result, link, action))
            self._written.add(link)
            self.send_ns += time.perf_counter_ns() - started_ns
        except (LinkDown, ConnectionClosed) as error:
            # The socket died before the reader noticed: the executor leaves now, and the core
            # re-plans this action's requests with the rest of its work.
            link.fail(f"sending failed: {error}")
        except Exception as error:  # EncodeError or a bug: this action alone fails
            log.exception("sending action %d to %s failed", action.action_id, action.executor_id)
            self._book.finish_action(action.action_id)
            self._failed(action.executor_id, action.action_id, str(error))

    def relieve(self, now_ns: int) -> None:
        """Let stale hop tails go (`HopEstimate.relieve`); tell the core of a lower lead."""
        self.return_hop.relieve(now_ns)
        for executor_id, estimate in self.way_there.items():
            if estimate.relieve(now_ns):
                self._feed(ExecutorLead(executor_id, estimate.estimate_ns))

    def _note_way_there(self, executor_id: str, there_ns: int, now_ns: int) -> None:
        estimate = self.way_there.get(executor_id)
        if estimate is None:
            estimate = HopEstimate(percentile=WAY_THERE_PERCENTILE, slack=0.0, initial_ns=0)
            self.way_there[executor_id] = estimate
        before_ns = estimate.estimate_ns
        estimate.add(there_ns, now_ns)
        if estimate.estimate_ns != before_ns:
            self._feed(ExecutorLead(executor_id, estimate.estimate_ns))

    def _failed(self, executor_id: str, action_id: int, why: str) -> None:
        log.debug("action %d on %s not sent: %s", action_id, executor_id, why)
        self._feed(ActionFinished(executor_id, action_id, code="internal"))

    def _on_result(self, link: ExecutorLink, action: ActionRecord, message: Message) -> None:
        if self._book.action(action.action_id) is not action:
            return  # resolved already (its executor left)
        if not isinstance(message, ActionResult):
            message = ActionResult(action.action_id, "internal", f"unexpected {message!r}")
        self._note(link, action, message)
        for listener in self._listeners:
            try:
                listener(action, message)
            except Exception:
                log.exception("an action listener raised")
        self._feed(action.finished_event(message, link.clock.offset_ns))

    def _note(self, link: ExecutorLink, action: ActionRecord, result: ActionResult) -> None:
        """Keep what the result tells: timings, the way back, pages, loaded models, errors."""
        action.result = result
        action.received_ns = self._now_ns()
        action.offset_ns = link.clock.offset_ns
        if result.end_ns:
            hop_ns = action.received_ns - (result.end_ns - action.offset_ns)
            self.return_hop.add(hop_ns, action.received_ns)
        if result.received_ns:
            there_ns = result.received_ns - action.offset_ns - action.sent_ns
            self._note_way_there(action.executor_id, there_ns, action.received_ns)
        record = self._pool.records.get(action.executor_id)
        if record is not None:
            record.pages_free = result.pages_free or record.pages_free
            action.track_loaded(record.loaded, result)
        if action.kind == "infer" and result.ok:
            error_ns = result.durations_ns.get("execute", 0) - action.predicted_ns
            self.prediction_errors.add(action.model, error_ns)

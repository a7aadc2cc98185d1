"""The door: the answers the dispatcher gives without the core, before a request is admitted.

A request is refused at the door when the server is draining (``shutting_down``), when the
daemon's own loop is too far behind to meet its deadline (``overloaded``), when its model is
not served (``unknown_model``) or when its tensors do not fit the model (``bad_input``, which
the core never sees). A request for a model served by shape buckets is first routed to the
variant of its bucket (`_route`, runtime/buckets.py: padded where the model pads), or refused
``bad_input`` when no bucket holds it. `screen` asks the loop question from a frame's header
alone, so that an ``overloaded`` request's tensors are never kept; `refuse` answers it.

Invariants:
- The door changes nothing it refuses for: `screen` and `_refusal` only read; a refused
  request is answered before `submit` (or `refuse`) returns, through the request book like
  every other answer.
- A request's deadline is resolved in one place (`_deadline_ns`), for `submit` and `screen`
  alike: its Unix deadline if it has one, else its SLO, else its model's default SLO (a
  bucketed model's: its largest bucket's; `DEFAULT_SLO_NS` for a model that is not served:
  it is refused anyway). `screen` may be told how long the request already waited for the
  loop (``waited_ns``: an HTTP request with JSON tensors, screened before its parse): its SLO
  then counts from before that wait, which is also the loop's measured delay for it
  (`LoopLane.refusal`); an admitted request's deadline counts from `submit`, as every one's.
- A request for a model that is not bucketed never enters runtime/buckets.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.outcomes import Outcome
from clockwork_async.runtime.batching import BadInput, validate_request
from clockwork_async.runtime.buckets import Routed, route
from clockwork_async.runtime.dispatch_state import DispatcherHoldings, DispatcherState
from clockwork_async.runtime.requests import PendingRequest, resolve_deadline_ns

DEFAULT_SLO_NS = 100_000_000  # for requests to a model that is not registered (refused)


class Door(DispatcherHoldings):
    """The dispatcher's door (`Dispatcher` is one)."""

    def _deadline_ns(
        self,
        model: str,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        now_ns: int,
        waited_ns: int = 0,
    ) -> int:
        bucketed = self.buckets.get(model)
        served = self._models.get(bucketed.largest if bucketed is not None else model)
        default_slo_ns = served.default_slo_ns if served is not None else DEFAULT_SLO_NS
        deadline_ns = resolve_deadline_ns(
            slo_ns, deadline_unix_ns, default_slo_ns, now_ns=now_ns, unix_now_ns=self._unix_now_ns()
        )
        return deadline_ns if deadline_unix_ns is not None else deadline_ns - waited_ns

    def _route(
        self, model: str, inputs: Mapping[str, np.ndarray], on_reply: Callable[[InferOutcome], None]
    ) -> Routed | None:
        """Where a request for a bucketed model goes (`buckets.route`); None for any other."""
        bucketed = self.buckets.get(model)
        return route(bucketed, inputs, on_reply) if bucketed is not None else None

    def _refusal(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        slo_ns: int,
        now_ns: int,
        routed: Routed | None = None,
    ) -> tuple[Outcome, str] | None:
        """Why a request is answered at once, without the core: the server is draining, the
        daemon's own loop is too far behind for it (`_loop_refusal`), no bucket of its model
        holds it (``routed``), the model is unknown, or its tensors do not fit the model
        (which the core never sees)."""
        if self._state is not DispatcherState.RUNNING:
            return Outcome.SHUTTING_DOWN, "the server is shutting down"
        overloaded = self._loop_refusal(slo_ns, now_ns)
        if overloaded is not None:
            return Outcome.OVERLOADED, overloaded
        if routed is not None and routed.bad_input:
            return Outcome.BAD_INPUT, routed.bad_input
        served = self._models.get(model)
        if served is None:
            return Outcome.UNKNOWN_MODEL, f"model {model!r} is not registered"
        try:
            validate_request(model, served.inputs, served.batch_sizes, inputs)
        except BadInput as error:
            return Outcome.BAD_INPUT, str(error)
        return None

    def _loop_refusal(
        self, slo_ns: int, now_ns: int, waited_ns: int = 0, unread_ns: int = 0
    ) -> str | None:
        runtime = self.runtime
        share, cap_ns = runtime.loop_delay_share, runtime.max_loop_delay_ns
        return self._loop.refusal(
            slo_ns, now_ns, share=share, cap_ns=cap_ns, waited_ns=waited_ns, unread_ns=unread_ns
        )

    def screen(
        self,
        model: str,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        nbytes: int,
        waited_ns: int = 0,
        unread_ns: int = 0,
    ) -> str | None:
        """The door, from a frame's header (`api.service.Requests.screen`): why the loop
        cannot take this request (`_loop_refusal`; ``waited_ns``: how long it already waited
        for the loop after it was read, its SLO counting from before), or None. Changes
        nothing."""
        now_ns = self._now_ns()
        busy = self._loop.delay_ns(now_ns) or waited_ns or unread_ns
        if self._state is not DispatcherState.RUNNING or not busy:
            return None  # `submit` answers it shutting_down; an idle loop refuses nothing
        deadline_ns = self._deadline_ns(model, slo_ns, deadline_unix_ns, now_ns, waited_ns)
        return self._loop_refusal(deadline_ns - now_ns, now_ns, waited_ns, unread_ns)

    def refuse(
        self, model: str, reason: str, nbytes: int, on_reply: Callable[[InferOutcome], None]
    ) -> int:
        """Answer a request the door screened out ``overloaded`` (its tensors never kept)."""
        request_id = next(self._request_ids)
        now_ns = self._now_ns()
        request = PendingRequest(request_id, model, {}, on_reply, now_ns, now_ns)
        self._book.add_request(request)
        self._loop.book(now_ns, nbytes, admitted=False)
        self._answer_here(request, Outcome.OVERLOADED, reason)
        return request_id

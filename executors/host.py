"""The executor host: the model registry and page cache, changed by actions run in lane order.

One idea: what each action does to the executor's models and pages; every part of this module
is a step of one action (dispatch, run or reject, the action itself, its one reply). The lane
rules are `lane_rules`, the model state machine `model_entry`. Transport-free:
`controller_link.py` feeds it decoded actions and sends back its replies.

Invariants:
- Every action gets exactly one reply (`ActionResult`, `ModelInfo` or `State`), on the event
  loop thread (from a lane through ``post``); every `ActionResult` carries ``pages_free``.
- A model moves only as `model_entry` allows (``REGISTERING -> REGISTERED -> LOADING ->
  LOADED -> UNLOADING -> REGISTERED`` and the failure moves); any other move raises.
- Lanes, windows, order and when a LOAD waits for pages are the pure `lane_rules` (shared
  with the simulator): LOAD in the ``load`` lane, INFER and UNLOAD in the ``execute`` lane, an
  UNLOAD ahead of the INFERs waiting there, so an INFER ordered behind the UNLOAD of its model
  answers NOT_LOADED; a LOAD short of pages while UNLOADs are pending waits for them (at most
  ``UNLOAD_WAIT_NS``). RegisterModel/UnregisterModel run in a private ``register`` lane so
  reading model files never delays a timed action.
- A short INFER (`inline.ShortInfers`) runs on the event loop thread, its reply sent from
  there, when its lane is idle and its window open (`Lane.run_now`); any other goes to a lane.
- UNLOAD releases the backend's session (``backend.unload``) before its pages go back to the
  cache, and LOAD takes pages under the same lock: a page is never handed to a new model while
  a session can still read it. The host never evicts on its own.
- A backend exception answers INTERNAL (or its BackendError code) and the executor serves on.
- One lock guards registry and page cache, for bookkeeping only, never while a backend runs.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TypeVar

import numpy as np

from clockwork_async.ioarena.shared import MappedArena
from clockwork_async.lane_rules import (
    EXECUTE_LANE,
    LANE_OF,
    REGISTER_LANE,
    UNLOAD_WAIT_NS,
    UNTIMED,
    ActionKind,
    LoadVerdict,
    load_verdict,
)
from clockwork_async.wire.messages import (
    ActionResult,
    ErrorCode,
    ExecutorInfo,
    GetState,
    Infer,
    Load,
    Message,
    RegisterModel,
    State,
    Unload,
    UnregisterModel,
)

from .backend import Backend, BackendError, LoadedModel, PageRun, RegisteredModel
from .inline import INLINE_MAX_NS, ShortInfers
from .io_rows import run_rows, validate_rows
from .lanes import Lane, LaneClock, LaneClosed, LaneJob, Rejection, WarmClock
from .model_entry import ModelEntry, ModelState, model_info
from .pages import NoPages, PageCache
from .validation import Refused, validate_window

log = logging.getLogger(__name__)

Reply = Callable[[Message], None]
Post = Callable[[Callable[[], None]], object]  # run a callable on the event loop thread
ExecutorAction = RegisterModel | UnregisterModel | Load | Infer | Unload | GetState

A = TypeVar("A", RegisterModel, UnregisterModel, Load, Infer, Unload)
_S = ModelState


class ExecutorHost:
    """Owns the model registry and page cache; runs actions in lanes; answers each once."""

    def __init__(
        self,
        backend: Backend,
        page_cache: PageCache,
        *,
        clock: LaneClock | None = None,
        background_lanes: bool = False,
        keep_warm_ns: int = 0,
        inline_max_ns: int = INLINE_MAX_NS,
        io_arena: MappedArena | None = None,
    ) -> None:
        self.backend = backend
        self._short = ShortInfers(backend.device, inline_max_ns)  # run on the loop thread
        self.io_arena = io_arena  # the daemon's shared tensor memory, if it handed us one
        self._background_lanes = background_lanes  # lane threads yield to the event loop
        self._keep_warm_ns = keep_warm_ns  # the execute lane polls this long before it sleeps
        self._pages = page_cache
        self._clock = clock
        self._now_ns: Callable[[], int] = clock.now_ns if clock else time.monotonic_ns
        self._lock = threading.Lock()
        self._pages_freed = threading.Condition(self._lock)  # an UNLOAD ended (or close)
        self._unloading: set[str] = set()  # loaded models whose UNLOAD is pending
        self._models: dict[str, ModelEntry] = {}
        self._lanes: dict[str, Lane] = {}
        self._post: Post = operator.call  # until `start`: call at once
        self._closed = False

    # --- lifecycle ---------------------------------------------------------------------

    def start(self, post: Post) -> None:
        """Start the lanes; replies will be delivered through ``post`` (e.g. the loop's
        ``call_soon_threadsafe``)."""
        self._post = post
        names = (REGISTER_LANE, *self.backend.lanes)
        background = self._background_lanes
        self._lanes = {
            name: Lane(name, clock=self._lane_clock(name), background=background) for name in names
        }
        for lane in self._lanes.values():
            lane.start()

    def _lane_clock(self, name: str) -> LaneClock | None:
        """The injected clock, or for the execute lane a WarmClock when keeping warm."""
        if name == EXECUTE_LANE and self._keep_warm_ns and self._clock is None:
            return WarmClock(self._keep_warm_ns)
        return self._clock

    def close(self) -> None:
        """Close the lanes (the running actions finish; the queued ones answer INTERNAL),
        release every loaded model, then the backend. Blocking; call from a worker thread.
        Idempotent."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._pages_freed.notify_all()  # a LOAD waiting for pages stops waiting
        for lane in self._lanes.values():
            lane.close()
        with self._lock:
            entries = [entry for entry in self._models.values() if entry.loaded is not None]
        for entry in entries:
            self._release(entry)
        self.backend.close()

    def _release(self, entry: ModelEntry) -> None:
        """UNLOAD at shutdown: the same order as `_unload` (session first, then pages)."""
        assert entry.loaded is not None
        with self._lock:
            entry.move(_S.UNLOADING)
        try:
            self.backend.unload(entry.loaded)
        except Exception:
            log.exception("unloading %r at shutdown failed", entry.name)
            return
        with self._lock:
            self._pages.free(entry.runs)
            entry.runs, entry.loaded = (), None
            entry.move(_S.REGISTERED)

    # --- queries -------------------------------------------------------------------------

    @property
    def pages_free(self) -> int:
        with self._lock:
            return self._pages.pages_free

    def model_state(self, name: str) -> ModelState | None:
        with self._lock:
            entry = self._models.get(name)
            return entry.state if entry else None

    def state(self, action_id: int) -> State:
        """The executor's pages and models now."""
        with self._lock:
            states = {name: entry.state for name, entry in self._models.items()}
            pages_free = self._pages.pages_free
        return State(
            action_id=action_id,
            page_bytes=self.backend.arena.page_bytes,
            pages_total=self._pages.pages_total,
            pages_free=pages_free,
            registered=tuple(sorted(n for n, s in states.items() if s != _S.REGISTERING)),
            loaded=tuple(sorted(n for n, s in states.items() if s == _S.LOADED)),
        )

    def info(self, name: str) -> ExecutorInfo:
        """The ExecutorInfo that answers a controller's Hello."""
        backend = self.backend
        return ExecutorInfo(
            name=name,
            backend=backend.name,
            device=backend.device,
            kind=backend.kind,
            lanes=tuple(backend.lanes),
            page_bytes=backend.arena.page_bytes,
            pages_total=self._pages.pages_total,
            pages_free=self.pages_free,
            clock_ns=self._now_ns(),
            io_arena=self.io_arena.token if self.io_arena is not None else "",
        )

    # --- dispatch (event loop thread) ------------------------------------------------------

    def submit(self, action: ExecutorAction, reply: Reply) -> None:
        """Take one action; ``reply`` is called exactly once, on the loop thread (at once for
        GetState and for actions refused on arrival), with ``received_ns`` set in an
        ActionResult."""
        reply = partial(_stamped, reply, self._now_ns())
        try:
            self._dispatch(action, reply)
        except Refused as refused:
            reply(self._failure(action.action_id, refused.code, refused.message))

    def _dispatch(self, action: ExecutorAction, reply: Reply) -> None:
        if isinstance(action, GetState):
            reply(self.state(action.action_id))
        elif isinstance(action, RegisterModel):
            self._enqueue(ActionKind.REGISTER, UNTIMED, action, reply, self._register)
        elif isinstance(action, UnregisterModel):
            self._enqueue(ActionKind.UNREGISTER, UNTIMED, action, reply, self._unregister)
        elif isinstance(action, Load):
            validate_window(action.earliest_ns, action.latest_ns)
            self._require_known(action.model)
            window = (action.earliest_ns, action.latest_ns)
            self._enqueue(ActionKind.LOAD, window, action, reply, self._load)
        elif isinstance(action, Infer):
            validate_window(action.earliest_ns, action.latest_ns)
            validate_rows(self.io_arena, self._require_known(action.model), action)
            window = (action.earliest_ns, action.latest_ns)
            if not self._run_inline(action, reply):
                self._enqueue(ActionKind.INFER, window, action, reply, self._infer)
        else:
            self._require_known(action.model)
            self._expect_unload(action.model)
            self._enqueue(ActionKind.UNLOAD, UNTIMED, action, reply, self._unload)

    def _run_inline(self, action: Infer, reply: Reply) -> bool:
        """Run a short INFER on this (the loop) thread, replying from here, if its lane is
        idle and its window open (soon); False when it must go through the lane."""
        if (spare_ns := self._short.spare_ns(action.model, action.batch_size)) is None:
            return False
        run = partial(self._run_job, self._infer, action, reply)
        window = (action.earliest_ns, action.latest_ns)
        return self._lanes[EXECUTE_LANE].run_now(*window, run, wait_ns=spare_ns)

    def _expect_unload(self, name: str) -> None:
        """Note that the pages of ``name`` (if loaded) are about to be freed."""
        with self._lock:
            entry = self._models.get(name)
            if entry is not None and entry.state is _S.LOADED:
                self._unloading.add(name)

    def _require_known(self, name: str) -> RegisteredModel:
        """The registered model ``name``. Raises Refused(UNKNOWN_MODEL)."""
        with self._lock:
            entry = self._models.get(name)
            if entry is None or entry.registered is None:
                raise Refused(ErrorCode.UNKNOWN_MODEL, f"model {name!r} is not registered")
            return entry.registered

    def _enqueue(
        self,
        kind: ActionKind,
        window: tuple[int, int],
        action: A,
        reply: Reply,
        perform: Callable[[A, int], Message],
    ) -> None:
        earliest_ns, latest_ns = window
        job = LaneJob(
            earliest_ns=earliest_ns,
            latest_ns=latest_ns,
            run=partial(self._run_job, perform, action, partial(self._deliver, reply)),
            reject=partial(self._reject_job, action.action_id, latest_ns, reply),
        )
        try:
            self._lanes[LANE_OF[kind]].submit(job)
        except (LaneClosed, KeyError):
            raise Refused(ErrorCode.INTERNAL, "the executor is shutting down") from None

    # --- lane threads ----------------------------------------------------------------------

    def _run_job(
        self, perform: Callable[[A, int], Message], action: A, deliver: Reply, start_ns: int
    ) -> None:
        """Perform ``action``; ``deliver`` its answer (a post to the loop, or inline the reply)."""
        try:
            answer = perform(action, start_ns)
        except Refused as refused:
            answer = self._failure(action.action_id, refused.code, refused.message)
        except BackendError as error:
            answer = self._failure(action.action_id, error.code, error.message, start_ns)
        except Exception as error:
            log.exception("action %d failed in the backend", action.action_id)
            message = f"the backend failed: {type(error).__name__}: {error}"
            answer = self._failure(action.action_id, ErrorCode.INTERNAL, message, start_ns)
        deliver(answer)

    def _reject_job(
        self, action_id: int, latest_ns: int, reply: Reply, why: Rejection, now_ns: int
    ) -> None:
        if why is Rejection.TOO_LATE:
            late_us = (now_ns - latest_ns) / 1e3
            message = f"could not start by latest_ns ({late_us:.1f} us late); not run"
            answer = self._failure(action_id, ErrorCode.TOO_LATE, message)
        else:
            answer = self._failure(action_id, ErrorCode.INTERNAL, "the executor is shutting down")
        self._deliver(reply, answer)

    def _deliver(self, reply: Reply, answer: Message) -> None:
        try:
            self._post(partial(reply, answer))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            log.debug("dropped a reply after the event loop closed")

    def _failure(
        self, action_id: int, code: ErrorCode, message: str, start_ns: int = 0
    ) -> ActionResult:
        """An error result; ``start_ns`` set when the action ran (then end is now)."""
        return ActionResult(
            action_id=action_id,
            code=code.value,
            message=message,
            start_ns=start_ns,
            end_ns=self._now_ns() if start_ns else 0,
            pages_free=self.pages_free,
        )

    def _success(
        self,
        action_id: int,
        start_ns: int,
        durations_ns: Mapping[str, int],
        outputs: Mapping[str, np.ndarray] | None = None,
    ) -> ActionResult:
        return ActionResult(
            action_id=action_id,
            start_ns=start_ns,
            end_ns=self._now_ns(),
            durations_ns=dict(durations_ns),
            outputs=dict(outputs or {}),
            pages_free=self.pages_free,
            device_clock_mhz=self._device_clock_mhz(),
        )

    def _device_clock_mhz(self) -> int:
        """The backend's device clock (GPU backends have ``device_clock_mhz()``), else 0."""
        read = getattr(self.backend, "device_clock_mhz", None)
        return int(read()) if read is not None else 0

    # --- the actions, each run in its lane -----------------------------------------------------

    def _register(self, action: RegisterModel, start_ns: int) -> Message:
        with self._lock:
            if action.model in self._models:
                raise Refused(ErrorCode.BAD_MODEL, f"model {action.model!r} is already registered")
            entry = self._models[action.model] = ModelEntry(action.model)
            entry.move(_S.REGISTERING)
        try:
            registered = self.backend.register(
                action.model, action.path, action.batch_sizes, action.inputs
            )
        except BaseException:
            with self._lock:
                entry.move(None)
                del self._models[action.model]
            raise
        with self._lock:
            entry.registered = registered
            entry.move(_S.REGISTERED)
        return model_info(action.action_id, registered)

    def _unregister(self, action: UnregisterModel, start_ns: int) -> Message:
        with self._lock:
            entry = self._entry(action.model)
            if entry.state is not _S.REGISTERED or entry.registered is None:
                raise Refused(
                    ErrorCode.ALREADY_LOADED,
                    f"model {action.model!r} is {entry.state}; UNLOAD it before unregistering",
                )
            entry.move(None)
            del self._models[action.model]
        self.backend.unregister(entry.registered)
        self._short.forget(action.model)
        return self._success(action.action_id, start_ns, {})

    def _load(self, action: Load, start_ns: int) -> Message:
        entry, registered, runs = self._take_pages(action.model)
        try:
            loaded, durations_ns = self.backend.load(registered, runs)
        except BaseException:
            with self._lock:
                self._pages.free(runs)
                entry.runs = ()
                entry.move(_S.REGISTERED)
            raise
        with self._lock:
            entry.loaded = loaded
            entry.move(_S.LOADED)
        return self._success(action.action_id, start_ns, durations_ns)

    def _take_pages(self, name: str) -> tuple[ModelEntry, RegisteredModel, list[PageRun]]:
        """Move ``name`` to LOADING holding fresh pages, waiting while pending UNLOADs may free
        them (`lane_rules.load_verdict`). Raises Refused (UNKNOWN_MODEL, ALREADY_LOADED,
        NO_PAGES)."""
        started_ns = time.monotonic_ns()
        with self._lock:
            while True:  # the model is looked at again after each wait
                entry = self._entry(name)
                registered = entry.registered if entry.state is _S.REGISTERED else None
                runs, short = self._try_allocate(registered)
                waited_ns = time.monotonic_ns() - started_ns
                verdict = load_verdict(
                    registered=registered is not None,
                    pages_fit=runs is not None,
                    unloads_pending=bool(self._unloading) and not self._closed,
                    waited_ns=waited_ns,
                )
                if verdict is LoadVerdict.START:
                    break
                if verdict is LoadVerdict.ALREADY_LOADED:
                    raise Refused(ErrorCode.ALREADY_LOADED, f"model {name!r} is {entry.state}")
                if verdict is LoadVerdict.NO_PAGES:
                    raise Refused(ErrorCode.NO_PAGES, f"model {name!r} {short}")
                self._pages_freed.wait((UNLOAD_WAIT_NS - waited_ns) / 1e9)
            assert registered is not None and runs is not None  # START: both there
            entry.runs = tuple(runs)
            entry.move(_S.LOADING)
            return entry, registered, runs

    def _try_allocate(self, registered: RegisteredModel | None) -> tuple[list[PageRun] | None, str]:
        """Holding the lock: fresh pages for ``registered`` (None: no model, or pages short)
        and, when short, why."""
        if registered is None:
            return None, ""
        try:
            return self._pages.allocate(registered.run_pages), ""
        except NoPages as error:
            return None, error.message

    def _infer(self, action: Infer, start_ns: int) -> Message:
        with self._lock:
            loaded = self._loaded(action.model)
        outputs, durations_ns = run_rows(self.backend, loaded, action, self.io_arena)
        result = self._success(action.action_id, start_ns, durations_ns, outputs=outputs)
        self._short.ran(action.model, action.batch_size, result.end_ns - start_ns)
        return result

    def _unload(self, action: Unload, start_ns: int) -> Message:
        try:
            return self._release_pages(action, start_ns)
        finally:
            with self._lock:
                self._unloading.discard(action.model)
                self._pages_freed.notify_all()

    def _release_pages(self, action: Unload, start_ns: int) -> Message:
        with self._lock:
            loaded = self._loaded(action.model)
            entry = self._models[action.model]
            entry.move(_S.UNLOADING)
        try:
            self.backend.unload(loaded)  # the session is gone before the pages are free
        except BaseException:
            with self._lock:
                entry.move(_S.LOADED)
            raise
        with self._lock:
            self._pages.free(entry.runs)
            entry.runs, entry.loaded = (), None
            entry.move(_S.REGISTERED)
        return self._success(action.action_id, start_ns, {"unload": self._now_ns() - start_ns})

    def _entry(self, name: str) -> ModelEntry:
        """Holding the lock. Raises Refused(UNKNOWN_MODEL)."""
        entry = self._models.get(name)
        if entry is None or entry.state is _S.REGISTERING:
            raise Refused(ErrorCode.UNKNOWN_MODEL, f"model {name!r} is not registered")
        return entry

    def _loaded(self, name: str) -> LoadedModel:
        """Holding the lock. Raises Refused(UNKNOWN_MODEL, NOT_LOADED)."""
        entry = self._entry(name)
        if entry.state is not _S.LOADED or entry.loaded is None:
            raise Refused(ErrorCode.NOT_LOADED, f"model {name!r} is {entry.state}, not loaded")
        return entry.loaded


def _stamped(reply: Reply, received_ns: int, answer: Message) -> None:
    """Call ``reply`` with ``answer``, an ActionResult telling when its action was read."""
    if isinstance(answer, ActionResult):
        # In place: built for this one reply, nothing else holds it (`dataclasses.replace`
        # took 9-23 µs per action, much of a short INFER's whole time in the executor).
        object.__setattr__(answer, "received_ns", received_ns)
    reply(answer)

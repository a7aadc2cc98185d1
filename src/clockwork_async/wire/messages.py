"""Typed, tagged messages of the clockwork-async wire protocol.

One idea: the protocol's vocabulary, one dataclass per message.

Invariant: every message is a frozen dataclass with a unique class attribute ``TAG``; the codec
(`wire.codec`) maps tags to classes through ``MESSAGE_TYPES`` and checks every field against the
annotations declared here, so a decoded message always has the types it says it has.

Field types the codec knows: ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``X | None`` of
those, ``tuple[int, ...]``, ``tuple[str, ...]``, ``tuple[TensorSpec, ...]``,
``Mapping[str, int]`` and ``Mapping[str, np.ndarray]`` (tensors: dtype + shape + raw bytes,
carried in the frame's tail, decoded to numpy without a copy).

Fields added after version 1 was published are declared with `added_field`: they have a
default, and the reference encoder leaves them out while they hold it, so a peer that predates
them still decodes what does not use them (a receiver rejects keys it does not know).

Times are nanoseconds. Executor action windows (``earliest_ns``, ``latest_ns``) and result
timestamps are in the *executor's* ``time.monotonic_ns()`` clock; the controller translates with
its clock-offset estimate (see `Ping`/`Pong`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np

PROTOCOL_VERSION = 1
OMIT_AT_DEFAULT = "omit_at_default"  # dataclass field metadata: see `added_field`


def added_field(default: object) -> Any:
    """A field added to a published message: optional, and not written while it is
    ``default`` (docs/protocol.md, section 3)."""
    return field(default=default, metadata={OMIT_AT_DEFAULT: True})


class ErrorCode(StrEnum):
    """Named failures. A client switches on the code; the message beside it is for people."""

    # Executor actions.
    TOO_LATE = "too_late"  # could not start by the window's latest_ns; not run
    NOT_LOADED = "not_loaded"  # INFER/UNLOAD of a model that is not loaded
    ALREADY_LOADED = "already_loaded"  # LOAD of a model that is loaded or loading
    NO_PAGES = "no_pages"  # not enough free weight pages for a LOAD
    BAD_INPUT = "bad_input"  # missing input, wrong dtype or shape, bad batch size
    UNKNOWN_MODEL = "unknown_model"  # model not registered
    BAD_MODEL = "bad_model"  # a model file that cannot be registered
    INTERNAL = "internal"  # the backend failed; the executor keeps serving
    # Connection level: the peer gets an Error message and the connection closes.
    PROTOCOL_ERROR = "protocol_error"  # bytes that do not decode, or a message out of place
    FRAME_TOO_LARGE = "frame_too_large"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNAUTHORIZED = "unauthorized"


class Role(StrEnum):
    CONTROLLER = "controller"
    EXECUTOR = "executor"
    CLIENT = "client"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """An input or output of a model. A ``-1`` in ``shape`` is a dynamic axis (the batch)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


# --- Connection -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """First message on every connection, both ways. Versions must match exactly."""

    TAG: ClassVar[str] = "hello"
    protocol_version: int
    role: str  # a Role value
    name: str  # the peer's name, for logs
    token: str = ""  # shared secret where authentication is on


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    """The executor's answer to a controller's Hello: what it is and what it holds."""

    TAG: ClassVar[str] = "executor_info"
    name: str
    backend: str  # "onnxruntime", "simulated", ...
    device: str  # "cpu", "cuda:0", "sim"
    kind: str  # prediction key: executors of one kind share duration profiles
    lanes: tuple[str, ...]  # e.g. ("load", "execute")
    page_bytes: int
    pages_total: int
    pages_free: int
    clock_ns: int  # executor monotonic_ns when this was sent
    io_arena: str = added_field("")  # the token of the daemon's IO arena it maps ("": none)


@dataclass(frozen=True, slots=True)
class Error:
    """A connection-level failure; the sender closes the connection after it."""

    TAG: ClassVar[str] = "error"
    code: str  # an ErrorCode value
    message: str


@dataclass(frozen=True, slots=True)
class Ping:
    TAG: ClassVar[str] = "ping"
    seq: int
    sent_ns: int  # sender's clock


@dataclass(frozen=True, slots=True)
class Pong:
    """Echo of a Ping. With t0=sent_ns, t1=peer_ns and t2 the arrival time, the peer's clock
    offset is t1 - (t0 + t2) / 2 and the round trip t2 - t0 (NTP style)."""

    TAG: ClassVar[str] = "pong"
    seq: int
    sent_ns: int
    peer_ns: int  # replier's clock when it answered


# --- Executor actions (controller -> executor) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class RegisterModel:
    """Read a model's weights into host memory; answered by ModelInfo or ActionResult(error).
    ``batch_sizes`` empty: the executor infers what the model allows. ``inputs``: the shapes to
    serve the inputs at (each dynamic axis but the batch set to the length model.toml declares;
    names, dtypes, ranks and fixed axes as in the file); empty: the file's."""

    TAG: ClassVar[str] = "register_model"
    action_id: int
    model: str
    path: str
    batch_sizes: tuple[int, ...] = ()
    inputs: tuple[TensorSpec, ...] = added_field(())


@dataclass(frozen=True, slots=True)
class UnregisterModel:
    TAG: ClassVar[str] = "unregister_model"
    action_id: int
    model: str


@dataclass(frozen=True, slots=True)
class Load:
    """Copy a registered model's weights into free pages; run in the load lane."""

    TAG: ClassVar[str] = "load"
    action_id: int
    model: str
    earliest_ns: int
    latest_ns: int


@dataclass(frozen=True, slots=True)
class Infer:
    """Run a loaded model on a batch; run in the execute lane. Every input whose axis 0 is
    dynamic has ``batch_size`` rows; any other (a scalar, a fixed shape) comes whole.

    To an executor that maps the daemon's IO arena (`ExecutorInfo.io_arena`) the rows travel
    as slot references instead of bytes: ``inputs`` is empty and ``arena_inputs`` holds, for
    each row in order and each input in the model's order (its `ModelInfo.inputs`), the pair
    ``offset, nbytes`` of that row's bytes in the arena (rows past the last up to
    ``batch_size`` repeat the last). ``arena_outputs``, when set, says where each row's
    outputs go the same way (outputs in `ModelInfo.outputs` order; ``nbytes`` 0: drop that
    row's); an output written there is left out of the result's ``outputs``."""

    TAG: ClassVar[str] = "infer"
    action_id: int
    model: str
    batch_size: int
    inputs: Mapping[str, np.ndarray]
    earliest_ns: int
    latest_ns: int
    arena_inputs: tuple[int, ...] = added_field(())
    arena_outputs: tuple[int, ...] = added_field(())


@dataclass(frozen=True, slots=True)
class Unload:
    """Free a model's pages. Runs at once (no window): it only returns pages."""

    TAG: ClassVar[str] = "unload"
    action_id: int
    model: str


@dataclass(frozen=True, slots=True)
class GetState:
    TAG: ClassVar[str] = "get_state"
    action_id: int


# --- Executor replies (executor -> controller) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class ActionResult:
    """The one answer to a Load, Infer, Unload or UnregisterModel (and to a RegisterModel that
    failed). ``code`` is empty on success, else an ErrorCode value.

    ``start_ns``/``end_ns`` bracket the whole action in the executor's clock (both 0 for an
    action rejected without running). ``durations_ns`` has one entry per phase that ran:
    ``load`` for LOAD; ``copy_in``, ``execute``, ``copy_out`` for INFER; ``unload`` for UNLOAD
    (GPU executors add the same phases timed by CUDA events, ``load_gpu``, ``execute_gpu``...).
    ``device_clock_mhz`` is the device's SM clock after a successful action, so durations can
    be normalised by clock; 0 where unknown (CPU and simulated executors). ``received_ns`` is
    when the executor read the action (its clock; 0 where unknown): the controller measures the
    way there from it.
    """

    TAG: ClassVar[str] = "action_result"
    action_id: int
    code: str = ""
    message: str = ""
    start_ns: int = 0
    end_ns: int = 0
    durations_ns: Mapping[str, int] = field(default_factory=dict)
    outputs: Mapping[str, np.ndarray] = field(default_factory=dict)
    pages_free: int = 0
    device_clock_mhz: int = 0
    received_ns: int = 0

    @property
    def ok(self) -> bool:
        return not self.code


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Answer to a successful RegisterModel."""

    TAG: ClassVar[str] = "model_info"
    action_id: int
    model: str
    weights_bytes: int
    pages_needed: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class State:
    TAG: ClassVar[str] = "state"
    action_id: int
    page_bytes: int
    pages_total: int
    pages_free: int
    registered: tuple[str, ...]
    loaded: tuple[str, ...]


# --- Client API (client -> daemon, and its replies) ---------------------------------------------


class ApiCode(StrEnum):
    """Statuses of client-API replies besides the request outcomes (`core.outcomes.Outcome`:
    ``ok``, ``dropped``, ``failed``, ``late``, ``cancelled``, ``unknown_model``, ``bad_input``,
    ``infeasible``, ``overloaded``, ``shutting_down``). A client switches on the status."""

    OK = "ok"
    DUPLICATE_ID = "duplicate_id"  # a request id already in flight on this connection
    FORBIDDEN = "forbidden"  # the connection's token lacks the scope (admin operations)
    BAD_REQUEST = "bad_request"  # a well-formed message that asks for something meaningless
    UNKNOWN_MODEL = "unknown_model"
    BAD_MODEL = "bad_model"  # an uploaded model that cannot be registered
    MODEL_EXISTS = "model_exists"
    OVERLOADED = "overloaded"  # a cap on outstanding requests or connections was reached
    SHUTTING_DOWN = "shutting_down"
    UNAVAILABLE = "unavailable"  # the daemon cannot do it now (no executor up, ...)
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """A served model as `list_models` reports it. ``state`` is a word such as ``ready``;
    ``loaded_on`` names the executors holding a copy; ``pages`` is what one copy takes."""

    name: str
    group: str
    state: str
    loaded_on: tuple[str, ...] = ()
    pages: int = 0
    batch_sizes: tuple[int, ...] = ()
    default_slo_ns: int = 0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    version: int = added_field(0)  # 1, then one more at each replace (0: not told)
    reason: str = added_field("")  # registering/profiling: progress; failed/cancelled: why


@dataclass(frozen=True, slots=True)
class InferRequest:
    """Run ``model`` on one row of every input (or N rows: a client batch, docs/protocol.md).
    ``request_id`` is the client's, unique among its requests in flight on the connection.
    Deadline: ``slo_ms`` after arrival at the daemon, or ``deadline_unix_ns`` (Unix time), or
    neither (the model's default SLO)."""

    TAG: ClassVar[str] = "infer_request"
    request_id: int
    model: str
    inputs: Mapping[str, np.ndarray]
    slo_ms: float | None = None
    deadline_unix_ns: int | None = None


@dataclass(frozen=True, slots=True)
class InferReply:
    """The one answer to an InferRequest. ``status`` is an Outcome or ApiCode value;
    ``timing_ns`` holds ``total`` (arrival to reply), ``queue``, ``execute``,
    ``predicted_execute`` and, when it ran, ``executor``, ``copy_in``, ``copy_out``."""

    TAG: ClassVar[str] = "infer_reply"
    request_id: int
    status: str
    message: str
    outputs: Mapping[str, np.ndarray] = field(default_factory=dict)
    timing_ns: Mapping[str, int] = field(default_factory=dict)
    executor_id: str = ""
    batch_size: int = 0
    model_version: int = added_field(0)  # the version of the model that answered (0: none)

    @property
    def ok(self) -> bool:
        return self.status == ApiCode.OK


@dataclass(frozen=True, slots=True)
class CancelInfer:
    """Cancel the in-flight InferRequest ``request_id``; its InferReply is the answer
    (``cancelled``, or its result if it was already running). Unknown ids are ignored."""

    TAG: ClassVar[str] = "cancel_infer"
    request_id: int


@dataclass(frozen=True, slots=True)
class ListModels:
    TAG: ClassVar[str] = "list_models"
    request_id: int


@dataclass(frozen=True, slots=True)
class AddModel:
    """Register ``name`` from uploaded bytes: ``files["model.onnx"]`` is a 1-D uint8 tensor
    (in the frame tail, so it is bounded by the receiver's ``max_tail_bytes``)."""

    TAG: ClassVar[str] = "add_model"
    request_id: int
    name: str
    files: Mapping[str, np.ndarray]
    model_toml: str | None = None
    replace: bool = added_field(False)  # take the name from the model serving under it
    wait: bool = added_field(True)  # answer once registered; false: once its job started


@dataclass(frozen=True, slots=True)
class CancelRegistration:
    """Cancel the registration of ``name`` that is running; answered by `ModelsReply` once
    nothing of it is left (its job, ``cancelled``), or ``unknown_model`` when none runs."""

    TAG: ClassVar[str] = "cancel_registration"
    request_id: int
    name: str


@dataclass(frozen=True, slots=True)
class RemoveModel:
    TAG: ClassVar[str] = "remove_model"
    request_id: int
    name: str


@dataclass(frozen=True, slots=True)
class ModelsReply:
    """Answer to ListModels (every model), AddModel (the one added), RemoveModel (none)."""

    TAG: ClassVar[str] = "models_reply"
    request_id: int
    status: str
    message: str
    models: tuple[ModelStatus, ...] = ()


@dataclass(frozen=True, slots=True)
class GetStats:
    TAG: ClassVar[str] = "get_stats"
    request_id: int


@dataclass(frozen=True, slots=True)
class StatsReply:
    """``stats_json``: one JSON object, UTF-8 (a msgpack bin, so up to ``max_bin_len``)."""

    TAG: ClassVar[str] = "stats_reply"
    request_id: int
    status: str
    message: str
    stats_json: bytes = b"{}"


@dataclass(frozen=True, slots=True)
class GetHealth:
    TAG: ClassVar[str] = "get_health"
    request_id: int


@dataclass(frozen=True, slots=True)
class HealthReply:
    TAG: ClassVar[str] = "health_reply"
    request_id: int
    status: str
    message: str
    live: bool = False
    ready: bool = False
    reason: str = ""


Message = (
    Hello
    | ExecutorInfo
    | Error
    | Ping
    | Pong
    | RegisterModel
    | UnregisterModel
    | Load
    | Infer
    | Unload
    | GetState
    | ActionResult
    | ModelInfo
    | State
    | InferRequest
    | InferReply
    | CancelInfer
    | ListModels
    | AddModel
    | RemoveModel
    | CancelRegistration
    | ModelsReply
    | GetStats
    | StatsReply
    | GetHealth
    | HealthReply
)

EXECUTOR_ACTIONS = (RegisterModel, UnregisterModel, Load, Infer, Unload, GetState)
CLIENT_REQUESTS = (
    InferRequest,
    CancelInfer,
    ListModels,
    AddModel,
    RemoveModel,
    CancelRegistration,
    GetStats,
    GetHealth,
)
CLIENT_REPLIES = (InferReply, ModelsReply, StatsReply, HealthReply)

MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (
        Hello,
        ExecutorInfo,
        Error,
        Ping,
        Pong,
        RegisterModel,
        UnregisterModel,
        Load,
        Infer,
        Unload,
        GetState,
        ActionResult,
        ModelInfo,
        State,
        *CLIENT_REQUESTS,
        *CLIENT_REPLIES,
    )
}

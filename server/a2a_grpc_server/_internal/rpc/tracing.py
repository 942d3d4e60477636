"""The ``a2a.server`` span of each A2A call, as OpenTelemetry's draft A2A conventions name it.

One span per call of ``lf.a2a.v1.A2AService``: named by the bare method
(``SendMessage``), kind SERVER, child of the W3C ``traceparent`` the client
sent. Its attributes come from the request (method, protocol version,
tenant, message, task and context ids), from the answer (task id, state and
context id; for a stream, from its first frame and the last frame that
carried a state) and from the local agent card (``gen_ai.agent.*``).
``docs/reference/telemetry.md`` lists every name and when it is set.

A call that ends with a status other than OK fails: ``error.type`` is the
gRPC status code's name (``NOT_FOUND``) and the span's status is ERROR with
the call's message. A client that leaves (CANCELLED) is not a failure: a
subscription ends that way. A successful call leaves the status unset.

Calls of other services (health, reflection, an embedder's own) are not
traced here: that is a gRPC instrumentation's work.

Free without a tracer provider (see ``obs.tracing``). Who runs what: each
call's wrapper runs in grpc.aio's task of that call; for a stream, the
frames are noted as they are written (no frame is parsed until the end).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import grpc
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    SendMessageRequest,
    SendMessageResponse,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from google.protobuf.message import DecodeError

from ..model.caller import LEGACY_VERSION, VERSION_KEY
from ..model.names import A2A_SERVICE, MAX_ID_CHARS
from ..obs.tracing import (
    AGENT_DESCRIPTION,
    AGENT_NAME,
    AGENT_VERSION,
    CLIENT_ADDRESS,
    CLIENT_PORT,
    CONVERSATION_ID,
    ERROR_TYPE,
    MESSAGE_ID,
    METHOD_NAME,
    PROPAGATED,
    PROTOCOL_VERSION,
    REFERENCE_TASK_IDS,
    STATUS_CODE,
    TASK_ID,
    TASK_STATE,
    TENANT,
    active,
    tracer,
)
from .intercept import Behavior
from .intercept import status_code as _status

try:
    from opentelemetry import propagate
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - the API is not installed (active() is then False)
    pass

Attributes = dict[str, Any]
Wrap = Callable[[str, str, Behavior], Behavior]

NOT_FAILED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.CANCELLED})
"""The codes of a call that did not fail: answered, or left by its client."""
TASK_SCOPED = (
    GetTaskRequest,
    CancelTaskRequest,
    SubscribeToTaskRequest,
)
PUSH_SCOPED = (
    TaskPushNotificationConfig,
    GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    DeleteTaskPushNotificationConfigRequest,
)
STATE_TAGS = frozenset({0x0A, 0x1A})
"""First byte of a serialized ``StreamResponse`` whose payload is a ``task`` (field 1) or a
``status_update`` (field 3): the frames that carry a state (see ``resume.tag``)."""


def server_spans(card: AgentCard | None = None) -> Wrap:
    """The wrap that traces each A2A call, for ``intercept.WrappingInterceptor``.

    ``A2AService.interceptors()`` applies it inside the metrics interceptor
    and before authentication (a refused call is traced too).

    Args:
        card: The local agent card, whose name, description and version every
            span carries (``gen_ai.agent.*``).
    """
    agent: Attributes = {}
    if card is not None:
        for key, value in (
            (AGENT_NAME, card.name),
            (AGENT_DESCRIPTION, card.description),
            (AGENT_VERSION, card.version),
        ):
            if value:
                agent[key] = value

    def wrap(method: str, kind: str, behavior: Behavior) -> Behavior:
        service, _, name = method.lstrip("/").rpartition("/")
        if service != A2A_SERVICE:
            return behavior
        return _traced(name, kind == "server_stream", behavior, agent)

    return wrap


def _traced(name: str, streaming: bool, behavior: Behavior, agent: Attributes) -> Behavior:
    """``behavior`` in one SERVER span per call (see the module docstring)."""
    fixed = {METHOD_NAME: name, **agent}

    async def run(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if not active():
            return await behavior(request, context)
        carrier: dict[str, str] = {}
        version = ""
        for key, value in context.invocation_metadata() or ():
            if key in PROPAGATED and isinstance(value, str):
                carrier[key] = value
            elif key == VERSION_KEY and isinstance(value, str):
                version = value  # a repeated key: the last one counts, as in ``caller``
        attributes = {**fixed, PROTOCOL_VERSION: _cut(version.strip() or LEGACY_VERSION)}
        attributes.update(client_attributes(context.peer()))
        attributes.update(request_attributes(request))
        with tracer().start_as_current_span(
            name,
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            watched = _Watched(context) if streaming else None
            served: Any = context if watched is None else watched  # a stand-in for the context
            code, result = grpc.StatusCode.UNKNOWN, None
            try:
                result = await behavior(request, served)
                code = _status(context.code()) or grpc.StatusCode.OK
                return result
            except grpc.aio.AbortError:
                code = _status(context.code()) or grpc.StatusCode.UNKNOWN
                raise
            except asyncio.CancelledError:
                left = context.time_remaining()  # the client left, or its deadline passed
                timed_out = left is not None and left <= 0
                code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.CANCELLED
                raise
            finally:
                answer = watched.attributes() if watched is not None else answer_attributes(result)
                _end(span, code, context, answer)

    return run


def _end(
    span: Span,
    code: grpc.StatusCode,
    context: grpc.aio.ServicerContext[Any, Any],
    found: Attributes,
) -> None:
    span.set_attributes(found)
    span.set_attribute(STATUS_CODE, code.name)
    if code not in NOT_FAILED:
        span.set_attribute(ERROR_TYPE, code.name)
        text = context.details()  # type: ignore[no-untyped-call]
        span.set_status(Status(StatusCode.ERROR, str(text or code.name)))


class _Watched:
    """A stream's context, noting what its first frame and its last stated frame say.

    No frame the stream wrote is held past its write but the last stated one
    as bytes (a frame of the task's log, which keeps it anyway): a Task
    snapshot may be as large as a task.
    """

    __slots__ = ("_context", "_first", "_stated")

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._context = context
        self._first: Attributes | None = None
        self._stated: Attributes | bytes | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, frame: StreamResponse | bytes) -> None:
        """Note ``frame`` (a byte frame by its first byte, not parsed), then write it."""
        if self._first is None:
            self._first = _attributes_of(frame)
        if isinstance(frame, bytes):
            if frame and frame[0] in STATE_TAGS:
                self._stated = frame
        elif frame.WhichOneof("payload") in ("task", "status_update"):
            self._stated = _attributes_of(frame)
        await self._context.write(frame)

    def attributes(self) -> Attributes:
        """What the stream's first frame and its last stated frame say about the task."""
        found: Attributes = dict(self._first or {})
        stated = self._stated
        found.update(_attributes_of(stated) if isinstance(stated, bytes) else stated or {})
        return found


def _attributes_of(frame: StreamResponse | bytes) -> Attributes:
    """What one frame says about the task (nothing if it does not decode)."""
    if isinstance(frame, bytes):
        try:
            frame = StreamResponse.FromString(frame)
        except DecodeError:
            return {}
    found: Attributes = {}
    _frame(frame, found)
    return found


def request_attributes(request: Any) -> Attributes:
    """The draft's attributes a request of ``lf.a2a.v1.A2AService`` gives (none if undecodable)."""
    found: Attributes = {}
    tenant = getattr(request, "tenant", "")
    if tenant and isinstance(tenant, str):
        found[TENANT] = _cut(tenant)
    if isinstance(request, SendMessageRequest):
        message = request.message
        _put(found, MESSAGE_ID, message.message_id)
        _put(found, TASK_ID, message.task_id)
        _put(found, CONVERSATION_ID, message.context_id)
        if message.reference_task_ids:
            found[REFERENCE_TASK_IDS] = [_cut(i) for i in message.reference_task_ids[:16]]
    elif isinstance(request, TASK_SCOPED):
        _put(found, TASK_ID, request.id)
    elif isinstance(request, PUSH_SCOPED):
        _put(found, TASK_ID, request.task_id)
    elif isinstance(request, ListTasksRequest):
        _put(found, CONVERSATION_ID, request.context_id)  # the filter: the tasks of one context
    return found


def answer_attributes(result: Any) -> Attributes:
    """The draft's attributes a unary answer gives: its task's id, state and context."""
    found: Attributes = {}
    if isinstance(result, SendMessageResponse):
        if result.HasField("task"):
            _task(result.task, found)
        elif result.HasField("message"):
            _message(result.message, found)
    elif isinstance(result, Task):
        _task(result, found)
    elif isinstance(result, TaskPushNotificationConfig):
        _put(found, TASK_ID, result.task_id)
    return found


def client_attributes(peer: str | None) -> Attributes:
    """``client.address`` and ``client.port`` from grpc's peer (``ipv4:127.0.0.1:5000``)."""
    kind, _, rest = (peer or "").partition(":")
    if kind == "unix":
        return {CLIENT_ADDRESS: rest}
    if kind not in ("ipv4", "ipv6"):
        return {}
    host, _, port = unquote(rest).rpartition(":")
    found: Attributes = {CLIENT_ADDRESS: host.removeprefix("[").removesuffix("]")}
    if port.isdigit():
        found[CLIENT_PORT] = int(port)
    return found


def _frame(frame: StreamResponse, found: Attributes) -> None:
    kind = frame.WhichOneof("payload")
    if kind == "task":
        _task(frame.task, found)
    elif kind == "message":
        _message(frame.message, found)
    elif kind == "status_update":
        update = frame.status_update
        _put(found, TASK_ID, update.task_id)
        _put(found, CONVERSATION_ID, update.context_id)
        found[TASK_STATE] = TaskState.Name(update.status.state)
    elif kind == "artifact_update":
        _put(found, TASK_ID, frame.artifact_update.task_id)
        _put(found, CONVERSATION_ID, frame.artifact_update.context_id)


def _task(task: Task, found: Attributes) -> None:
    _put(found, TASK_ID, task.id)
    _put(found, CONVERSATION_ID, task.context_id)
    found[TASK_STATE] = TaskState.Name(task.status.state)


def _message(message: Message, found: Attributes) -> None:
    _put(found, TASK_ID, message.task_id)
    _put(found, CONVERSATION_ID, message.context_id)


def _put(found: Attributes, key: str, value: str) -> None:
    if value:
        found[key] = _cut(value)


def _cut(value: str) -> str:
    """A client's string as an attribute: at most ``MAX_ID_CHARS`` (longer ones are refused)."""
    return value[:MAX_ID_CHARS]

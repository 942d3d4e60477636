"""Property-based fuzzing of every request, and of raw bytes at every method, on a real server.

For input drawn by hypothesis -- each method's request generated from its protobuf
descriptor (unicode, empty, overlong and 300 KB strings; huge and negative ints; unknown
enum numbers; nested messages and Structs; oneofs), valid-looking requests among them (so
the happy paths run too) and valid ones with one field changed, requests aimed at tasks
of every state and at a task that is still live, raw bytes, mutations of valid requests
(truncated, bits flipped, garbage around them, hand-made wire fields) and requests of
another method's type, under call metadata with and without the resume extension -- this
suite proves that:

* every call succeeds, or fails INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION or
  OUT_OF_RANGE: never UNKNOWN, INTERNAL, RESOURCE_EXHAUSTED, UNAVAILABLE, nor a deadline;
* every error carries a ``google.rpc.ErrorInfo`` in ``grpc-status-details-bin``, and its
  trailers stay under 4 KiB as sent (clients refuse more than 8 KiB); bytes that are not
  the method's message are answered INVALID_ARGUMENT INVALID_REQUEST;
* a call that succeeds answers what was asked (a blocking SendMessage a settled task or a
  message, a stream its task's outcome as its last frame, CancelTask a CANCELED task, ...);
* every stream ends within its deadline;
* after each example the server still serves a plain SendMessage, nothing was logged at
  ERROR or with a traceback, and at the end no coroutine of the package is left on the
  server's loop.

The server runs in a background thread with its own event loop (one per module); examples
go through a synchronous channel. Each test runs one round with a fixed seed; ``--long``
adds nine rounds with random seeds (ten times the examples, each round a test of its own,
within the per-test timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import grpc
import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    SendMessageResponse,
    StreamResponse,
    Task,
    TaskState,
)
from google.protobuf import message_factory, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message as ProtoMessage
from google.protobuf.struct_pb2 import ListValue, Struct, Value
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from a2a_grpc_server import A2AService, ServerConfig
from a2a_grpc_server._internal.model import taskops
from a2a_grpc_server._internal.rpc.auth import Credentials, Principal
from a2a_grpc_server._internal.rpc.resume import RESUME_AFTER_KEY, URI
from a2a_grpc_server._internal.rpc.servicer import SERVICE
from tests.support.harness import V1, Harness, expose, varint

Metadata = tuple[tuple[str, str], ...]

CONFIG = ServerConfig(cancel_timeout=1.0, max_message_bytes=256 * 1024, max_task_bytes=640 * 1024)
"""Small enough that a 300 KB string is refused, and that an echo of a large accepted
message takes its task past ``max_task_bytes`` (the task ends FAILED)."""
CALL_TIMEOUT = 10.0
"""Seconds a call (a stream read to its end included) may take: calls take milliseconds,
but on an overloaded machine even a trivial grpc.aio server stalls for seconds at times."""
MAX_FRAMES = 200
"""Frames a stream may send; the agent here sends a handful."""
TRAILER_BUDGET = 4096
"""Bytes an error's trailers may take at most, as sent (see ``trailer_size``); clients
refuse trailers over 8 KiB (at random between 8 and 16 KiB), answering RESOURCE_EXHAUSTED."""
ALLOWED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
SLOW_SECONDS = 0.05
"""How long the agent works on a message that starts with "slow"."""
HOLD_SECONDS = 5.0
"""How long it works, at most, on one that starts with "hold" (until canceled, in effect)."""
SUBSCRIBED_SECONDS = 0.15
"""How long a subscription to a live task lasts before the test cancels the task."""
KEYWORDS = ("hello", "slow", "fail", "reject", "message")
"""First words the agent acts on (see ``FuzzAgent``); "ask" and "hold" only at a live task."""
EXTENDED_CARD = AgentCard(name="fuzz-extended", description="The card for GetExtendedAgentCard.")
METHODS = list(SERVICE.methods)
METHOD = {m.name: m for m in METHODS}
INPUT_TYPES = list({m.input_type.full_name: m.input_type for m in METHODS}.values())
FINAL = taskops.TERMINAL
SETTLED = FINAL | taskops.INTERRUPTED
MAX_DEPTH = 6
"""Message nesting a generated request reaches at most (Value in Struct in Value ...)."""


# --- The agent ---------------------------------------------------------------------------


class FuzzAgent(AgentExecutor):
    """Acts on the first word of the user's text; anything else is echoed.

    "slow": works ``SLOW_SECONDS`` first; "hold": ``HOLD_SECONDS``; "fail", "reject": ends
    so; "message": answers a message and makes no task; "ask": asks for input (the task is
    parked until a follow-up).
    """

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        text = context.get_user_input()
        words = text.split(maxsplit=1)
        word = words[0] if words else ""
        if word == "message" and context.current_task is None:
            await event_queue.enqueue_event(
                Message(
                    message_id=str(uuid.uuid4()),
                    role=Role.ROLE_AGENT,
                    context_id=context.context_id,
                    parts=[Part(text="you said something")],
                )
            )
            return
        if word == "reject":
            await updater.reject(updater.new_agent_message([Part(text="no")]))
            return
        await updater.start_work()
        if word == "fail":
            await updater.failed(updater.new_agent_message([Part(text="failed on purpose")]))
            return
        if word == "ask":
            await updater.requires_input(updater.new_agent_message([Part(text="more?")]))
            return
        if word in ("slow", "hold"):
            pause = SLOW_SECONDS if word == "slow" else HOLD_SECONDS
            await asyncio.sleep(pause)  # sync-ok: the agent's own (slow) work
        await updater.add_artifact([Part(text=text)], name="echo")
        await updater.complete(updater.new_agent_message([Part(text=text)]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


# --- The server, in a thread of its own ---------------------------------------------------


class LogTrap(logging.Handler):
    """Keeps every record logged at ERROR or with a traceback, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._bad: list[str] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            with self._guard:
                self._bad.append(f"{record.name} {record.levelname}: {record.getMessage()}")

    def take(self) -> list[str]:
        with self._guard:
            bad, self._bad = self._bad, []
        return bad


@dataclass
class Pool:
    """Ids that exist on the server, for requests to aim at (drawn by index, at draw time)."""

    task_ids: list[str] = field(default_factory=list)
    context_ids: list[str] = field(default_factory=list)
    page_tokens: list[str] = field(default_factory=list)
    live: tuple[str, str] | None = None
    """The live task of the current example (task id, context id), if any."""


POOL = Pool()


@dataclass
class Server:
    """The server (served on its own thread's loop), and a synchronous channel to it."""

    harness: Harness
    channel: grpc.Channel
    calls: dict[str, Callable[..., Any]]
    logs: LogTrap
    sent: int = 0


async def _start() -> Harness:
    service = A2AService(FuzzAgent(), config=CONFIG, extended_card=EXTENDED_CARD)
    return await expose(service, auth=Everyone())


class Everyone:
    """Names every caller ``fuzz`` (the extended card is for authenticated callers)."""

    def authenticate(self, credentials: Credentials) -> Principal:
        return Principal("fuzz")


async def _stop(h: Harness) -> None:
    try:
        # Nothing of ours outlives the examples: no run, no stream, no coroutine.
        await h.settle(within=5.0)
    finally:
        await h.service.shutdown(grace=0)
        await h.client.close()
        await h.channel.close()
        await h.server.stop(grace=None)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-server", daemon=True)
    thread.start()
    logs = LogTrap()
    logging.getLogger().addHandler(logs)
    channel: grpc.Channel | None = None
    harness: Harness | None = None
    try:
        harness = asyncio.run_coroutine_threadsafe(_start(), loop).result(10)
        channel = grpc.insecure_channel(  # type: ignore[no-untyped-call]
            harness.address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        calls: dict[str, Callable[..., Any]] = {}
        for method in METHODS:
            path = f"/{SERVICE.full_name}/{method.name}"
            if method.server_streaming:
                calls[method.name] = channel.unary_stream(path)
            else:
                calls[method.name] = channel.unary_unary(path)
        yield Server(harness, channel, calls, logs)
        assert not logs.take(), "errors were logged"
    finally:
        try:
            if channel is not None:
                channel.close()  # type: ignore[no-untyped-call]
            if harness is not None:
                asyncio.run_coroutine_threadsafe(_stop(harness), loop).result(30)
        finally:
            logging.getLogger().removeHandler(logs)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            if not thread.is_alive():
                loop.close()


@pytest.fixture(autouse=True)
def pool(server: Server) -> Pool:
    """Fresh tasks to aim at for each test (the journal drops the oldest final tasks)."""
    _fill_pool(server)
    return POOL


def _fill_pool(srv: Server) -> None:
    """Tasks in every final state, their contexts and a page token, for requests to aim at."""
    POOL.task_ids.clear()
    POOL.context_ids.clear()
    POOL.page_tokens.clear()
    for text in ("hello", "fail", "reject", "message"):
        answer = send(srv, text)
        if answer.HasField("task"):
            POOL.task_ids.append(answer.task.id)
            POOL.context_ids.append(answer.task.context_id)
        else:
            POOL.context_ids.append(answer.message.context_id)
    asked = send(srv, "ask").task
    assert asked.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    canceled = Task.FromString(
        srv.calls["CancelTask"](
            CancelTaskRequest(id=asked.id).SerializeToString(), metadata=V1, timeout=CALL_TIMEOUT
        )
    )
    assert canceled.status.state == TaskState.TASK_STATE_CANCELED
    POOL.task_ids.append(asked.id)
    page = ListTasksResponse.FromString(
        srv.calls["ListTasks"](
            ListTasksRequest(page_size=1).SerializeToString(), metadata=V1, timeout=CALL_TIMEOUT
        )
    )
    assert page.next_page_token
    POOL.page_tokens.append(page.next_page_token)


def send(srv: Server, text: str, *, immediately: bool = False) -> SendMessageResponse:
    """A plain SendMessage of ``text`` (it must succeed)."""
    request = SendMessageRequest(
        message=Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, parts=[Part(text=text)]),
        configuration=SendMessageConfiguration(return_immediately=immediately),
    )
    data = srv.calls["SendMessage"](request.SerializeToString(), metadata=V1, timeout=CALL_TIMEOUT)
    return SendMessageResponse.FromString(data)


# --- Strategies: requests from descriptors ------------------------------------------------


@dataclass
class Budget:
    """What one request may still hold: at most one oversized string or bytes value (two
    would exceed what the transport lets through to the server's own validation)."""

    huge: int = 1


CHARS = st.characters(codec="utf-8")
"""Any code point that UTF-8 can encode (no lone surrogates)."""
ID_FIELDS = frozenset({"id", "task_id", "message_id", "reference_task_ids"})
CHOSEN_VALUES: dict[str, list[str]] = {
    "text": list(KEYWORDS),
    "media_type": [
        "text/plain",
        "text/plain; charset=utf-8",
        "TEXT/Plain",
        "image/png",
        "text/*",
        "*/*",
        ";",
        "/",
    ],
    "url": ["http://127.0.0.1/x", "file:///etc/passwd", "data:,hi", "::"],
    "accepted_output_modes": ["text/plain", "application/json", "*/*"],
    "extensions": [URI, "urn:unknown:extension"],
    "filename": ["a.txt", "../../etc/passwd", "CON"],
}
LENGTHS = st.one_of(
    st.sampled_from([255, 256, 257, 1024, 1025]), st.integers(min_value=200, max_value=1200)
)
"""Lengths of overlong strings: around the id bound (256) and the token bound (1024)."""


def _known(values: Callable[[], list[str]]) -> st.SearchStrategy[str]:
    """One of ``values()`` as it is when drawn (the pool fills once the server is up)."""

    def pick(i: int) -> str:
        found = values()
        return found[i % len(found)] if found else ""

    return st.integers(min_value=0, max_value=15).map(pick)


def _live_id() -> str:
    return POOL.live[0] if POOL.live else ""


def _live_context() -> str:
    return POOL.live[1] if POOL.live else ""


KNOWN_TASKS = st.one_of(
    _known(lambda: POOL.task_ids), st.just(None).map(lambda _: _live_id() or POOL.task_ids[0])
)
KNOWN_CONTEXTS = st.one_of(
    _known(lambda: POOL.context_ids),
    st.just(None).map(lambda _: _live_context() or POOL.context_ids[0]),
)
KNOWN_TOKENS = _known(lambda: POOL.page_tokens)


@st.composite
def huge_text(draw: st.DrawFn) -> str:
    """A 200-310 KB string of one repeated character (some above the 256 KiB limit)."""
    char = draw(st.sampled_from(["x", "é", "字", "🙂", "\x00"]))
    size = draw(st.integers(min_value=200_000, max_value=310_000))
    return char * (size // len(char.encode()))


@st.composite
def strings(draw: st.DrawFn, name: str, budget: Budget) -> str:
    """A string for the field ``name``: empty, short, chosen, known id, overlong or huge."""
    kinds = ["empty", "short", "short", "long"]
    if name in ID_FIELDS:
        kinds += ["task"] * 4
    if name == "context_id":
        kinds += ["context"] * 3
    if name == "page_token":
        kinds += ["token", "token"]
    if name in CHOSEN_VALUES:
        kinds += ["chosen", "chosen"]
    if budget.huge > 0:
        kinds.append("huge")
    kind = draw(st.sampled_from(kinds))
    if kind == "empty":
        return ""
    if kind == "short":
        return draw(st.text(CHARS, min_size=1, max_size=16))
    if kind == "task":
        return draw(KNOWN_TASKS)
    if kind == "context":
        return draw(KNOWN_CONTEXTS)
    if kind == "token":
        return draw(KNOWN_TOKENS)
    if kind == "chosen":
        return draw(st.sampled_from(CHOSEN_VALUES[name]))
    if kind == "long":
        return draw(st.sampled_from(["y", "ü", "字", "🙂"])) * draw(LENGTHS)
    budget.huge -= 1
    return draw(huge_text())


@st.composite
def blobs(draw: st.DrawFn, budget: Budget) -> bytes:
    """A bytes value: short random bytes, or (once per request) 200-310 KB of them."""
    if budget.huge > 0 and draw(st.integers(min_value=0, max_value=7)) == 0:
        budget.huge -= 1
        return draw(st.binary(min_size=1, max_size=8)) * draw(
            st.integers(min_value=25_000, max_value=38_000)
        )
    return draw(st.binary(max_size=48))


def _ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    edges = [
        v for v in (0, 1, -1, 2, 50, 100, 101, low, high, low + 1, high - 1) if low <= v <= high
    ]
    return st.one_of(
        st.integers(min_value=0, max_value=10),
        st.integers(min_value=0, max_value=10),
        st.sampled_from(edges),
        st.integers(min_value=low, max_value=high),
    )


C = FieldDescriptor
SCALARS: dict[int, st.SearchStrategy[Any]] = {
    C.CPPTYPE_INT32: _ints(32, signed=True),
    C.CPPTYPE_INT64: _ints(64, signed=True),
    C.CPPTYPE_UINT32: _ints(32, signed=False),
    C.CPPTYPE_UINT64: _ints(64, signed=False),
    C.CPPTYPE_DOUBLE: st.floats(),
    C.CPPTYPE_FLOAT: st.floats(width=32),
    C.CPPTYPE_BOOL: st.booleans(),
}


def _enums(f: FieldDescriptor) -> st.SearchStrategy[int]:
    assert f.enum_type is not None
    numbers = [v.number for v in f.enum_type.values]
    unknown = [n for n in (-1, max(numbers) + 1, 99, 2**31 - 1, -(2**31)) if n not in numbers]
    return st.one_of(
        st.sampled_from(numbers),
        st.sampled_from(unknown),
        st.integers(min_value=-(2**31), max_value=2**31 - 1),
    )


def _map_entry(f: FieldDescriptor) -> Descriptor | None:
    """The entry type of a map field (None if ``f`` is not one)."""
    entry = f.message_type
    return entry if entry is not None and entry.GetOptions().map_entry else None


@st.composite
def single(draw: st.DrawFn, f: FieldDescriptor, depth: int, budget: Budget) -> Any:
    """One value of field ``f`` (a message for message fields)."""
    if f.cpp_type == C.CPPTYPE_MESSAGE:
        assert f.message_type is not None
        return draw(arbitrary(f.message_type, depth - 1, budget))
    if f.cpp_type == C.CPPTYPE_ENUM:
        return draw(_enums(f))
    if f.cpp_type == C.CPPTYPE_STRING:
        if f.type == C.TYPE_BYTES:
            return draw(blobs(budget))
        return draw(strings(f.name, budget))
    return draw(SCALARS[f.cpp_type])


def _assign(draw: st.DrawFn, msg: ProtoMessage, f: FieldDescriptor, depth: int, b: Budget) -> None:
    """Set field ``f`` of ``msg`` to drawn values (a few entries for maps and lists)."""
    if f.cpp_type == C.CPPTYPE_MESSAGE and depth <= 0:
        return
    entry = _map_entry(f)
    if entry is not None:
        key_f, value_f = entry.fields_by_name["key"], entry.fields_by_name["value"]
        entries = draw(
            st.lists(st.tuples(single(key_f, depth, b), single(value_f, depth, b)), max_size=3)
        )
        mapping = getattr(msg, f.name)
        for key, value in entries:
            if value_f.cpp_type == C.CPPTYPE_MESSAGE:
                mapping[key].CopyFrom(value)
            else:
                mapping[key] = value
    elif f.is_repeated:
        values = draw(st.lists(single(f, depth, b), max_size=3))
        container = getattr(msg, f.name)
        for value in values:
            if f.cpp_type == C.CPPTYPE_MESSAGE:
                container.add().CopyFrom(value)
            else:
                container.append(value)
    elif f.cpp_type == C.CPPTYPE_MESSAGE:
        sub = getattr(msg, f.name)
        sub.SetInParent()
        sub.CopyFrom(draw(single(f, depth, b)))
    else:
        setattr(msg, f.name, draw(single(f, depth, b)))


@st.composite
def arbitrary(draw: st.DrawFn, desc: Descriptor, depth: int, budget: Budget) -> ProtoMessage:
    """Any instance of ``desc``: each field set or not, at most one field of each oneof."""
    msg = message_factory.GetMessageClass(desc)()
    for oneof in desc.oneofs:
        chosen = draw(st.sampled_from([None, *oneof.fields]))
        if chosen is not None:
            _assign(draw, msg, chosen, depth, budget)
    for f in desc.fields:
        if f.containing_oneof is None and draw(st.booleans()):
            _assign(draw, msg, f, depth, budget)
    return msg


def _fields_in(msg: ProtoMessage) -> list[tuple[ProtoMessage, FieldDescriptor]]:
    """Every field (set or not) of ``msg`` and of the messages set in it, maps aside."""
    found = [(msg, cast(FieldDescriptor, f)) for f in msg.DESCRIPTOR.fields]
    for f, value in msg.ListFields():
        if f.cpp_type != C.CPPTYPE_MESSAGE or _map_entry(f) is not None:
            continue
        for sub in value if f.is_repeated else [value]:
            found += _fields_in(sub)
    return found


@st.composite
def one_field_changed(draw: st.DrawFn, request: ProtoMessage, budget: Budget) -> ProtoMessage:
    """``request`` with one field anywhere in it replaced by an arbitrary value."""
    msg, f = draw(st.sampled_from(_fields_in(request)))
    msg.ClearField(f.name)
    _assign(draw, msg, f, 3, budget)
    return request


JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.text(CHARS, max_size=12),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(CHARS, max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
"""JSON-like values, for valid-looking Struct and Value fields."""


def to_value(obj: object) -> Value:
    value = Value()
    if obj is None:
        value.null_value = 0  # type: ignore[assignment]
    elif isinstance(obj, bool):
        value.bool_value = obj
    elif isinstance(obj, float):
        value.number_value = obj
    elif isinstance(obj, str):
        value.string_value = obj
    elif isinstance(obj, list):
        value.list_value.CopyFrom(ListValue(values=[to_value(v) for v in obj]))
    else:
        assert isinstance(obj, dict)
        value.struct_value.CopyFrom(to_struct(obj))
    return value


def to_struct(obj: dict[str, Any]) -> Struct:
    struct = Struct()
    for key, item in obj.items():
        struct.fields[key].CopyFrom(to_value(item))
    return struct


STRUCTS = st.dictionaries(st.text(CHARS, max_size=8), JSON, max_size=3).map(to_struct)


@st.composite
def extra_parts(draw: st.DrawFn, budget: Budget) -> Part:
    """A valid part of any kind, mostly of a media type the card accepts."""
    media = draw(
        st.one_of(
            st.sampled_from(["", "text/plain", "text/plain; charset=utf-8"]),
            strings("media_type", budget),
        )
    )
    kind = draw(st.sampled_from(["text", "data", "url", "raw"]))
    if kind == "text":
        part = Part(text=draw(st.text(CHARS, max_size=40)))
    elif kind == "data":
        part = Part(data=to_value(draw(JSON)))
    elif kind == "url":
        part = Part(url=draw(st.sampled_from(["http://127.0.0.1/x", "https://example.invalid/"])))
    else:
        part = Part(raw=draw(st.binary(max_size=32)))
    part.media_type = media
    if draw(st.booleans()):
        part.metadata.CopyFrom(draw(STRUCTS))
    return part


@st.composite
def valid_sends(
    draw: st.DrawFn,
    budget: Budget,
    task_ids: st.SearchStrategy[str],
    words: tuple[str, ...] = KEYWORDS,
) -> SendMessageRequest:
    """A SendMessageRequest as a client would send it: a ROLE_USER message with parts."""
    if budget.huge > 0 and draw(st.integers(min_value=0, max_value=9)) == 0:
        budget.huge -= 1
        text = draw(st.sampled_from(words)) + " " + draw(huge_text())
    else:
        text = draw(st.one_of(st.sampled_from(words), st.text(CHARS, max_size=40)))
    first = Part(text=text, media_type=draw(st.sampled_from(["", "text/plain"])))
    message = Message(
        message_id=draw(st.one_of(st.uuids().map(str), st.text(CHARS, min_size=1, max_size=36))),
        role=Role.ROLE_USER,
        parts=[first, *draw(st.lists(extra_parts(budget), max_size=2))],
        task_id=draw(task_ids),
        context_id=draw(st.one_of(st.just(""), KNOWN_CONTEXTS, st.uuids().map(str))),
    )
    if draw(st.booleans()):
        message.metadata.CopyFrom(draw(STRUCTS))
    message.extensions.extend(
        draw(st.lists(st.sampled_from(CHOSEN_VALUES["extensions"]), max_size=2))
    )
    message.reference_task_ids.extend(draw(st.lists(KNOWN_TASKS, max_size=2)))
    request = SendMessageRequest(message=message)
    if draw(st.booleans()):
        config = request.configuration
        config.return_immediately = draw(st.booleans())
        config.accepted_output_modes.extend(
            draw(st.lists(st.sampled_from(CHOSEN_VALUES["accepted_output_modes"]), max_size=2))
        )
        if draw(st.booleans()):
            config.history_length = draw(st.integers(min_value=-1, max_value=4))
    if draw(st.booleans()):
        request.metadata.CopyFrom(draw(STRUCTS))
    return request


NEW_TASK = st.just("")


@st.composite
def requests(draw: st.DrawFn, desc: Descriptor, huge: int = 1) -> ProtoMessage:
    """A request of type ``desc``: arbitrary, or (SendMessageRequest) valid-looking, or a
    valid one with one field changed, or with arbitrary fields merged over it."""
    budget = Budget(huge)
    if desc.full_name != SendMessageRequest.DESCRIPTOR.full_name:
        return draw(arbitrary(desc, MAX_DEPTH, budget))
    shape = draw(st.sampled_from(["valid", "valid", "changed", "changed", "merged", "arbitrary"]))
    if shape == "arbitrary":
        return draw(arbitrary(desc, MAX_DEPTH, budget))
    task_ids = draw(st.sampled_from([NEW_TASK, NEW_TASK, NEW_TASK, KNOWN_TASKS]))
    request = draw(valid_sends(budget, task_ids))
    if shape == "changed":
        return draw(one_field_changed(request, budget))
    if shape == "merged":
        request.MergeFrom(cast(SendMessageRequest, draw(arbitrary(desc, MAX_DEPTH, budget))))
    return request


# --- Strategies: samples, raw bytes and call metadata -------------------------------------


def _short(text: str, most: int = 160) -> str:
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} chars)"


def describe(request: ProtoMessage) -> str:
    """A request in text format, long values cut (a 300 KB string stays readable)."""
    lines = text_format.MessageToString(request, as_utf8=True).splitlines()
    return "{ " + " ".join(_short(line.strip()) for line in lines) + " }"


class Sample:
    """What one call sends: the bytes, and how they were made (for a readable failure).

    Args:
        data: The bytes.
        how: How they were made.
        request: The request they are (or were made from), if any.
    """

    __slots__ = ("data", "how", "request")

    def __init__(self, data: bytes, how: str, request: ProtoMessage | None = None) -> None:
        self.data, self.how, self.request = data, how, request

    def __repr__(self) -> str:  # (also what hypothesis prints of a failing example)
        made = f"{self.how} {describe(self.request)}" if self.request is not None else self.how
        shown = self.data.hex() if len(self.data) <= 600 else f"{self.data[:300].hex()}..."
        return f"Sample({made}; {len(self.data)} bytes: {shown})"


def sample_of(request: ProtoMessage) -> Sample:
    return Sample(request.SerializeToString(), request.DESCRIPTOR.name, request)


def samples(desc: Descriptor) -> st.SearchStrategy[Sample]:
    return requests(desc).map(sample_of)


@st.composite
def wire(draw: st.DrawFn, depth: int = 2) -> bytes:
    """Hand-made protobuf wire fields: known and unknown numbers, every wire type (also
    the invalid ones), lengths that lie, nested fields."""
    out = b""
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        number = draw(
            st.one_of(
                st.integers(min_value=1, max_value=8),
                st.sampled_from([0, 15, 16, 2**29 - 1, 2**29]),
            )
        )
        kind = draw(st.integers(min_value=0, max_value=7))
        out += varint(number << 3 | kind)
        if kind == 0:
            out += varint(
                draw(
                    st.one_of(
                        st.integers(min_value=0, max_value=300),
                        st.integers(min_value=-(2**63), max_value=2**64),
                    )
                )
            )
        elif kind == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif kind == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        elif kind == 2:
            body = draw(
                st.one_of(st.binary(max_size=24), wire(depth - 1) if depth > 0 else st.just(b""))
            )
            lie = draw(st.sampled_from([0, 0, 0, 1, -1, 2**31, 2**63]))
            out += varint(max(len(body) + lie, 0)) + body
        elif kind in (6, 7):
            out += draw(st.binary(max_size=8))
        # 3 and 4 (group start and end) carry nothing of their own.
    return out


@st.composite
def mutations(draw: st.DrawFn) -> Sample:
    """A valid serialized request of some method's type, mutated."""
    desc = draw(st.sampled_from(INPUT_TYPES))
    request = draw(requests(desc, huge=0))
    data = request.SerializeToString()
    how = draw(st.sampled_from(["truncated", "bits flipped", "appended", "prepended", "spliced"]))
    if how == "truncated" and data:
        data = data[: draw(st.integers(min_value=0, max_value=len(data) - 1))]
    elif how == "bits flipped" and data:
        flipped = bytearray(data)
        for _ in range(draw(st.integers(min_value=1, max_value=8))):
            bit = draw(st.integers(min_value=0, max_value=len(data) * 8 - 1))
            flipped[bit // 8] ^= 1 << (bit % 8)
        data = bytes(flipped)
    elif how == "appended":
        data += draw(st.one_of(st.binary(min_size=1, max_size=32), wire()))
    elif how == "prepended":
        data = draw(st.one_of(st.binary(min_size=1, max_size=32), wire())) + data
    elif how == "spliced":
        at = draw(st.integers(min_value=0, max_value=len(data)))
        data = data[:at] + draw(st.one_of(st.binary(max_size=16), wire())) + data[at:]
    return Sample(data, f"{how} {desc.name}", request)


RAW: dict[str, st.SearchStrategy[Sample]] = {
    "random bytes": st.binary(max_size=200).map(lambda b: Sample(b, "random bytes")),
    "mutated request": mutations(),
    "request of any type": st.sampled_from(INPUT_TYPES).flatmap(
        lambda desc: requests(desc, huge=0).map(sample_of)
    ),
    "wire fields": wire(3).map(lambda b: Sample(b, "wire fields")),
}

RESUME = (*V1, ("a2a-extensions", URI))
METADATA: st.SearchStrategy[Metadata] = st.one_of(
    st.just(V1),
    st.just(V1),
    st.sampled_from([RESUME, (), (("a2a-version", "0.3"),), (("a2a-version", "9.9"),)]),
    st.sampled_from(["0", "1", "2", "3", "5", "999999999999999999", "-1", "1e3", ""]).map(
        lambda after: (*RESUME, (RESUME_AFTER_KEY, after))
    ),
)
"""Call metadata: mostly plain 1.0; the resume extension with and without a cursor; the
legacy version, and one that is not served."""


# --- One call, and what every answer must be ----------------------------------------------


@dataclass
class Answer:
    code: grpc.StatusCode
    reason: str
    """The ErrorInfo's reason, or "" for OK."""
    frames: list[bytes]
    details: str = ""


class Failed(Protocol):
    """What a failed call of the synchronous API is (``grpc.RpcError`` and ``grpc.Call``)."""

    def code(self) -> grpc.StatusCode: ...
    def details(self) -> str | None: ...
    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...] | None: ...


def trailer_size(err: Failed) -> int:
    """Bytes an error's trailers take on the wire: grpc-status, grpc-message (UTF-8,
    percent-encoded outside printable ASCII) and the trailing metadata (``-bin`` values
    base64-encoded)."""
    message = (err.details() or "").encode()
    size = len("grpc-status") + 2 + len("grpc-message")
    size += sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in message)
    for key, value in err.trailing_metadata() or ():
        size += len(key) + (-(-len(value) * 4 // 3) if key.endswith("-bin") else len(value))
    return size


def judge_error(method: MethodDescriptor, err: Failed) -> Answer:
    """An error's code, details and trailers must be as the module docstring says."""
    code = err.code()
    what = f"{method.name} answered {code.name}: {_short(err.details() or '', 400)}"
    # Trailers over the client's limit come as RESOURCE_EXHAUSTED from the client itself
    # (or, below its hard limit, at random, not): either way the trailers are too large.
    refused = code == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size" in what
    size = trailer_size(err)
    assert not refused and size < TRAILER_BUDGET, f"{what}; trailers of {size} bytes"
    assert code in ALLOWED, what
    details = [v for k, v in err.trailing_metadata() or () if k == "grpc-status-details-bin"]
    assert len(details) == 1, f"{what}; no grpc-status-details-bin"
    assert isinstance(details[0], bytes)
    status = status_pb2.Status.FromString(details[0])
    assert status.code == code.value[0], what
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert len(infos) == 1, f"{what}; {len(infos)} ErrorInfo"
    assert infos[0].reason and infos[0].domain, what
    return Answer(code, infos[0].reason, [], err.details() or "")


def exchange(srv: Server, method: MethodDescriptor, sample: Sample, metadata: Metadata) -> Answer:
    """Send ``sample`` to ``method``; read a stream to its end; judge an error."""
    call = srv.calls[method.name]
    try:
        if not method.server_streaming:
            return Answer(
                grpc.StatusCode.OK, "", [call(sample.data, metadata=metadata, timeout=CALL_TIMEOUT)]
            )
        stream = call(sample.data, metadata=metadata, timeout=CALL_TIMEOUT)
        frames: list[bytes] = []
        for frame in stream:
            frames.append(frame)
            if len(frames) > MAX_FRAMES:
                stream.cancel()
                raise AssertionError(f"{method.name} sent more than {MAX_FRAMES} frames")
        return Answer(grpc.StatusCode.OK, "", frames)
    except grpc.RpcError as exc:
        failed = cast(Failed, exc)
    # Judged outside the except block: a failed assertion is the same failure whichever
    # line of grpc raised the error (hypothesis tells failures apart by their context).
    return judge_error(method, failed)


def _decoded(desc: Descriptor, data: bytes) -> ProtoMessage | None:
    try:
        return message_factory.GetMessageClass(desc).FromString(data)
    except Exception:  # what the server's decoder catches too
        return None


def _state(frame: StreamResponse) -> TaskState | None:
    kind = frame.WhichOneof("payload")
    if kind == "message":
        return None
    return taskops.frame_state(frame)


def judge_ok(
    method: MethodDescriptor, request: ProtoMessage, answer: Answer, metadata: Metadata
) -> str:
    """A success must answer what was asked; returns a summary for the statistics."""
    name = method.name
    if name == "SendMessage":
        assert isinstance(request, SendMessageRequest)
        response = SendMessageResponse.FromString(answer.frames[0])
        kind = response.WhichOneof("payload")
        assert kind in ("task", "message"), f"SendMessage answered {kind}"
        if kind == "task":
            state = response.task.status.state
            if not request.configuration.return_immediately:
                assert state in SETTLED, f"a blocking SendMessage answered {TaskState.Name(state)}"
            return TaskState.Name(state)
        return "message"
    if name in ("SendStreamingMessage", "SubscribeToTask"):
        frames = [StreamResponse.FromString(f) for f in answer.frames]
        resumed = any(key == RESUME_AFTER_KEY for key, _ in metadata)
        if not frames:
            assert name == "SubscribeToTask" and resumed, f"{name} ended OK without a frame"
            return "no frame"
        if not resumed:  # the task first (or the agent's message-only answer)
            first = frames[0].WhichOneof("payload")
            assert first == "task" or (first == "message" and len(frames) == 1), f"{name}: {first}"
        last = _state(frames[-1])
        if name == "SubscribeToTask":
            assert last in FINAL, f"SubscribeToTask ended OK after a {last} frame"
        else:
            assert last is None or last in SETTLED, f"{name} ended OK after a {last} frame"
        return "message" if last is None else TaskState.Name(last)
    if name in ("GetTask", "CancelTask"):
        assert isinstance(request, GetTaskRequest | CancelTaskRequest)
        task = Task.FromString(answer.frames[0])
        assert task.id == request.id
        if isinstance(request, GetTaskRequest) and request.HasField("history_length"):
            assert len(task.history) <= request.history_length
        if name == "CancelTask":
            assert task.status.state == TaskState.TASK_STATE_CANCELED
        return TaskState.Name(task.status.state)
    if name == "ListTasks":
        assert isinstance(request, ListTasksRequest)
        page = ListTasksResponse.FromString(answer.frames[0])
        assert len(page.tasks) <= (request.page_size if request.HasField("page_size") else 50)
        for task in page.tasks:
            if request.status:
                assert task.status.state == request.status
            if request.context_id:
                assert task.context_id == request.context_id
            if request.HasField("history_length"):
                assert len(task.history) <= request.history_length
        return f"{min(len(page.tasks), 2)} tasks"
    if name == "GetExtendedAgentCard":
        assert AgentCard.FromString(answer.frames[0]).name == EXTENDED_CARD.name
    return "ok"


def check(srv: Server, method: MethodDescriptor, sample: Sample, metadata: Metadata) -> Answer:
    """Send ``sample`` to ``method`` and judge the answer whichever it is."""
    answer = exchange(srv, method, sample, metadata)
    request = _decoded(method.input_type, sample.data)
    if request is None:
        what = f"{method.name} answered undecodable bytes {answer.code.name} {answer.reason}"
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, what
        assert answer.reason == "INVALID_REQUEST", what
        assert method.input_type.full_name in answer.details, what
        event(f"{method.name}: undecodable")
    elif answer.code == grpc.StatusCode.OK:
        event(f"{method.name}: OK {judge_ok(method, request, answer, metadata)}")
    else:
        event(f"{method.name}: {answer.code.name} {answer.reason}")
    return answer


def after_example(srv: Server) -> None:
    """The server still serves a plain message, and logged no error."""
    srv.sent += 1
    text = f"still serving {srv.sent}"
    answer = send(srv, text)
    assert answer.task.status.state == TaskState.TASK_STATE_COMPLETED
    assert answer.task.artifacts[0].parts[0].text == text
    bad = srv.logs.take()
    assert not bad, f"the server logged: {bad}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test runs in one round, or in ten with ``--long`` (each round within the
    per-test timeout): round 0 with a fixed seed, the others with a random one."""
    if "fuzz_round" in metafunc.fixturenames:
        rounds = range(10 if metafunc.config.getoption("--long") else 1)
        metafunc.parametrize("fuzz_round", rounds, ids=[f"round{n}" for n in rounds])


def fuzz_settings(fuzz_round: int, examples: int, *, shrink: bool = True) -> settings:
    """Settings of a round: no deadline, no database; ``shrink=False`` for tests whose
    examples are too slow to shrink within the per-test timeout (their failing example is
    reported as found)."""
    found = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=fuzz_round == 0,
        print_blob=True,
        phases=list(Phase) if shrink else found,
        suppress_health_check=list(HealthCheck),
    )


# --- The tests ----------------------------------------------------------------------------

EXAMPLES = 120
"""Generated requests per method and round (``--long`` runs ten rounds)."""
RAW_EXAMPLES = 70
"""Byte strings of each kind per round, each sent to every method."""
LIVE_EXAMPLES = 10
"""Live tasks per state, method and round, each sent one to three requests."""

SUCCEEDS = {"SendMessage", "SendStreamingMessage", "GetTask", "ListTasks", "GetExtendedAgentCard"}
"""Methods that answer OK to some generated requests (CancelTask and SubscribeToTask do
only for a live task: see the test at one)."""


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_generated_requests_at_their_method(
    server: Server, fuzz_round: int, method: MethodDescriptor
) -> None:
    codes: Counter[str] = Counter()

    @fuzz_settings(fuzz_round, EXAMPLES)
    @given(sample=samples(method.input_type), metadata=METADATA)
    def run(sample: Sample, metadata: Metadata) -> None:
        codes[check(server, method, sample, metadata).code.name] += 1
        after_example(server)

    run()
    if method.name in SUCCEEDS:  # the strategies reach the happy path (20-50% of examples)
        assert codes["OK"] * 20 >= sum(codes.values()), codes


@pytest.mark.parametrize("kind", list(RAW))
def test_raw_bytes_at_every_method(server: Server, fuzz_round: int, kind: str) -> None:
    @fuzz_settings(fuzz_round, RAW_EXAMPLES)
    @given(sample=RAW[kind])
    def run(sample: Sample) -> None:
        for method in METHODS:
            check(server, method, sample, V1)
        after_example(server)

    run()


LIVE_METHODS = [
    "SendMessage",
    "SendStreamingMessage",
    "GetTask",
    "CancelTask",
    "SubscribeToTask",
    "ListTasks",
]


@st.composite
def at_live_task(draw: st.DrawFn, method: MethodDescriptor, *, aimed: bool = False) -> Sample:
    """A request of ``method`` aimed at the live task (always if ``aimed``, else mostly)."""
    desc = method.input_type
    aim = aimed or draw(st.integers(min_value=0, max_value=3)) > 0
    live_id, live_context = POOL.live or ("", "")
    if desc.full_name == SendMessageRequest.DESCRIPTOR.full_name:
        shape = draw(st.sampled_from(["valid", "valid", "changed", "merged", "arbitrary"]))
        budget = Budget(1)
        if shape == "arbitrary":
            request = cast(SendMessageRequest, draw(arbitrary(desc, MAX_DEPTH, budget)))
        else:
            request = draw(valid_sends(budget, st.just(live_id), (*KEYWORDS, "ask")))
            if shape == "changed":
                request = cast(SendMessageRequest, draw(one_field_changed(request, budget)))
            elif shape == "merged":
                request.MergeFrom(
                    cast(SendMessageRequest, draw(arbitrary(desc, MAX_DEPTH, budget)))
                )
        if aim:
            request.message.task_id = live_id
            if draw(st.booleans()):
                request.message.context_id = live_context
        return sample_of(request)
    request_ = draw(requests(desc))
    if aim:
        for name, value in (("id", live_id), ("context_id", live_context)):
            if name in desc.fields_by_name:
                setattr(request_, name, value)
    return sample_of(request_)


def _ended(srv: Server, task_id: str) -> None:
    """End the live task (cancel it unless it has ended) and wait until it has."""
    get = GetTaskRequest(id=task_id).SerializeToString()
    cancel = CancelTaskRequest(id=task_id).SerializeToString()
    for _ in range(20):  # a cancel returns once the task is CANCELED: one round, usually
        task = Task.FromString(srv.calls["GetTask"](get, metadata=V1, timeout=CALL_TIMEOUT))
        if task.status.state in FINAL:
            return
        with contextlib.suppress(grpc.RpcError):  # it ended meanwhile: checked next
            srv.calls["CancelTask"](cancel, metadata=V1, timeout=CALL_TIMEOUT)
        threading.Event().wait(0.01)
    raise AssertionError(f"task {task_id} did not end")


class CancelLater:
    """Cancels a task from another thread ``delay`` s after a stream of the server opened,
    unless the block ended first (a subscription to a live task ends only when it does)."""

    def __init__(self, srv: Server, task_id: str, delay: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(srv, task_id, delay))

    def _run(self, srv: Server, task_id: str, delay: float) -> None:
        for _ in range(int(CALL_TIMEOUT / 0.005)):  # until the subscription is served
            if srv.harness.service.servicer.open_streams or self._stop.wait(0.005):
                break
        if self._stop.wait(delay):
            return
        cancel = CancelTaskRequest(id=task_id).SerializeToString()
        with contextlib.suppress(grpc.RpcError):  # it ended meanwhile; ``_ended`` checks
            srv.calls["CancelTask"](cancel, metadata=V1, timeout=CALL_TIMEOUT)

    def __enter__(self) -> None:
        self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT)


OK_AT_LIVE_TASK = {"GetTask", "CancelTask", "SubscribeToTask"}
"""Methods whose requests aimed at a live task succeed often (their arbitrary fields rarely
make them invalid): each reaches its happy path in every run."""


@pytest.mark.parametrize("first", LIVE_METHODS)
@pytest.mark.parametrize("state", ["working", "input-required"])
def test_generated_requests_at_a_live_task(
    server: Server, fuzz_round: int, state: str, first: str
) -> None:
    firsts: Counter[str] = Counter()

    @fuzz_settings(fuzz_round, LIVE_EXAMPLES, shrink=False)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        if state == "working":
            task = send(server, "hold", immediately=True).task
        else:
            task = send(server, "ask").task
            assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
        POOL.live = (task.id, task.context_id)
        try:
            # A request of ``first`` aimed at the task, then up to two of any method.
            more = data.draw(st.integers(min_value=0, max_value=2), label="more calls")
            for n in range(1 + more):
                name = first if n == 0 else data.draw(st.sampled_from(LIVE_METHODS), label="method")
                method = METHOD[name]
                sample = data.draw(at_live_task(method, aimed=n == 0), label=name)
                metadata = data.draw(METADATA, label="metadata")
                if name == "SubscribeToTask":  # the stream ends with the task
                    with CancelLater(server, task.id, SUBSCRIBED_SECONDS):
                        answer = check(server, method, sample, metadata)
                else:
                    answer = check(server, method, sample, metadata)
                if n == 0:
                    firsts[answer.code.name] += 1
        finally:
            POOL.live = None
            _ended(server, task.id)
        after_example(server)

    run()
    if first in OK_AT_LIVE_TASK:
        assert firsts["OK"], firsts

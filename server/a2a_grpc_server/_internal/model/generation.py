"""The v1.1 task generation, on the v1.0 wire (the ``generation`` setting).

A2A v1.1 (the spec's ``dev-1.1`` branch, A2A #1810) numbers a task's
mutations: ``Task.generation`` (field 7), ``TaskStatusUpdateEvent.generation``
(5) and ``TaskArtifactUpdateEvent.generation`` (7), from 1, rising by one per
mutation. Our task log's sequence numbers are that counter (``resume``: the
task itself is 1, each change one more, a follow-up user message included),
so every Task and update frame this server sends carries its number in those
fields. a2a-sdk's types are v1.0 and have no such fields: the number is
added to the serialized frame's payload as one more field, so a v1.0 client
keeps it as an unknown field and a v1.1 client reads it. Which answers carry
it: every streamed frame and the Task that starts a stream, and the Task of
SendMessage and GetTask (not those of ListTasks and CancelTask, nor push
deliveries).

Two requests read v1.1 fields, from the request's unknown fields while the
types are v1.0: ``GetTaskRequest.current_generation`` (4) makes GetTask wait
until the task moves past that generation (or ends), at most until shortly
before the caller's deadline (``wait_for``), then answer the task as it is
(a waiting poll counts as one of its caller's streams);
``SendMessageConfiguration.if_generation_match`` (5) makes a follow-up refused
ABORTED ``TASK_GENERATION_MISMATCH`` unless the task is at that generation
when its message is admitted.
"""

from __future__ import annotations

import functools

from a2a.types.a2a_pb2 import GetTaskRequest, SendMessageConfiguration, Task
from google.protobuf.message import Message as ProtoMessage
from google.protobuf.unknown_fields import UnknownFieldSet

from . import wire

TASK_FIELD = 7
"""``Task.generation``."""
STATUS_FIELD = 5
"""``TaskStatusUpdateEvent.generation``."""
ARTIFACT_FIELD = 7
"""``TaskArtifactUpdateEvent.generation``."""
CURRENT_FIELD = 4
"""``GetTaskRequest.current_generation``."""
MATCH_FIELD = 5
"""``SendMessageConfiguration.if_generation_match``."""
MAX_WAIT = 60.0
"""Most seconds a GetTask with ``current_generation`` waits (the call's deadline aside)."""
MARGIN = 0.25
"""Seconds before the caller's deadline, beside ``MARGIN_SHARE``, at which a waiting GetTask
answers: the time to read, serialize and send the task when many polls answer at once."""
MARGIN_SHARE = 0.02
"""The share of the time left the caller reports that a waiting GetTask leaves unused too.

A server reads the caller's deadline from gRPC's ``grpc-timeout`` header, which gRPC
rounds up (measured with grpcio 1.85: +10 ms for 1 to 10 s, +100 ms for 10 to 100 s,
+1 s past that: up to 1 %). Twice that covers the rounding, whatever the deadline."""
MARGIN_PER_POLL = 0.000_25
"""Seconds earlier a waiting GetTask answers per poll that waited before it (``wait_for``):
about twice what answering one costs (0.1 ms measured, the client in the same process)."""

_BY_PAYLOAD = {1: TASK_FIELD, 3: STATUS_FIELD, 4: ARTIFACT_FIELD}
"""StreamResponse's payload field (task, status_update, artifact_update) -> its generation."""


def wait_for(remaining: float | None, waiting: int = 0) -> float:
    """Seconds a GetTask with ``current_generation`` may wait for the task to change.

    Args:
        remaining: The time left the call's deadline reports (None: no deadline).
        waiting: Polls already waiting on this instance. Each moves this one's
            answer ``MARGIN_PER_POLL`` earlier, so a burst sharing a deadline
            answers one after another, each in time, rather than all at once.

    Returns:
        Until ``MARGIN``, ``MARGIN_SHARE`` of ``remaining`` and the others'
        turns before the deadline; at most ``MAX_WAIT`` (0: answer at once).
    """
    if remaining is None:
        return MAX_WAIT
    margin = MARGIN + remaining * MARGIN_SHARE + waiting * MARGIN_PER_POLL
    return min(max(remaining - margin, 0.0), MAX_WAIT)


def _number(field: int, value: int) -> bytes:
    return wire.varint(field << 3) + wire.varint(value)


def tag(frame: bytes, generation: int) -> bytes:
    """``frame`` (a serialized StreamResponse) with its payload's generation added.

    The number goes inside the payload (``wire``). A message frame (no task) is
    returned as it is.
    """
    tail = _tail(frame[0] >> 3 if frame else 0, generation)
    if not tail:
        return frame
    added = wire.add_to_payload(frame, tail)
    if added is None:  # (never for our frames) more than the payload: a merge appended
        return frame + frame[:1] + wire.varint(len(tail)) + tail
    return added


@functools.lru_cache(maxsize=4096)
def _tail(payload: int, generation: int) -> bytes:
    """The field ``tag`` adds to the payload of a frame of ``payload`` (b"" for none).

    Cached: every task's frames carry the same small generations (1, 2, 3, ...),
    so a frame costs a lookup, not two varint encodings.
    """
    field = _BY_PAYLOAD.get(payload)
    return b"" if field is None else _number(field, generation)


def tag_task(task: Task, generation: int) -> None:
    """Set ``task``'s v1.1 generation (an unknown field to v1.0 types)."""
    task.MergeFromString(_number(TASK_FIELD, generation))


def _unknown(message: ProtoMessage, field: int) -> int | None:
    found = None
    fields = UnknownFieldSet(message)
    for at in range(len(fields)):
        unknown = fields[at]
        if unknown.field_number == field and unknown.wire_type == 0:
            found = int(unknown.data)  # (the last one wins, as protobuf reads a scalar)
    return found


def current_generation(request: GetTaskRequest) -> int | None:
    """The request's ``current_generation`` (v1.1), or None."""
    return _unknown(request, CURRENT_FIELD)


def if_generation_match(configuration: SendMessageConfiguration) -> int | None:
    """The configuration's ``if_generation_match`` (v1.1), or None."""
    return _unknown(configuration, MATCH_FIELD)


def generation_of(task: Task) -> int | None:
    """The v1.1 generation ``task`` carries, if any (what a v1.1 client reads)."""
    return _unknown(task, TASK_FIELD)

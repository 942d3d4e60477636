"""The resume extension: every frame numbered, and SubscribeToTask from a cursor.

A2A v1.0 has no way to pick a stream up where it broke (A2A #1986 asks for a
per-task sequence and a last-seen cursor; v1.1's ``generation`` numbers a
task's changes, A2A #1810). This server offers it as an A2A extension,
declared in the agent card under ``capabilities.extensions`` with ``URI``:

* A client activates it per call with the ``a2a-extensions`` metadata entry
  naming ``URI``; the server then lists it in the response's
  ``a2a-extensions`` header.
* Every frame such a client receives carries its sequence number in the
  frame's ``metadata`` under ``URI``, as ``{"seq": N}`` (the snapshot ``Task``
  that starts a stream, the ``Task`` of GetTask and SendMessage: in
  ``Task.metadata``, with the number of the last change it includes).
* ``SubscribeToTask`` with metadata ``a2a-resume-after: N`` streams exactly the
  frames after N, without a snapshot first; it ends at once (OK) if N is the
  task's final frame, and fails OUT_OF_RANGE (reason ``FRAME_NOT_KEPT``) if
  frame N+1 is no longer kept.
* ``SubscribeToTask`` with metadata ``a2a-resume-fallback: snapshot`` (with or
  without a cursor) answers a frame no longer kept with the task as it stands
  instead: a ``Task`` frame whose ``metadata[URI]`` is ``{"seq": S, "skipped":
  {"from": F, "to": S}}`` (F the first frame the stream missed, S the last
  change the task includes), then the frames after S. A cursor past the
  task's last frame still fails OUT_OF_RANGE, and so does a stream that misses
  again the frame a snapshot answered (it is not answered twice). It is the
  client's choice, per call: a client that does not read the marker would miss
  frames F..S without knowing, where OUT_OF_RANGE tells it.

Numbers count the task's changes from 1 (the task itself) with no gap; a
follow-up user message is a change without a frame, so a stream may skip a
number. They are the same on every instance.
"""

from __future__ import annotations

import functools

from a2a.types.a2a_pb2 import (
    AgentExtension,
    Message,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskStatusUpdateEvent,
)
from google.protobuf.struct_pb2 import Struct

from ..errors import FrameNotKeptError, InvalidFieldError
from ..model import wire
from ..model.caller import Caller

URI = "urn:a2a-grpc-server:extension:resume:v1"
"""The extension's URI: what clients name in ``a2a-extensions`` and find in metadata."""
RESUME_AFTER_KEY = "a2a-resume-after"
"""The call metadata key of a resumption cursor (on SubscribeToTask)."""
FALLBACK_KEY = "a2a-resume-fallback"
"""The call metadata key that asks for a snapshot where frames are gone (on SubscribeToTask)."""
SNAPSHOT = "snapshot"
"""``FALLBACK_KEY``'s one value: the task as it stands, marked, then the frames after it."""

_PAYLOADS = {1: "task", 2: "message", 3: "status_update", 4: "artifact_update"}
"""StreamResponse's payload field by number (a serialized frame starts with its tag)."""
_METADATA = {
    number: kind.DESCRIPTOR.fields_by_name["metadata"].number
    for number, kind in (
        (1, Task),
        (2, Message),
        (3, TaskStatusUpdateEvent),
        (4, TaskArtifactUpdateEvent),
    )
}
"""Each payload's ``metadata`` field number, by the payload's field number."""


def extension(window: float) -> AgentExtension:
    """The card's declaration of the extension (not required: plain clients are served)."""
    params = Struct()
    params.update(
        {
            "resumeAfterMetadataKey": RESUME_AFTER_KEY,
            "windowSeconds": window,
            "fallbackMetadataKey": FALLBACK_KEY,
            "fallbacks": [SNAPSHOT],
        }
    )
    return AgentExtension(
        uri=URI,
        description=(
            "Stream resumption: each frame carries metadata[uri].seq, its number in the "
            f"task's log; SubscribeToTask with metadata '{RESUME_AFTER_KEY}: <seq>' streams "
            "exactly the frames after it, on any instance; with "
            f"'{FALLBACK_KEY}: {SNAPSHOT}', frames no longer kept are answered with the task as "
            "it stands, marked metadata[uri].skipped, then the frames after it."
        ),
        required=False,
        params=params,
    )


def activated(call: Caller) -> bool:
    """Whether the call activated the extension."""
    return URI in call.extensions()


def resume_after(call: Caller) -> int | None:
    """The resumption cursor of a SubscribeToTask call, if it sent one.

    Raises:
        InvalidFieldError: The cursor is not a non-negative integer, or the
            call did not activate the extension.
    """
    value = _sent(call, RESUME_AFTER_KEY)
    if value is None:
        return None
    if not value.isdigit() or len(value) > 18:
        raise InvalidFieldError(
            RESUME_AFTER_KEY,
            f"must be the seq of the last frame received (an integer >= 0), not {value[:32]!r}",
        )
    return int(value)


def _sent(call: Caller, header: str) -> str | None:
    """The value (its last, stripped) of ``header`` in the call's metadata, if sent.

    Raises:
        InvalidFieldError: It was sent by a call that did not activate the extension.
    """
    value = None
    for key, text in call.headers:
        if key == header:
            value = text.strip()
    if value is not None and not activated(call):
        raise InvalidFieldError(
            header, f"needs the resume extension: send metadata 'a2a-extensions: {URI}'"
        )
    return value


def snapshot_fallback(call: Caller) -> bool:
    """Whether a SubscribeToTask call asked for a snapshot where frames are gone.

    Raises:
        InvalidFieldError: The value is not ``SNAPSHOT``, or the call did not
            activate the extension.
    """
    value = _sent(call, FALLBACK_KEY)
    if value is None:
        return False
    if value.lower() != SNAPSHOT:
        raise InvalidFieldError(
            FALLBACK_KEY, f"the one fallback offered is {SNAPSHOT!r}, not {value[:32]!r}"
        )
    return True


def past_end(error: FrameNotKeptError) -> bool:
    """Whether a stream asked for a frame after the task's last one (a cursor past the end).

    No snapshot answers that: the cursor is not one of this task's.
    """
    return error.wanted > error.last + 1


def tag(frame: bytes, seq: int) -> bytes:
    """``frame`` with ``{"seq": seq}`` added to its payload's metadata under ``URI``.

    The entry is added inside the payload as one more ``metadata`` field
    (``model.wire``: the frame is neither parsed nor copied but once), which
    protobuf merges into the payload's metadata. A payload that has metadata
    already (the agent set some) is parsed and written again instead: some
    clients (ts-proto, protobuf.js) keep only the last occurrence of a field.
    (A key the agent set under ``URI`` is replaced.)
    """
    payload = frame[0] >> 3 if frame else 0
    field = _METADATA.get(payload)
    if field is None:
        return frame
    bounds = wire.payload_bounds(frame)
    if bounds is not None and not wire.has_field(frame, *bounds, field):
        added = wire.add_to_payload(frame, _entry(field, seq))
        assert added is not None  # (its bounds were found above)
        return added
    parsed = StreamResponse.FromString(frame)
    getattr(parsed, _PAYLOADS[payload]).metadata[URI] = {"seq": seq}
    return parsed.SerializeToString()


@functools.lru_cache(maxsize=4096)
def _entry(field: int, seq: int) -> bytes:
    """The ``metadata`` field (number ``field``) holding ``{URI: {"seq": seq}}``."""
    entry = Struct()
    entry[URI] = {"seq": seq}
    data = entry.SerializeToString()
    return wire.varint(field << 3 | 2) + wire.varint(len(data)) + data


def tag_task(task: Task, seq: int, skipped_from: int = 0) -> None:
    """Record in ``task.metadata`` that it includes the changes up to ``seq``.

    Args:
        task: The task answered or streamed.
        seq: The number of the last change it includes.
        skipped_from: The first frame the stream did not carry, when the task
            stands in for frames ``skipped_from`` to ``seq`` that were no longer
            kept (the snapshot fallback); 0 otherwise.
    """
    if skipped_from:
        task.metadata[URI] = {"seq": seq, "skipped": {"from": skipped_from, "to": seq}}
    else:
        task.metadata[URI] = {"seq": seq}

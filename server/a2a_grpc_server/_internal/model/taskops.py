"""Pure functions over ``Task``: create one, apply an executor event to it.

No I/O and no concurrency here; the task's writer (``live.LiveTask``) calls
these under the task's lock before it persists and appends the frame, and
relays apply the owner's frames with them.
"""

from __future__ import annotations

import time
import uuid

from a2a.types.a2a_pb2 import (
    Artifact,
    Message,
    Role,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import InvalidAgentResponseError
from google.protobuf.timestamp_pb2 import Timestamp

from ..errors import quote

Event = Message | Task | TaskStatusUpdateEvent | TaskArtifactUpdateEvent
EVENT_TYPES = (Message, Task, TaskStatusUpdateEvent, TaskArtifactUpdateEvent)
"""What an executor may enqueue, for ``isinstance``."""

TERMINAL = frozenset(
    {
        TaskState.TASK_STATE_COMPLETED,
        TaskState.TASK_STATE_FAILED,
        TaskState.TASK_STATE_CANCELED,
        TaskState.TASK_STATE_REJECTED,
    }
)
INTERRUPTED = frozenset({TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED})
UNSPECIFIED = TaskState.TASK_STATE_UNSPECIFIED
"""(Read once: an enum wrapper's attribute costs a Python-level lookup each time.)"""
SUBMITTED = TaskState.TASK_STATE_SUBMITTED


def is_final(task: Task) -> bool:
    """Return whether ``task`` is in a terminal state."""
    return task.status.state in TERMINAL


def is_final_state(state: TaskState) -> bool:
    """Return whether ``state`` is terminal."""
    return state in TERMINAL


def state_name(state: TaskState) -> str:
    """The state's name, e.g. ``TASK_STATE_CANCELED``."""
    return TaskState.Name(state)


def frame_state(frame: StreamResponse) -> TaskState:
    """The state a frame carries: a status update's or a task's; UNSPECIFIED for others."""
    kind = frame.WhichOneof("payload")
    if kind == "status_update":
        return frame.status_update.status.state
    if kind == "task":
        return frame.task.status.state
    return UNSPECIFIED


def copy(task: Task) -> Task:
    """Return a deep copy of ``task``."""
    result = Task()
    result.CopyFrom(task)
    return result


def now() -> Timestamp:
    """Return the current time as a protobuf ``Timestamp`` (to the microsecond)."""
    seconds, ns = divmod(time.time_ns(), 1_000_000_000)
    return Timestamp(seconds=seconds, nanos=ns - ns % 1000)


def new_task(task_id: str, context_id: str, message: Message | None) -> Task:
    """Create a task in SUBMITTED whose history holds the user's message."""
    task = Task(id=task_id, context_id=context_id)
    task.status.state = SUBMITTED
    task.status.timestamp.CopyFrom(now())
    if message is not None:
        task.history.append(message)
    return task


def add_user_message(task: Task, message: Message) -> None:
    """Record a follow-up user message: the status message moves to history first."""
    if task.status.HasField("message"):
        task.history.append(task.status.message)
        task.status.ClearField("message")
    task.history.append(message)


def agent_message(task: Task, text: str) -> Message:
    """Build an agent message bound to ``task``, for statuses the server writes."""
    msg = Message(
        message_id=str(uuid.uuid4()),
        role=Role.ROLE_AGENT,
        task_id=task.id,
        context_id=task.context_id,
    )
    msg.parts.add(text=text)
    return msg


def status_event(task: Task, state: TaskState, text: str | None) -> TaskStatusUpdateEvent:
    """Build the status update the server itself emits (cancel, failure, shutdown)."""
    status = TaskStatus(state=state)
    status.timestamp.CopyFrom(now())
    if text is not None:
        status.message.CopyFrom(agent_message(task, text))
    return TaskStatusUpdateEvent(task_id=task.id, context_id=task.context_id, status=status)


ArtifactIndex = dict[str, int]
"""Position of each artifact in ``task.artifacts`` by id, kept by the caller so
that applying an artifact update costs the same however many artifacts exist."""


def index_artifacts(task: Task) -> ArtifactIndex:
    """Build the ``ArtifactIndex`` of ``task``."""
    return {a.artifact_id: i for i, a in enumerate(task.artifacts)}


def apply(task: Task, event: Event, index: ArtifactIndex | None = None) -> StreamResponse:
    """Apply ``event`` to ``task`` in place and return the frame readers get for it.

    Args:
        task: The task to update (the caller owns it).
        event: An event the executor enqueued for this task.
        index: The task's artifact index, kept up to date here (None: scan).

    Returns:
        The ``StreamResponse`` subscribers receive for this event.

    Raises:
        InvalidAgentResponseError: The event is not an A2A event, names another
            task or context, carries no state, or appends to an artifact that
            does not exist.
    """
    field, payload = _apply(task, event, index)
    frame = StreamResponse()
    getattr(frame, _PAYLOADS[field]).CopyFrom(payload)
    return frame


def apply_serialized(
    task: Task, event: Event, index: ArtifactIndex | None = None
) -> tuple[bytes, TaskState]:
    """``apply``, returning the frame serialized and the state it carries.

    The same bytes as ``apply(...).SerializeToString()``, without building the
    ``StreamResponse`` (a copy of the event) first.

    Raises:
        InvalidAgentResponseError: As ``apply``.
    """
    field, payload = _apply(task, event, index)
    body = payload.SerializeToString()
    size = len(body)
    head = bytearray((field << 3 | 2,))
    while size > 0x7F:
        head.append(size & 0x7F | 0x80)
        size >>= 7
    head.append(size)
    state = payload.status.state if field in (1, 3) else UNSPECIFIED  # type: ignore[union-attr]
    return bytes(head) + body, state


_PAYLOADS = {1: "task", 2: "message", 3: "status_update", 4: "artifact_update"}
"""``StreamResponse``'s payload fields by number."""


def _apply(
    task: Task, event: Event, index: ArtifactIndex | None
) -> tuple[int, Task | Message | TaskStatusUpdateEvent | TaskArtifactUpdateEvent]:
    """Apply ``event`` to ``task``; return the frame's payload field and payload."""
    if isinstance(event, TaskArtifactUpdateEvent):
        _check_ids(task, event.task_id, event.context_id, "artifact update")
        _apply_artifact(task, event, index)
        return 4, event
    if isinstance(event, TaskStatusUpdateEvent):
        _check_ids(task, event.task_id, event.context_id, "status update")
        _apply_status(task, event)
        return 3, event
    if isinstance(event, Message):
        _check_ids(task, event.task_id, event.context_id, "message")
        task.history.append(event)
        return 2, event
    if isinstance(event, Task):
        _check_ids(task, event.id, event.context_id, "task")
        _merge_task(task, event, index)
        return 1, task
    raise InvalidAgentResponseError(
        f"agent enqueued a {type(event).__name__}; expected a Message, Task, "
        "TaskStatusUpdateEvent or TaskArtifactUpdateEvent"
    )


def apply_frame(task: Task, frame: StreamResponse, index: ArtifactIndex | None = None) -> Task:
    """Apply a frame the task's owner recorded to a follower's copy of the task.

    Args:
        task: The follower's task (changed in place).
        frame: A frame of the task.
        index: The task's artifact index, kept up to date here (None: scan).

    Returns:
        The task after the frame: ``task`` itself, or, for a frame carrying the
        whole task, a copy of it (the caller rebuilds its index then).

    Raises:
        InvalidAgentResponseError: The frame does not fit the task (a bug).
    """
    kind = frame.WhichOneof("payload")
    if kind == "task":
        return copy(frame.task)
    if kind is not None:
        apply(task, getattr(frame, kind), index)
    return task


def _check_ids(task: Task, task_id: str, context_id: str, what: str) -> None:
    if task_id and task_id != task.id:
        raise InvalidAgentResponseError(
            f"agent sent a {what} for task {quote(task_id)} to task {quote(task.id)}"
        )
    if context_id and context_id != task.context_id:
        raise InvalidAgentResponseError(
            f"agent sent a {what} for context {quote(context_id)} "
            f"to a task of context {quote(task.context_id)}"
        )


def _merge_task(task: Task, event: Task, index: ArtifactIndex | None) -> None:
    if event.HasField("status"):
        if event.status.state == UNSPECIFIED:
            raise InvalidAgentResponseError("agent sent a task without a state")
        task.status.CopyFrom(event.status)
    for artifact in event.artifacts:
        _upsert_artifact(task, artifact, index)
    known = {m.message_id for m in task.history}
    task.history.extend(m for m in event.history if m.message_id not in known)
    if event.HasField("metadata"):
        task.metadata.MergeFrom(event.metadata)


def _apply_status(task: Task, event: TaskStatusUpdateEvent) -> None:
    if event.status.state == UNSPECIFIED:
        raise InvalidAgentResponseError("agent sent a status update without a state")
    if not event.task_id:
        event.task_id = task.id
    if not event.context_id:
        event.context_id = task.context_id
    if not event.status.HasField("timestamp"):
        event.status.timestamp.CopyFrom(now())
    if task.status.HasField("message"):
        task.history.append(task.status.message)
    if event.HasField("metadata"):
        task.metadata.MergeFrom(event.metadata)
    task.status.CopyFrom(event.status)


def _apply_artifact(
    task: Task, event: TaskArtifactUpdateEvent, index: ArtifactIndex | None
) -> None:
    if not event.task_id:
        event.task_id = task.id
    if not event.context_id:
        event.context_id = task.context_id
    if not event.append:
        _upsert_artifact(task, event.artifact, index)
        return
    position = _position(task, event.artifact.artifact_id, index)
    if position is None:
        raise InvalidAgentResponseError(
            f"agent appended to artifact {quote(event.artifact.artifact_id)}, "
            "which it never created"
        )
    existing = task.artifacts[position]
    existing.parts.extend(event.artifact.parts)
    if event.artifact.HasField("metadata"):
        existing.metadata.MergeFrom(event.artifact.metadata)


def _upsert_artifact(task: Task, artifact: Artifact, index: ArtifactIndex | None) -> None:
    position = _position(task, artifact.artifact_id, index)
    if position is not None:
        task.artifacts[position].CopyFrom(artifact)
        return
    task.artifacts.append(artifact)
    if index is not None:
        index[artifact.artifact_id] = len(task.artifacts) - 1


def _position(task: Task, artifact_id: str, index: ArtifactIndex | None) -> int | None:
    if index is not None:
        return index.get(artifact_id)
    return next((i for i, a in enumerate(task.artifacts) if a.artifact_id == artifact_id), None)

"""Errors, and the one place that maps them to gRPC status.

Error tree (domain errors are a2a-sdk's ``A2AError`` subclasses, so an
executor raising one of them is reported faithfully):

* ``A2AError`` (a2a-sdk)
    * ``TaskNotFoundError`` -> NOT_FOUND
    * ``TaskNotCancelableError``, ``UnsupportedOperationError``,
      ``PushNotificationNotSupportedError``,
      ``ExtendedAgentCardNotConfiguredError``, ``ExtensionSupportRequiredError``,
      ``VersionNotSupportedError`` -> FAILED_PRECONDITION
    * ``ContentTypeNotSupportedError``, ``InvalidParamsError``,
      ``InvalidRequestError`` -> INVALID_ARGUMENT
    * ``InvalidAgentResponseError``, ``InternalError`` -> INTERNAL
* ``FrameNotKeptError`` (ours: a stream's next frame left the task's log, or a
  resumption asked for one that did) -> OUT_OF_RANGE
* ``AnswerTooLargeError`` (ours: one task is larger than an answer may be) ->
  RESOURCE_EXHAUSTED
* ``ServerShuttingDownError``, ``OwnerUnavailableError``,
  ``RelayLostError`` (ours) -> UNAVAILABLE
* ``OwnerTimeoutError`` (ours: a routed request's answer did not come in time;
  it may have taken effect) -> DEADLINE_EXCEEDED
* ``StoreUnavailableError`` (ours, the journal's backend is down) -> UNAVAILABLE;
  ``StoreRefusedError`` (it refused an operation) -> INTERNAL; both are
  ``StoreError``, the base of what a journal raises
* ``QuotaExceededError`` (a caller at one of its quotas), ``ParkedTasksLimitError``,
  ``PushConfigLimitError`` -> RESOURCE_EXHAUSTED; ``PushConfigNotFoundError`` ->
  NOT_FOUND
* ``AuthenticationError`` -> UNAUTHENTICATED; ``UnguardableHandlerError`` (a
  synchronous handler on a guarded service) -> FAILED_PRECONDITION
* anything else -> INTERNAL with a generic message; the traceback is logged.

Every one of them is defined here, and ``abort`` below is the only way a
call is ended with an error status (the modules that raise them re-export the
ones they own). ``docs/reference/errors.md`` lists them all, generated from this tree.

Every status carries a ``google.rpc.Status`` in ``grpc-status-details-bin``
with a ``google.rpc.ErrorInfo`` (spec v1.0.1 §5.4): domain
``a2a-protocol.org`` for protocol errors, ``a2a-grpc-server`` for ours, reason
UPPER_SNAKE without "Error". Invalid parameters also carry a
``google.rpc.BadRequest`` naming the offending field.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

import grpc
from a2a.utils.errors import (
    A2A_ERROR_MAPPING,
    A2AError,
    InvalidParamsError,
)
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

logger = logging.getLogger(__name__.replace("._internal", ""))

A2A_DOMAIN = "a2a-protocol.org"
SERVER_DOMAIN = "a2a-grpc-server"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
QUOTE_CHARS = 64
"""Most characters of one client value an error message quotes."""
MAX_MESSAGE_BYTES = 768
"""Most UTF-8 bytes of an error message (it travels twice, grpc-message and the details,
and grpc-message percent-encodes every byte that is not printable ASCII: three each)."""
MAX_DETAIL_BYTES = 256
"""Most UTF-8 bytes of one ErrorInfo metadata value or BadRequest description."""


class ServerError(Exception):
    """An error of this server (not of the A2A protocol) with its own status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"

    def details(self) -> dict[str, str]:
        """Machine-readable facts for the ErrorInfo's metadata (none by default)."""
        return {}


class FrameNotKeptError(ServerError):
    """A stream needs a frame that the task's log no longer keeps.

    Raised to a reader that fell so far behind that its next frame left the
    log's budget, and to a resumption whose cursor is older than what is kept
    (or past the log's end). Either way the client resubscribes without a
    cursor: it gets the current task, then every frame after it.

    Args:
        task_id: The task.
        wanted: The sequence number of the frame the stream needed.
        first_kept: The oldest frame still kept (``last + 1`` if none is).
        last: The task's newest frame.
    """

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "FRAME_NOT_KEPT"

    def __init__(self, task_id: str, wanted: int, first_kept: int, last: int) -> None:
        self.task_id, self.wanted, self.first_kept, self.last = task_id, wanted, first_kept, last
        if wanted > last + 1:
            what = f"task {quote(task_id)} has only {last} frames; frame {wanted} does not exist"
        elif first_kept > last:
            what = f"frame {wanted} of task {quote(task_id)} is no longer kept (none is)"
        else:
            what = (
                f"frame {wanted} of task {quote(task_id)} is no longer kept "
                f"(oldest kept: {first_kept}, newest: {last})"
            )
        super().__init__(
            f"{what}; resubscribe without a resume cursor to get the current task and what follows"
        )

    def details(self) -> dict[str, str]:
        """The frame wanted and the range still kept."""
        return {
            "taskId": self.task_id,
            "wantedSeq": str(self.wanted),
            "oldestKeptSeq": str(self.first_kept),
            "lastSeq": str(self.last),
        }


class AnswerTooLargeError(ServerError):
    """One task is larger than an answer may be (a task stored before a lower limit).

    Args:
        task_id: The task.
        size: Its size as it would be sent.
        most: The most bytes of tasks one answer carries (``max_task_bytes``).
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "ANSWER_TOO_LARGE"

    def __init__(self, task_id: str, size: int, most: int) -> None:
        self.task_id, self.size, self.most = task_id, size, most
        super().__init__(
            f"task {quote(task_id)} is {size} bytes, more than one answer carries ({most}); "
            "ask for less of it (history_length, include_artifacts=false)"
        )

    def details(self) -> dict[str, str]:
        """The task, its size and the limit."""
        return {"taskId": self.task_id, "size": str(self.size), "limit": str(self.most)}


class ServerShuttingDownError(ServerError):
    """The server is draining and accepts no new work."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "SHUTTING_DOWN"


class OwnerUnavailableError(ServerError):
    """The instance that runs the task did not answer a routed request (cluster mode)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "OWNER_UNAVAILABLE"


class MessageKeyReusedError(ServerError):
    """A SendMessage reuses a message id (or idempotency key) of another request of the caller.

    Args:
        kind: ``message.message_id`` or the ``idempotency-key`` metadata.
        ident: The id or key reused.
    """

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "MESSAGE_ID_REUSED"

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(
            f"{kind} {quote(ident)} was sent before with another request; a retry must "
            "send the same request, and a new message a new id"
        )
        self.kind, self.ident = kind, ident

    def details(self) -> dict[str, str]:
        """The field and the id reused."""
        return {"field": self.kind, "id": self.ident}


class MessageAnswerNotKeptError(ServerError):
    """A retried SendMessage's first request was answered with a message too large to keep."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "MESSAGE_ANSWER_NOT_KEPT"


class TaskGenerationMismatchError(ServerError):
    """A follow-up's ``if_generation_match`` (A2A v1.1) is not the task's generation.

    Args:
        task_id: The task.
        expected: The generation the request expected.
        current: The task's generation when the message was to be admitted.
    """

    code = grpc.StatusCode.ABORTED
    reason = "TASK_GENERATION_MISMATCH"

    def __init__(self, task_id: str, expected: int, current: int) -> None:
        super().__init__(
            f"task {quote(task_id)} is at generation {current}, not {expected}: read it "
            "again (GetTask) and decide on what it is now"
        )
        self.task_id, self.expected, self.current = task_id, expected, current

    def details(self) -> dict[str, str]:
        """The task and both generations (v1.1's metadata keys)."""
        return {
            "taskId": self.task_id,
            "expectedGeneration": str(self.expected),
            "currentGeneration": str(self.current),
        }


class MessageInProgressError(ServerError):
    """A retried SendMessage found its first request still starting, or not known to have run.

    This request did nothing; retry. (The first may yet run: its owner has not said.)
    """

    code = grpc.StatusCode.UNAVAILABLE
    reason = "MESSAGE_IN_PROGRESS"


class OwnerTimeoutError(ServerError):
    """The task's owner did not answer a routed request in time; it may have acted (cluster)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "OWNER_TIMEOUT"
    sent = True
    """Whether it may have acted (False: ``OwnerTooLateError``, nothing was done)."""
    asked = ""
    """For a follow-up: the owner asked (set by ``cluster.front``; see ``rpc.idempotency``)."""
    after = 0
    """For a follow-up: the task's last change before the message would run."""
    seen = 0
    """For a follow-up: the length of the task's history when it was sent."""
    until = 0.0
    """When (seconds since the epoch) the owner can no longer act on it: its signature's
    window, the request's own timeout and the owner's write retries after it was sent."""


class OwnerTooLateError(OwnerTimeoutError):
    """Too little of the call's deadline was left to act on a routed request: nothing was done.

    Raised by the asker before it sends, or by the owner before it acts (cluster).
    """

    sent = False


class UnsignedMessageError(ServerError):
    """A routed request or answer without a valid signature of the cluster's key (cluster mode).

    Whoever sent it is not an instance of this cluster, or holds another key
    (see ``jetstream.signing``): nothing was done.
    """

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "UNSIGNED_ROUTED_REQUEST"


class RelayLostError(ServerError):
    """This instance stopped relaying a task another instance runs (cluster mode)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "RELAY_LOST"


class TaskHandedOverError(ServerError):
    """This instance no longer carries a waiting task: it left it to the cluster (cluster mode).

    Raised to the readers of a task that waits for input (INPUT_REQUIRED,
    AUTH_REQUIRED) when this instance shuts down or finds that another one
    took the task over: the task goes on, continued through any instance.
    Retryable: a client resubscribes (or resumes from its cursor) through
    another instance and misses nothing.
    """

    code = grpc.StatusCode.UNAVAILABLE
    reason = "TASK_HANDED_OVER"

    def __init__(self, task_id: str, why: str) -> None:
        self.task_id = task_id
        super().__init__(
            f"task {quote(task_id)} waits for input and {why}; it goes on: resubscribe "
            "(or resume from your cursor) through another instance"
        )

    def details(self) -> dict[str, str]:
        """The task's id."""
        return {"taskId": self.task_id}


class StoreError(Exception):
    """Base of the errors a task journal raises."""


class StoreUnavailableError(StoreError, ServerError):
    """The journal's backend did not answer in time (e.g. NATS is failing over)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "STORE_UNAVAILABLE"


class UnknownFormatError(StoreError, ServerError):
    """Another instance wrote something in a format this version does not read (a newer one).

    Raised instead of guessing (see ``jetstream.formats``): the operation is
    refused, nothing is misread. Retryable through another, newer instance;
    the operator finishes the upgrade.

    Args:
        what: What was read (a task's snapshot, a record change, a routed request).
        found: The format it says (or the kind, the operation it names).
    """

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNKNOWN_FORMAT"

    def __init__(self, what: str, found: str) -> None:
        self.what, self.found = what, found
        super().__init__(
            f"{what} is in format {quote(found)}, which this version of a2a-grpc-server does "
            "not read (a newer version wrote it); retry through an upgraded instance, and "
            "finish the rolling update"
        )

    def details(self) -> dict[str, str]:
        """What was read, and the format it said."""
        return {"what": self.what, "format": self.found}


class StoreRefusedError(StoreError, ServerError):
    """The journal's backend refused an operation (not a passing outage: no retry helps)."""

    code = grpc.StatusCode.INTERNAL
    reason = "STORE_REFUSED"


class PushConfigLimitError(ServerError):
    """A task already has as many push configs as the server keeps per task."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "PUSH_CONFIG_LIMIT"

    def __init__(self, task_id: str, most: int) -> None:
        self.most = most
        super().__init__(
            f"task {quote(task_id)} already has {most} push notification configs, the most "
            "this server keeps per task; delete one first or reuse its id"
        )

    def details(self) -> dict[str, str]:
        """The limit."""
        return {"limit": str(self.most)}


class PushConfigNotFoundError(ServerError):
    """The task has no push config with this id."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "PUSH_CONFIG_NOT_FOUND"

    def __init__(self, task_id: str, config_id: str) -> None:
        super().__init__(
            f"task {quote(task_id)} has no push notification config {quote(config_id)} "
            "(ListTaskPushNotificationConfigs lists them)"
        )


class QuotaExceededError(ServerError):
    """A principal (or a task) is at one of its quotas, or the instance at one of its limits.

    Args:
        reason: The quota's reason (``LIVE_TASKS_QUOTA``, ...).
        setting: The ``ServerConfig`` setting that sets it.
        most: Its value.
        what: What is counted, for the message.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reasons = (
        "LIVE_TASKS_QUOTA",
        "PARKED_TASKS_QUOTA",
        "STREAMS_QUOTA",
        "SUBSCRIBERS_QUOTA",
        "LIVE_TASKS_LIMIT",
        "STREAMS_LIMIT",
        "LIVE_TASKS_FAIR_SHARE",
        "PARKED_TASKS_FAIR_SHARE",
        "STREAMS_FAIR_SHARE",
        "PUSH_CONFIGS_QUOTA",
    )
    """Every reason it may carry, one per quota."""

    def __init__(self, reason: str, setting: str, most: int, what: str) -> None:
        assert reason in self.reasons, reason
        self.reason = reason
        self.setting, self.most = setting, most
        super().__init__(
            f"{what}: at most {most} at once ({setting}); end or cancel some of them, "
            "or retry later"
        )

    def details(self) -> dict[str, str]:
        """The setting and its value."""
        return {"quota": self.setting, "limit": str(self.most)}


class ParkedTasksLimitError(ServerError):
    """This instance holds ``max_parked_tasks`` tasks waiting for input; no new task now.

    Args:
        most: The limit.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "PARKED_TASKS_LIMIT"

    def __init__(self, most: int) -> None:
        self.most = most
        super().__init__(
            f"this server holds {most} tasks waiting for input (max_parked_tasks); continue "
            "or cancel some of them, or retry later"
        )

    def details(self) -> dict[str, str]:
        """The limit."""
        return {"limit": str(self.most)}


class AuthenticationError(ServerError):
    """Missing or invalid credentials: nothing is executed."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class UnguardableHandlerError(ServerError):
    """A guarded service has a synchronous handler, which authentication cannot guard."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "UNGUARDABLE_HANDLER"

    def __init__(self) -> None:
        super().__init__(
            "this method has a synchronous handler, which the authentication interceptor "
            "cannot guard; serve it with an async handler"
        )


class InvalidFieldError(InvalidParamsError):
    """A request field is missing or malformed.

    Args:
        field: The field path, e.g. ``message.parts``.
        problem: What is wrong and how to fix it, for a person to read.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(message=f"{field}: {problem}")
        self.field = field
        self.problem = problem


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str, status_pb2.Status]:
    """Map an exception to its gRPC code, message and rich status.

    Args:
        exc: The error raised while serving a call.

    Returns:
        The status code, the human-readable message, and the
        ``google.rpc.Status`` to send in the trailing metadata.
    """
    details: list[any_pb2.Any] = []
    metadata: dict[str, str] = {}
    if isinstance(exc, A2AError):
        mapping = A2A_ERROR_MAPPING[_mapped_class(exc)]
        code = getattr(grpc.StatusCode, mapping.grpc_status)
        message, domain, reason = exc.message, A2A_DOMAIN, mapping.reason
        if isinstance(exc, InvalidFieldError):
            bad = error_details_pb2.BadRequest()
            bad.field_violations.add(
                field=_bounded(exc.field, MAX_DETAIL_BYTES),
                description=_bounded(exc.problem, MAX_DETAIL_BYTES),
            )
            details.append(_pack(bad))
    elif isinstance(exc, ServerError):
        code, message, domain, reason = exc.code, str(exc), SERVER_DOMAIN, exc.reason
        metadata = exc.details()
    else:
        logger.error("internal error while serving a call", exc_info=exc)
        code, domain, reason = grpc.StatusCode.INTERNAL, SERVER_DOMAIN, "INTERNAL"
        message = "internal server error; the server log has the details"
    # Messages quote client input through ``quote``; this bounds them whatever slipped by.
    message = _bounded(message, MAX_MESSAGE_BYTES)
    metadata = {key: _bounded(value, MAX_DETAIL_BYTES) for key, value in metadata.items()}
    info = error_details_pb2.ErrorInfo(domain=domain, reason=reason, metadata=metadata)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.extend([_pack(info), *details])
    return code, message, status


async def abort(context: grpc.aio.ServicerContext[object, object], exc: BaseException) -> NoReturn:
    """End the call with the status that ``exc`` maps to.

    Args:
        context: The servicer context of the call.
        exc: The error to report.

    Raises:
        grpc.aio.AbortError: Always; grpc.aio ends the call with it.
    """
    code, message, status = to_status(exc)
    await context.abort(
        code, message, trailing_metadata=((STATUS_DETAILS_KEY, status.SerializeToString()),)
    )
    raise AssertionError("unreachable: context.abort always raises")  # pragma: no cover


class RateLimitedLog:
    """A log line that client behaviour can trigger, written at most once per period.

    What was not written in between is counted and reported with the next
    line, so a flood of bad requests costs one line per period, not one each.

    Args:
        log: The logger.
        level: The level to log at.
        period: Seconds between two lines.
    """

    def __init__(self, log: logging.Logger, level: int, period: float) -> None:
        self._log, self._level, self._period = log, level, period
        self._next = 0.0
        self._skipped = 0

    def log(self, text: str, *args: object) -> None:
        """Log ``text % args`` unless a line was written less than a period ago."""
        if not self._log.isEnabledFor(self._level):
            return
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        self._next = now + self._period
        skipped, self._skipped = self._skipped, 0
        suffix = f" ({skipped} more since the last such line)" if skipped else ""
        self._log.log(self._level, text + suffix, *args)


def quote(text: str, most: int = QUOTE_CHARS) -> str:
    """Client input quoted in an error message: ``repr``, cut to ``most`` characters.

    Every value a client sent (ids, tokens, header values) goes through this
    before it is part of an error, so an error stays small whatever was sent.
    """
    return repr(text) if len(text) <= most else repr(text[:most]) + f"... ({len(text)} chars)"


def _bounded(text: str, most: int) -> str:
    """``text`` cut to ``most`` UTF-8 bytes (a last guard on what goes in a trailer)."""
    data = text.encode()
    if len(data) <= most:
        return text
    return data[: most - 3].decode(errors="ignore") + "..."


def _mapped_class(exc: A2AError) -> type[A2AError]:
    for cls in type(exc).__mro__:
        if cls in _A2A_CODES:
            return cls  # type: ignore[no-any-return]
    return _INTERNAL


def _pack(message: error_details_pb2.ErrorInfo | error_details_pb2.BadRequest) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


_A2A_CODES = frozenset(A2A_ERROR_MAPPING)
_INTERNAL = next(cls for cls, m in A2A_ERROR_MAPPING.items() if m.reason == "INTERNAL_ERROR")

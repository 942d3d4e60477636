"""Task store: the durable record of every task.

``TaskStore`` is the contract every backend implements; the contract tests in
``tests/store`` run against each implementation. The in-memory backend lives
in ``store.memory``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
from a2a.types.a2a_pb2 import Task, TaskState

from ..errors import ServerError


class StoreError(Exception):
    """Base of the errors a task store raises."""


class StoreUnavailableError(StoreError, ServerError):
    """The store's backend did not answer in time (e.g. NATS is failing over)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "STORE_UNAVAILABLE"


class TaskExistsError(StoreError):
    """``create`` was called for a task id the store already holds."""


class VersionConflictError(StoreError):
    """``update`` was given a version that is not the stored one."""


class FinalTaskError(StoreError):
    """``update`` tried to change a task that is already final."""


class UnknownTaskError(StoreError):
    """``update`` named a task the store does not hold."""


@dataclass(frozen=True, slots=True)
class StoredTask:
    """A task, the version it was stored at, and the instance that owns it.

    ``owner`` is the id of the instance that last wrote the task (the one
    running it while it is live); single-instance stores leave it empty.
    """

    task: Task
    version: int
    owner: str = ""


@dataclass(frozen=True, slots=True)
class TaskQuery:
    """Filters and paging of ``TaskStore.list``.

    Attributes:
        context_id: Only tasks of this context ("" for any).
        state: Only tasks in this state (UNSPECIFIED for any).
        status_after_ns: Only tasks whose status timestamp is at or after this
            many nanoseconds since the epoch (0 for any).
        page_size: Most tasks to return.
        page_token: The ``next_page_token`` of the previous page ("" for the first).
    """

    context_id: str = ""
    state: TaskState = TaskState.TASK_STATE_UNSPECIFIED
    status_after_ns: int = 0
    page_size: int = 50
    page_token: str = ""

    def matches(self, context_id: str, state: TaskState, status_ns: int) -> bool:
        """Whether a task with these fields passes the filters."""
        return (
            (not self.context_id or context_id == self.context_id)
            and self.state in (TaskState.TASK_STATE_UNSPECIFIED, state)
            and status_ns >= self.status_after_ns
        )


@dataclass(slots=True)
class TaskPage:
    """One page of ``TaskStore.list``, newest update first."""

    tasks: list[Task] = field(default_factory=list)
    next_page_token: str = ""
    total_size: int = 0


class InvalidPageTokenError(StoreError):
    """The page token was not issued by this store."""


T = TypeVar("T")


def status_ns(task: Task) -> int:
    """The task's status timestamp in nanoseconds since the epoch."""
    ts = task.status.timestamp
    return int(ts.seconds) * 1_000_000_000 + int(ts.nanos)


def paginate(
    matches: list[tuple[int, T]], query: TaskQuery, mark: str, to_task: Callable[[T], Task]
) -> TaskPage:
    """One page of ``(revision, item)`` matches, newest revision first.

    Page tokens are the last revision of the previous page, tagged with
    ``mark`` so a token of one store kind is refused by another.

    Raises:
        InvalidPageTokenError: ``query.page_token`` was not issued with ``mark``.
    """
    before = _decode_token(query.page_token, mark) if query.page_token else None
    matches.sort(key=lambda m: m[0], reverse=True)
    page = [m for m in matches if before is None or m[0] < before][: query.page_size]
    remaining = page and any(rev < page[-1][0] for rev, _ in matches)
    return TaskPage(
        tasks=[to_task(item) for _, item in page],
        next_page_token=_encode_token(page[-1][0], mark) if remaining else "",
        total_size=len(matches),
    )


def _encode_token(rev: int, mark: str) -> str:
    return base64.urlsafe_b64encode(f"{mark}{rev}".encode()).decode()


def _decode_token(token: str, mark: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(token.encode()).decode()
        if not raw.startswith(mark):
            raise ValueError(raw)
        return int(raw[len(mark) :])
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidPageTokenError(f"page_token {token!r} was not issued by this server") from exc


class TaskStore(Protocol):
    """Where tasks live. Every write is a compare-and-set on the version.

    Versions are positive integers; each write of a task returns a greater
    one than the last (not necessarily the next integer: a shared store may
    number writes across tasks).

    Implementations MUST return copies (a caller mutating a returned task does
    not change the store), MUST keep a final task unchanged once written, and
    MUST be safe to call from concurrent coroutines of one event loop.

    Ownership: ``create`` and ``update`` take the task they are given. A
    store MAY keep that object instead of copying it (the in-memory store
    does, so a write costs the same however large the task); the caller
    changes it afterwards only to build its next version and passes it to
    ``update`` with no ``await`` in between, so no reader sees a version
    that was not written.
    """

    async def get(self, task_id: str) -> StoredTask | None:
        """Return the task and its version, or None if the store has no such task."""
        ...

    async def create(self, task: Task) -> int:
        """Store a new task and return its version.

        Raises:
            TaskExistsError: A task with this id is already stored.
        """
        ...

    async def update(self, task: Task, expected_version: int) -> int:
        """Replace the task if it is still at ``expected_version``; return the new version.

        Raises:
            UnknownTaskError: No task with this id is stored.
            FinalTaskError: The stored task is final; it is never overwritten.
            VersionConflictError: The stored version is not ``expected_version``.
        """
        ...

    async def list(self, query: TaskQuery) -> TaskPage:
        """Return one page of tasks matching ``query``, most recently updated first.

        Raises:
            InvalidPageTokenError: ``query.page_token`` is not one this store issued.
        """
        ...

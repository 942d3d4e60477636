"""In-memory task journal with bounded retention of final tasks.

Non-final tasks are kept until they end, as the very objects the core hands
over (see ``TaskJournal``'s ownership rule): a write costs O(1) however large
the task. Frames are not kept here: on a single instance the task's
``TaskLog`` is where readers find them. Final tasks are kept serialized
(compact, immutable) for at most ``final_task_ttl`` seconds and at most
``max_final_tasks`` of them (the oldest final task goes first), so memory
stays flat under sustained load.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from a2a.types.a2a_pb2 import Task, TaskState

from ..model import taskops
from ..model.taskops import TERMINAL
from . import (
    Change,
    FinalTaskError,
    RecordedTask,
    TaskExistsError,
    TaskPage,
    TaskQuery,
    UnknownTaskError,
    VersionConflictError,
    paginate,
    status_ns,
)


@dataclass(slots=True)
class _Entry:
    live: Task | None
    """The task itself while it is not final (owned by the journal)."""
    blob: bytes
    """The serialized task once it is final."""
    version: int
    seq: int
    rev: int
    context_id: str
    state: TaskState
    status_ns: int
    scope: str


class MemoryJournal:
    """A ``TaskJournal`` in this process's memory.

    Args:
        max_final_tasks: Most final tasks kept.
        final_task_ttl: Seconds a final task is kept after it ended.
        clock: Monotonic clock, replaceable in tests.
    """

    def __init__(
        self,
        max_final_tasks: int = 10_000,
        final_task_ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: dict[str, _Entry] = {}
        self._final: OrderedDict[str, float] = OrderedDict()
        self._max_final = max_final_tasks
        self._ttl = final_task_ttl
        self._clock = clock
        self._rev = 0
        self.on_forget: Callable[[str], None] | None = None
        """Called with the id of each final task retention drops (its push configs go too)."""

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, task_id: str) -> RecordedTask | None:
        """Return the task, its version and the seq of its last change, or None."""
        self._prune()
        entry = self._entries.get(task_id)
        if entry is None:
            return None
        return RecordedTask(_copy(entry), entry.version, seq=entry.seq, scope=entry.scope)

    async def create(
        self, task: Task, changes: Sequence[Change], *, keep_frames: bool = True, scope: str = ""
    ) -> int:
        """Record a new task at version 1.

        Raises:
            TaskExistsError: The id is taken.
        """
        if task.id in self._entries:
            raise TaskExistsError(task.id)
        self._put(task, 1, changes[-1].seq, scope)
        self._prune()
        return 1

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        """Compare-and-set the task on its version.

        Raises:
            UnknownTaskError: No such task.
            FinalTaskError: The recorded task is final.
            VersionConflictError: The version moved on.
        """
        entry = self._entries.get(task.id)
        if entry is None:
            raise UnknownTaskError(task.id)
        if entry.state in TERMINAL:
            raise FinalTaskError(task.id)
        if entry.version != expected_version:
            raise VersionConflictError(
                f"{task.id}: at {entry.version}, expected {expected_version}"
            )
        self._put(task, expected_version + 1, changes[-1].seq, entry.scope)
        return expected_version + 1

    async def list(self, query: TaskQuery) -> TaskPage:
        """Return one page, most recently updated first.

        Raises:
            InvalidPageTokenError: The token is malformed.
        """
        self._prune()
        found = [
            (e.rev, e)
            for e in self._entries.values()
            if query.matches(e.context_id, e.state, e.status_ns, e.scope)
        ]
        return paginate(found, query, "r", _copy)

    def _put(self, task: Task, version: int, seq: int, scope: str) -> None:
        self._rev += 1
        state = task.status.state
        final = state in TERMINAL
        entry = self._entries.get(task.id)
        if not final and entry is not None and entry.live is task:
            # The live task was updated in place (the usual case, event by
            # event): only what ListTasks filters and sorts on moves.
            entry.version, entry.seq, entry.rev, entry.state = version, seq, self._rev, state
            entry.status_ns = status_ns(task)
            return
        self._entries[task.id] = _Entry(
            live=None if final else task,
            blob=task.SerializeToString() if final else b"",
            version=version,
            seq=seq,
            rev=self._rev,
            context_id=task.context_id,
            state=state,
            status_ns=status_ns(task),
            scope=scope,
        )
        if final:
            self._final[task.id] = self._clock()
            self._prune()

    def _prune(self) -> None:
        horizon = self._clock() - self._ttl
        while self._final:
            task_id, ended = next(iter(self._final.items()))
            if len(self._final) <= self._max_final and ended >= horizon:
                break
            del self._final[task_id]
            self._entries.pop(task_id, None)
            if self.on_forget is not None:
                self.on_forget(task_id)


def _copy(entry: _Entry) -> Task:
    if entry.live is None:
        return Task.FromString(entry.blob)
    return taskops.copy(entry.live)

"""In-memory task journal with bounded retention of final tasks.

Non-final tasks are kept until they end, as the very objects the core hands
over (see ``TaskJournal``'s ownership rule): a write costs O(1) however large
the task. Frames are not kept here: on a single instance the task's
``TaskLog`` is where readers find them. Final tasks are kept serialized
(compact, immutable) for at most ``final_task_ttl`` seconds, at most
``max_final_tasks`` of them and at most ``max_final_bytes`` of them, so
memory stays flat under sustained load. Over a bound, the task that goes is
the oldest of the principal keeping the most (tasks, or bytes, as the bound
is; tenants are not counted apart, since a client picks them): one caller
completing many tasks, or large ones, evicts its own results, never another
caller's first. Choosing costs O(principals keeping results).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from a2a.types.a2a_pb2 import Task, TaskState

from ..model import taskops
from ..model.scope import principal_of
from ..model.taskops import TERMINAL
from . import (
    Change,
    FinalTaskError,
    PageTokens,
    RecordedTask,
    TaskExistsError,
    TaskPage,
    TaskQuery,
    UnknownTaskError,
    VersionConflictError,
    status_ns,
)
from .index import RevList, Walk

_IndexKey = tuple[str, ...]


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
    written_ns: int
    """When it was last written (ns since the epoch), raised to the greatest status
    timestamp written up to then: never going back, and never under the status
    timestamp of a task written earlier."""
    task_id: str

    def index_keys(self) -> tuple[_IndexKey, ...]:
        """The index keys it is listed under."""
        state = str(int(self.state))
        return (
            ("", self.scope),
            ("c", self.scope, self.context_id),
            ("s", self.scope, state),
            ("cs", self.scope, self.context_id, state),
        )


class MemoryJournal:
    """A ``TaskJournal`` in this process's memory.

    Args:
        max_final_tasks: Most final tasks kept.
        final_task_ttl: Seconds a final task is kept after it ended.
        clock: Monotonic clock, replaceable in tests.
        max_final_bytes: Most bytes of final tasks kept (serialized).
    """

    def __init__(
        self,
        max_final_tasks: int = 10_000,
        final_task_ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        max_final_bytes: int = 512 * 1024 * 1024,
    ) -> None:
        self._entries: dict[str, _Entry] = {}
        self._final: OrderedDict[str, float] = OrderedDict()
        """Final tasks, oldest first, with the time each ended (for ``final_task_ttl``)."""
        self._by_principal: dict[str, OrderedDict[str, int]] = {}
        """Final tasks of each principal (tenants aside: a client picks those), oldest
        first, with their sizes."""
        self._principal_bytes: Counter[str] = Counter()
        self._final_bytes = 0
        self._max_final_bytes = max_final_bytes
        self._max_final = max_final_tasks
        self._ttl = final_task_ttl
        self._clock = clock
        self._tokens = PageTokens()
        self._rev = 0
        self._at_rev: dict[int, _Entry] = {}
        """Every entry by its current revision (what the indexes hold)."""
        self._index: dict[_IndexKey, RevList | int] = {}
        """The revisions under each index key; a key of one task (a context's, mostly)
        holds its revision alone: no object for the collector's full passes to scan."""
        self._written_ns = 0
        self.on_forget: Callable[[str], None] | None = None
        """Called with the id of each final task retention drops (its push configs go too)."""

    def __len__(self) -> int:
        return len(self._entries)

    def scope_of(self, task_id: str) -> str | None:
        """The task's scope, read without its body (None: not known without a read)."""
        entry = self._entries.get(task_id)
        return entry.scope if entry is not None else None

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
        """Return one page, most recently updated first, walking the query's index.

        Raises:
            InvalidPageTokenError: The token is malformed.
        """
        self._prune()
        walk = Walk[_Entry](query, "r", self._tokens)
        held = self._index.get(_query_key(query))
        if held is None:
            return TaskPage()
        index = held if isinstance(held, RevList) else _lone(held)
        found, next_token, after = walk.page(
            ((rev, self._at_rev[rev]) for rev in index.below(walk.before)),
            _written,
            _status,
        )
        if query.status_after_ns:
            total = walk.count((self._at_rev[rev] for rev in index.below()), _written, _status)
        else:
            total = len(index)
        return TaskPage([_copy(e) for _, e in found], next_token, total, after)

    def _put(self, task: Task, version: int, seq: int, scope: str) -> None:
        self._rev += 1
        # Never below any status timestamp written so far, so a walk down the
        # revisions may stop at the first task under a status filter's time.
        self._written_ns = max(self._written_ns, time.time_ns(), status_ns(task))
        state = task.status.state
        final = state in TERMINAL
        entry = self._entries.get(task.id)
        if entry is not None:
            self._unindex(entry)
        if not final and entry is not None and entry.live is task:
            # The live task was updated in place (the usual case, event by
            # event): only what ListTasks filters and sorts on moves.
            entry.version, entry.seq, entry.rev, entry.state = version, seq, self._rev, state
            entry.status_ns, entry.written_ns = status_ns(task), self._written_ns
            self._reindex(entry)
            return
        entry = self._entries[task.id] = _Entry(
            live=None if final else task,
            blob=task.SerializeToString() if final else b"",
            version=version,
            seq=seq,
            rev=self._rev,
            context_id=task.context_id,
            state=state,
            status_ns=status_ns(task),
            scope=scope,
            written_ns=self._written_ns,
            task_id=task.id,
        )
        self._reindex(entry)
        if final:
            size = len(self._entries[task.id].blob)
            self._final[task.id] = self._clock()
            principal = principal_of(scope)
            self._by_principal.setdefault(principal, OrderedDict())[task.id] = size
            self._principal_bytes[principal] += size
            self._final_bytes += size
            self._prune()

    def _prune(self) -> None:
        horizon = self._clock() - self._ttl
        while self._final:
            task_id, ended = next(iter(self._final.items()))
            if ended >= horizon:
                break
            self._forget(task_id)
        while len(self._final) > self._max_final:
            self._forget_oldest_of(
                max(self._by_principal, key=lambda s: len(self._by_principal[s]))
            )
        while self._final_bytes > self._max_final_bytes:
            self._forget_oldest_of(max(self._by_principal, key=self._principal_bytes.__getitem__))

    def _reindex(self, entry: _Entry) -> None:
        self._at_rev[entry.rev] = entry
        indexes = self._index
        for key in entry.index_keys():
            held = indexes.get(key)
            if held is None:
                indexes[key] = entry.rev
            elif isinstance(held, int):
                indexes[key] = index = _lone(held)
                index.add(entry.rev)
            else:
                held.add(entry.rev)

    def _unindex(self, entry: _Entry) -> None:
        del self._at_rev[entry.rev]
        indexes = self._index
        for key in entry.index_keys():
            held = indexes[key]
            if isinstance(held, int):
                if held != entry.rev:
                    raise KeyError(entry.rev)
                del indexes[key]
                continue
            held.remove(entry.rev)
            if not held:
                del indexes[key]

    def _forget_oldest_of(self, principal: str) -> None:
        self._forget(next(iter(self._by_principal[principal])))

    def _forget(self, task_id: str) -> None:
        """Drop a final task (its push configs go too: ``on_forget``)."""
        del self._final[task_id]
        entry = self._entries.pop(task_id)
        self._unindex(entry)
        principal = principal_of(entry.scope)
        kept = self._by_principal[principal]
        size = kept.pop(task_id)
        self._principal_bytes[principal] -= size
        self._final_bytes -= size
        if not kept:
            del self._by_principal[principal]
            del self._principal_bytes[principal]
        if self.on_forget is not None:
            self.on_forget(task_id)


def _query_key(query: TaskQuery) -> _IndexKey:
    state = str(int(query.state))
    if query.context_id and query.state:
        return ("cs", query.scope, query.context_id, state)
    if query.context_id:
        return ("c", query.scope, query.context_id)
    if query.state:
        return ("s", query.scope, state)
    return ("", query.scope)


def _lone(rev: int) -> RevList:
    """An index holding ``rev`` alone."""
    index = RevList()
    index.add(rev)
    return index


def _written(entry: _Entry) -> int:
    return entry.written_ns


def _status(entry: _Entry) -> int:
    return entry.status_ns


def _copy(entry: _Entry) -> Task:
    if entry.live is None:
        return Task.FromString(entry.blob)
    return taskops.copy(entry.live)

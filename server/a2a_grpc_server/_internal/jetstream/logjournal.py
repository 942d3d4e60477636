"""The journal of format 3: tasks in the task log, listed from the index nats-server keeps.

Step 2 of docs/decisions/0001-cluster-store-layout.md (issue 41), its first half:
``TaskJournal`` on ``tasklog``, asserted by the journal contract suite on a real
nats-server. ``serve`` uses it through ``store.ClusterJournal`` (the upgrade rule,
``formats``, decides when an instance creates tasks in it).

A write is one message (``TaskLog.append``): an ``s`` when a snapshot is due,
else an ``e``; an ``f`` when the task ends. A snapshot is due at the task's first
write, when its state changes or is interrupted, every ``snapshot_every`` changes,
when this instance writes a task whose last snapshot another wrote (a survivor
taking it over: a reader reads the ``e`` after a snapshot on its writer's subject),
and once its last snapshot is half ``task_ttl`` old (the log's age limit counts per
message: the ``s`` must not go before the ``e`` after it).

A task is read by id from the log: its newest ``s`` or its ``f``, then the ``e``
after it, folded (``TaskLog.read``).

Listing is ``loglisting``'s: pages read from the index nats-server keeps.

Who runs what: as ``JetStreamJournal``: the owner writes a task under its lock;
anyone else only through the log's compare-and-set. ``_known`` is this instance's
view of the tasks it writes, dropped when they end.
"""

from __future__ import annotations

import builtins
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from a2a.types.a2a_pb2 import Task
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from ..journal import (
    Change,
    PageTokens,
    RecordedTask,
    TaskExistsError,
    TaskPage,
    TaskQuery,
    UnknownTaskError,
)
from ..model import taskops
from . import pullread
from .loglisting import LogListing
from .logowners import LogOwners
from .records import Entry, resume_from
from .requests import JetStreamRequests
from .retry import Retry
from .tasklog import (
    CURRENT_STREAM,
    LOG_STREAM,
    TaskLog,
    Where,
    decode,
    fold,
    task_filter,
)

REPLAY_PROBE = 16
"""Messages a resumed stream's start reads to find the task's oldest change (a release or
a claim holds none)."""
KNOWN = 65_536
"""Tasks this instance writes that a journal remembers (see ``LogJournal._known``)."""


@dataclass(slots=True)
class _Known:
    """What this instance knows of a task it writes."""

    scope: str
    context_id: str
    owner: str
    """Who wrote its last snapshot."""
    seq: int
    """Its last snapshot's last change."""
    state: int
    at: float = -math.inf
    """When this instance wrote its last snapshot (monotonic; -inf: read, not written)."""


class LogJournal:
    """``TaskJournal`` on the task log and its index (format 3).

    Args:
        requests: Lean requests on the connection (publish, direct get).
        js: The JetStream context (a relay's consumer).
        owner: This instance's id, recorded with every task it writes.
        snapshot_every: Changes between two snapshots of a running task.
        retry: How long an operation retries through a NATS outage.
        page_tokens: Seals ListTasks page tokens.
        log_stream: The log's stream (tests name their own).
        index_stream: The index's stream.
        task_ttl: How long the log keeps a message: a running task is snapshotted again
            at half of it, so its newest ``s`` never expires before its ``e``.
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        js: JetStreamContext,
        owner: str,
        snapshot_every: int = 32,
        retry: Retry | None = None,
        page_tokens: PageTokens | None = None,
        log_stream: str = LOG_STREAM,
        index_stream: str = CURRENT_STREAM,
        task_ttl: float = 86_400.0,
    ) -> None:
        self._requests = requests
        self._js = js
        self._owner = owner
        self._every = snapshot_every
        self._retry = retry or Retry()
        self._log = TaskLog(requests, owner, self._retry, log_stream)
        self._owners = LogOwners(requests, self._log, owner, self._retry, log_stream)
        self._log_stream = log_stream
        self._listing = LogListing(
            requests, self._log, page_tokens or PageTokens(), self._retry, log_stream, index_stream
        )
        self._known: OrderedDict[str, _Known] = OrderedDict()
        """The tasks this instance writes, newest last (``KNOWN`` at most: one forgotten
        is read from the log at its next write)."""
        self._renew_after = task_ttl / 2 if task_ttl > 0 else math.inf  # (0: no age limit)

    @property
    def owner(self) -> str:
        """The instance id this journal records as owner."""
        return self._owner

    @property
    def log(self) -> TaskLog:
        """The task log under this journal."""
        return self._log

    @property
    def owners(self) -> LogOwners:
        """Sweeps, releases and claims of the log's tasks."""
        return self._owners

    def scope_of(self, task_id: str) -> str | None:
        """None: a task's scope is in its snapshot, read over the network like its body."""
        return None

    async def get(self, task_id: str) -> RecordedTask | None:
        """The task as last written (None: not in the log).

        Raises:
            StoreUnavailableError: NATS did not answer.
            UnknownFormatError: A message in a format this version does not read.
        """
        read = await self._log.read(task_id)
        return None if read is None else fold(read)

    async def create(
        self, task: Task, changes: Sequence[Change], *, keep_frames: bool = True, scope: str = ""
    ) -> int:
        """Record a new task: one message, its first changes and its snapshot.

        ``keep_frames`` makes no difference: a task that ends in its first write is
        one ``f`` either way.

        Raises:
            TaskExistsError: The id is taken.
            PartialWriteError: Changes too large for one message: some were recorded.
            StoreUnavailableError: NATS did not answer.
        """
        await self._owners.register()  # (once, before its first task: sweeps start there)
        where = Where(task.id, self._owner, scope, task.context_id)
        try:
            version = await self._log.append(where, changes, task, 0)
        except UnknownTaskError:  # (refused at 0, its messages gone since: taken all the same)
            raise TaskExistsError(task.id) from None
        if not taskops.is_final(task):
            known = _Known(
                scope,
                task.context_id,
                self._owner,
                changes[-1].seq,
                task.status.state,
                time.monotonic(),
            )
            self._remember(task.id, known)
        return version

    def _remember(self, task_id: str, known: _Known) -> None:
        self._known[task_id] = known
        self._known.move_to_end(task_id)
        if len(self._known) > KNOWN:
            self._known.popitem(last=False)

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        """Record ``changes`` if nobody wrote the task since ``expected_version``.

        Raises:
            UnknownTaskError: The task is not in the log.
            FinalTaskError: The task ended.
            VersionConflictError: Someone else wrote it.
            PartialWriteError: Changes too large for one message: some were recorded.
            StoreUnavailableError: NATS did not answer.
        """
        known = self._known.get(task.id)
        if known is None:
            read = await self._log.read(task.id)
            if read is None:
                raise UnknownTaskError(task.id)
            snap = read.snapshot
            context = snap.task().context_id
            known = _Known(snap.scope, context, snap.owner, read.seq, snap.state)
        seq, state = changes[-1].seq, task.status.state
        now = time.monotonic()
        due = (
            taskops.is_final(task)
            or state in taskops.INTERRUPTED
            or state != known.state
            or seq - known.seq >= self._every
            or known.owner != self._owner
            or now - known.at > self._renew_after  # (the log's age limit counts per message)
        )
        where = Where(task.id, self._owner, known.scope, known.context_id)
        try:
            version = await self._log.append(
                where, changes, task if due else None, expected_version
            )
        except BaseException:
            self._known.pop(task.id, None)  # (read again at the next write)
            raise
        if taskops.is_final(task):
            self._known.pop(task.id, None)
            return version
        if due:
            known.owner, known.seq, known.state, known.at = self._owner, seq, state, now
        self._remember(task.id, known)
        return version

    async def entries(
        self, task_id: str, after_pos: int, messages: int | None = None
    ) -> builtins.list[Entry]:
        """The task's changes in the messages stored after position ``after_pos``.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        return await self._log.entries(task_id, after_pos, most=messages)

    async def last_entry(self, task_id: str) -> Entry | None:
        """The task's last change (None: not in the log, or its last message holds none)."""
        last = await self._log.last(task_id)
        return last.changes[-1] if last is not None and last.changes else None

    def unpack(self, msg: Msg, pos: int) -> builtins.list[Entry]:
        """The changes a message of the log holds (delivered by ``follow``).

        Raises:
            UnknownFormatError: Not a message of this log's format.
        """
        return decode(msg, pos).changes

    async def follow(
        self, task_id: str, after_pos: int, handle: Callable[[Msg], Awaitable[None]]
    ) -> JetStreamContext.PushSubscription:
        """Deliver every message of the task after position ``after_pos`` to ``handle``.

        An ordered consumer on the task's subjects, as ``JetStreamJournal.follow``.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        return await self._retry(
            lambda: pullread.follow(
                self._js, self._log_stream, task_filter(task_id), after_pos, handle
            ),
            f"follow task {task_id}",
        )

    async def replay_start(self, task_id: str, after: int, last: int) -> int:
        """Where a resumed stream's relay follows from: before the task's first message.

        The log keeps each message ``task_ttl`` (its stream's age limit, per message):
        a change older than that is gone, and the stream is refused as for the
        bucket's event streams. Messages without changes (releases, claims) are skipped.

        Raises:
            FrameNotKeptError: The log does not hold change ``after + 1``.
            StoreUnavailableError: NATS did not answer.
        """
        first = await self._log.entries(task_id, 0, most=REPLAY_PROBE)  # (past releases)
        return resume_from(task_id, first, after, last)

    @property
    def listing(self) -> LogListing:
        """Pages of the log's tasks, from the index nats-server keeps."""
        return self._listing

    async def list(self, query: TaskQuery) -> TaskPage:
        """One page of the scope's tasks (``LogListing.list``).

        Raises:
            InvalidPageTokenError: ``query.page_token`` is not one this journal issued.
            StoreUnavailableError: NATS did not answer, or the index lags the log.
        """
        return await self._listing.list(query)

    async def total(self, query: TaskQuery) -> int:
        """How many of the scope's tasks match ``query`` (``LogListing.total``).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        return await self._listing.total(query)

    async def caught_up(self) -> None:
        """Return once the index holds what the log held when called (``LogListing``).

        Raises:
            StoreUnavailableError: Not within ``Retry.timeout``.
        """
        await self._listing.caught_up()

    async def holds_any(self) -> bool:
        """Whether the log holds any task (``LogListing.holds_any``)."""
        return await self._listing.holds_any()

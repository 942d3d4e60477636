"""The cluster's journal: tasks of format 2 (the snapshot bucket) and of format 3 (the task log).

Issue 41 moves the record to the task log (docs/decisions/0001-cluster-store-layout.md,
step 3: the upgrade rule). Until the last task of format 2 expires, an instance
reads both: this façade sends each call to the journal that holds its task.

* A new task goes to the log only when ``Formats.writes_log`` (this instance was
  asked to, and every live instance reads format 3); else to the bucket, as
  versions before did.
* A task is read from the layout new tasks go to first (the log, unless
  ``nats_task_log`` is off), then from the other; where each task was found is
  remembered (bounded), so its writes and relays go to the same journal. A task
  is created in one layout only and stays there, so the order is only a cost; a
  layout that does not answer is passed over (its error raised if the other does
  not hold the task either).
* A listing returns the log's tasks first, then the bucket's: most recently
  written first within each. A token of the log's continues there; the log's
  last page continues with the bucket's first; the bucket's tokens are its own.
  ``total_size`` is the sum. While the log holds no task (its index's state, or
  one direct get, says so), the bucket alone answers, as before.

Who runs what: as the journals under it. The bounded map of where tasks are is
only touched between awaits.
"""

from __future__ import annotations

import builtins
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from a2a.types.a2a_pb2 import Task
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from ..journal import (
    Change,
    InvalidPageTokenError,
    PageTokens,
    RecordedTask,
    Released,
    StoreUnavailableError,
    TaskPage,
    TaskQuery,
)
from .formats import HEADER as FORMAT
from .formats import LOG, Formats
from .index import TaskIndex
from .journal import JetStreamJournal
from .listing import Listing
from .logjournal import LogJournal
from .loglisting import MARK
from .ownership import SWEEP_BATCH
from .records import Entry, Snapshot, resume_from
from .snapshots import SnapshotStore

KNOWN = 65_536
"""Tasks whose journal is remembered (the oldest forgotten first: read again)."""
LOG_DONE = "log-done"
"""What a token is sealed for that starts the bucket's listing after the log's last page."""


_T = TypeVar("_T")


class ClusterJournal:
    """``TaskJournal`` over both layouts (see the module docstring).

    Args:
        legacy: Tasks of formats 1 and 2.
        log: Tasks of format 3.
        formats: Which layout new tasks go to.
        page_tokens: The tokens both journals seal (this façade seals ``LOG_DONE``).
    """

    def __init__(
        self, legacy: JetStreamJournal, log: LogJournal, formats: Formats, page_tokens: PageTokens
    ) -> None:
        self._legacy = legacy
        self._log = log
        self._formats = formats
        self._tokens = page_tokens
        self._in_log: OrderedDict[str, bool] = OrderedDict()
        self._ownership = ClusterOwnership(self)

    @property
    def owner(self) -> str:
        """The instance id both journals record as owner."""
        return self._legacy.owner

    @property
    def legacy(self) -> JetStreamJournal:
        """The journal of formats 1 and 2."""
        return self._legacy

    @property
    def log(self) -> LogJournal:
        """The journal of format 3."""
        return self._log

    @property
    def listing(self) -> Listing:
        """The bucket's listing (its index's upkeep)."""
        return self._legacy.listing

    @property
    def ownership(self) -> ClusterOwnership:
        """Releases and claims of either layout's tasks; the bucket's sweeps."""
        return self._ownership

    @property
    def index(self) -> TaskIndex:
        """The bucket's listing index (shared with the push configs' delivery entries)."""
        return self._legacy.index

    @property
    def snapshots(self) -> SnapshotStore:
        """The snapshot bucket."""
        return self._legacy.snapshots

    def scope_of(self, task_id: str) -> str | None:
        """None: a task's scope is in its record, read over the network like its body."""
        return None

    def _remember(self, task_id: str, in_log: bool) -> None:
        self._in_log[task_id] = in_log
        self._in_log.move_to_end(task_id)
        if len(self._in_log) > KNOWN:
            self._in_log.popitem(last=False)

    async def logged(self, task_id: str) -> bool:
        """Whether the task is in the log (else in the bucket, or nowhere)."""
        known = self._in_log.get(task_id)
        if known is not None:
            return known

        async def held(in_log: bool) -> object | None:
            if in_log:
                return await self._log.log.last(task_id)
            return await self._legacy.snapshot(task_id)

        found = await self._find(task_id, held)
        return found is not None and found[0]  # (in neither: not remembered, may be created)

    async def _find(
        self, task_id: str, read: Callable[[bool], Awaitable[_T | None]]
    ) -> tuple[bool, _T] | None:
        """Which layout holds a task not remembered (True: the log), and ``read`` of it.

        ``read`` is tried on one layout, then the other; the one that held it is
        remembered. First, the layout new tasks are created in (``nats_task_log``), so
        most reads take one request; a layout that does not answer does not hide the
        other's tasks (its error is raised if the other does not hold the task either).

        Raises:
            StoreUnavailableError: A layout did not answer, and the other does not hold it.
        """
        failed: StoreUnavailableError | None = None
        for in_log in (True, False) if self._formats.log_wanted else (False, True):
            try:
                found = await read(in_log)
            except StoreUnavailableError as exc:
                failed = exc
                continue
            if found is not None:
                self._remember(task_id, in_log)
                return in_log, found
        if failed is not None:
            raise failed
        return None

    async def get(self, task_id: str) -> RecordedTask | None:
        """The task as last written, from whichever journal holds it (None: neither).

        Raises:
            StoreUnavailableError: NATS did not answer.
            UnknownFormatError: A record in a format this version does not read.
        """
        known = self._in_log.get(task_id)
        if known is not None:
            return await (self._log if known else self._legacy).get(task_id)
        found = await self._find(
            task_id, lambda in_log: (self._log if in_log else self._legacy).get(task_id)
        )
        return None if found is None else found[1]

    async def create(
        self, task: Task, changes: Sequence[Change], *, keep_frames: bool = True, scope: str = ""
    ) -> int:
        """Record a new task in the layout the cluster writes now (see ``formats``).

        Raises:
            As ``JetStreamJournal.create`` and ``LogJournal.create``.
        """
        if self._formats.writes_log:
            version = await self._log.create(task, changes, keep_frames=keep_frames, scope=scope)
            self._remember(task.id, True)
            return version
        version = await self._legacy.create(task, changes, keep_frames=keep_frames, scope=scope)
        self._remember(task.id, False)
        return version

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        """Record ``changes`` in the journal that holds the task.

        Raises:
            As ``JetStreamJournal.update`` and ``LogJournal.update``.
        """
        if await self.logged(task.id):
            return await self._log.update(task, expected_version, changes)
        return await self._legacy.update(task, expected_version, changes)

    async def repair(self, recorded: RecordedTask) -> None:
        """Rewrite a bucket task's snapshot behind its ended record.

        The log needs none: a task's final message there is its snapshot.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if not await self.logged(recorded.task.id):
            await self._legacy.repair(recorded)

    async def entries(
        self, task_id: str, after_pos: int, messages: int | None = None
    ) -> builtins.list[Entry]:
        """The task's changes stored after position ``after_pos`` (see the journals)."""
        if await self.logged(task_id):
            return await self._log.entries(task_id, after_pos, messages)
        return await self._legacy.entries(task_id, after_pos, messages)

    async def last_entry(self, task_id: str) -> Entry | None:
        """The task's last change."""
        if await self.logged(task_id):
            return await self._log.last_entry(task_id)
        return await self._legacy.last_entry(task_id)

    def unpack(self, msg: Msg, pos: int) -> builtins.list[Entry]:
        """The changes a delivered message holds, in its own format.

        Raises:
            UnknownFormatError: A format this version does not read.
        """
        if (msg.headers or {}).get(FORMAT) == str(LOG):
            return self._log.unpack(msg, pos)
        return Entry.unpack(msg, pos)

    async def follow(
        self, task_id: str, after_pos: int, handle: Callable[[Msg], Awaitable[None]]
    ) -> JetStreamContext.PushSubscription:
        """Deliver every change of the task after position ``after_pos`` to ``handle``."""
        if await self.logged(task_id):
            return await self._log.follow(task_id, after_pos, handle)
        return await self._legacy.follow(task_id, after_pos, handle)

    async def replay_start(self, task_id: str, after: int, last: int) -> int:
        """Where a resumed stream's relay follows from (the position before it).

        From the task's snapshot when it is at or before the cursor, else from the
        first change its record still holds.

        Raises:
            FrameNotKeptError: The record no longer holds change ``after + 1``.
            StoreUnavailableError: NATS did not answer.
        """
        if await self.logged(task_id):
            return await self._log.replay_start(task_id, after, last)
        snap = await self._legacy.snapshot(task_id)
        if snap is not None and snap.pos and snap.seq <= after:
            return snap.pos
        first = await self._legacy.entries(task_id, 0, messages=1)
        return resume_from(task_id, first, after, last)

    async def list(self, query: TaskQuery) -> TaskPage:
        """The log's tasks, then the bucket's (see the module docstring).

        Raises:
            InvalidPageTokenError: ``query.page_token`` is not one this journal issued.
            StoreUnavailableError: NATS did not answer.
        """
        phase = self._phase(query.page_token, query.scope) if query.page_token else "log"
        if phase == LOG_DONE:
            page = await self._legacy.list(replace(query, page_token=""))
            page.total_size += await self._log.total(query)
            return page
        if phase == "bucket":
            page = await self._legacy.list(query)
            if await self._log.holds_any():
                page.total_size += await self._log.total(query)
            return page
        if not query.page_token and not await self._log.holds_any():
            return await self._legacy.list(query)  # (nothing in the log: as before it)
        page = await self._log.list(query)
        rest = query.page_size - len(page.tasks)
        if page.next_page_token:
            first = replace(query, page_size=1, page_token="")  # (for its total)
            page.total_size += (await self._legacy.list(first)).total_size
            return page
        bucket = await self._legacy.list(replace(query, page_size=max(rest, 1), page_token=""))
        page.total_size += bucket.total_size
        if rest <= 0:
            if bucket.tasks:
                page.next_page_token = self._tokens.encode(1, LOG_DONE, query.scope)
            return page
        page.tasks += bucket.tasks
        page.after += bucket.after
        page.next_page_token = bucket.next_page_token
        return page

    def _phase(self, token: str, scope: str) -> str:
        """Which listing a page token continues: ``log``, ``LOG_DONE`` or ``bucket``."""
        for mark in (MARK, LOG_DONE):
            try:
                self._tokens.decode(token, mark, scope)
            except InvalidPageTokenError:
                continue
            return "log" if mark == MARK else LOG_DONE
        return "bucket"

    async def close(self) -> None:
        """Finish the bucket's index deletes (bounded)."""
        await self._legacy.close()


class ClusterOwnership:
    """Releases and claims sent to the journal that holds the task (see ``ClusterJournal``).

    The bucket's sweeps pass through (``Ownership``); the log's are ``LogOwners``'
    (``LogJournal.owners``), which the lease reads after them.
    """

    def __init__(self, journal: ClusterJournal) -> None:
        self._journal = journal
        self._legacy = journal.legacy.ownership

    def owned_unfinished_batches(
        self, lost: Callable[[str], bool], size: int = SWEEP_BATCH
    ) -> AsyncGenerator[builtins.list[Snapshot]]:
        """The bucket's (``Ownership.owned_unfinished_batches``)."""
        return self._legacy.owned_unfinished_batches(lost, size)

    async def unfinished(self) -> builtins.list[Snapshot]:
        """The bucket's (``Ownership.unfinished``)."""
        return await self._legacy.unfinished()

    async def release(self, task_id: str, owner: str) -> Released:
        """Record a waiting task of ``owner``'s as owned by nobody (either layout).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if await self._journal.logged(task_id):
            return await self._journal.log.owners.release(task_id, owner)
        return await self._legacy.release(task_id, owner)

    async def claim(self, task_id: str) -> RecordedTask | None:
        """Take over a waiting task nobody owns (either layout).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if await self._journal.logged(task_id):
            return await self._journal.log.owners.claim(task_id)
        return await self._legacy.claim(task_id)

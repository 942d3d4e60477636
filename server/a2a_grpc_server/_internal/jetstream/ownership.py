"""Who runs a task, on JetStream: sweeps of a lost owner's tasks, releases and claims.

A snapshot names its task's owner (``records``). A survivor finds a lost
owner's unfinished tasks through the owner's index entries (``index``), or by
reading every snapshot before the index can be trusted; a waiting task is
released to nobody and claimed by whoever takes its next message, each a
compare-and-set on the snapshot (``snapshots``).
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from ..journal import RecordedTask, Released, VersionConflictError
from ..model import taskops
from .formats import CURRENT as CURRENT_FORMAT
from .formats import Formats
from .index import STALE_AFTER, IndexEntry, TaskIndex
from .listing import INDEX_CONCURRENCY
from .records import Entry, Snapshot, encode
from .snapshots import SnapshotStore

SWEEP_BATCH = 500
"""Snapshots a sweep reads at a time through the index (it ends them before reading more)."""
RELEASE_ATTEMPTS = 2
"""Reads of a task ``release`` makes when its snapshot moves under it."""


class Ownership:
    """Sweeps, releases and claims of tasks for one journal.

    Args:
        snapshots: The snapshots (read, scanned, compare-and-set).
        index: The listing index (its owner entries).
        formats: What the cluster's instances read.
        owner: This instance's id (what a claim records).
        read: Reads a task's snapshot (the journal's: it remembers where records are).
        fold: A snapshot's task brought up to its last change.
        last_entry: The task's last change in its record.
        forget: Drops what the journal knows of a task's snapshot (rewritten here).
    """

    def __init__(
        self,
        snapshots: SnapshotStore,
        index: TaskIndex,
        formats: Formats,
        owner: str,
        read: Callable[[str], Awaitable[Snapshot | None]],
        fold: Callable[[str, Snapshot], Awaitable[RecordedTask]],
        last_entry: Callable[[str], Awaitable[Entry | None]],
        forget: Callable[[str], None],
    ) -> None:
        self._snapshots = snapshots
        self._index = index
        self._formats = formats
        self._owner = owner
        self._read = read
        self._fold = fold
        self._last_entry = last_entry
        self._forget = forget

    async def owned_unfinished(self, lost: Callable[[str], bool]) -> builtins.list[Snapshot]:
        """The snapshots of the unfinished tasks of the owners ``lost`` picks, from the index.

        All of ``owned_unfinished_batches``'s batches in one list.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        return [snap async for batch in self.owned_unfinished_batches(lost) for snap in batch]

    async def owned_unfinished_batches(
        self, lost: Callable[[str], bool], size: int = SWEEP_BATCH
    ) -> AsyncGenerator[builtins.list[Snapshot]]:
        """The snapshots of the unfinished tasks of the owners ``lost`` picks, ``size`` at a time.

        ``lost`` is asked after the owners are read (one heard from meanwhile
        keeps its tasks). Each batch is read when the one before was taken, so
        what a caller does with a batch (a sweep ends its tasks, which drops
        their entries) is done before the next is read, and memory holds one
        batch whatever the owner held. Only when the index can be trusted
        (``indexed``, or ``index_fresh`` at start): otherwise ``unfinished``.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        owners = await self._index.owners()
        for owner, owned in owners.items():
            if not lost(owner):
                continue
            pending: builtins.list[IndexEntry] = []
            async for entries in self._index.batches(owned):
                pending.extend(entries)
                while len(pending) >= size:
                    batch, pending = pending[:size], pending[size:]
                    yield await self._owned_snapshots(batch)
            if pending:
                yield await self._owned_snapshots(pending)

    async def _owned_snapshots(self, entries: Sequence[IndexEntry]) -> builtins.list[Snapshot]:
        """The unfinished snapshots that name these owner entries as theirs.

        An entry no snapshot names, older than ``STALE_AFTER``, is deleted (its
        writer died before its snapshot named it).
        """
        gate = asyncio.Semaphore(INDEX_CONCURRENCY)

        async def read(task_id: str) -> Snapshot | None:
            async with gate:
                return await self._read(task_id)

        snaps = await asyncio.gather(*(read(e.task_id) for e in entries))
        found: builtins.list[Snapshot] = []
        stale, old = [], time.time_ns() - STALE_AFTER
        for entry, snap in zip(entries, snaps, strict=True):
            if snap is not None and snap.index is not None and snap.index.o == entry.pos:
                if snap.owner == entry.owner and not snap.final:
                    found.append(snap)
            elif entry.written_ns < old:
                stale.append(entry.pos)
        self._index.drop_later(stale)
        return found

    async def unfinished(self) -> builtins.list[Snapshot]:
        """The snapshot of every task that is not final (for the lease reaper).

        Final tasks are skipped without being decoded.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        found = []
        for value, revision, headers in await self._snapshots.scan():
            snap = Snapshot.decode(value, revision, headers)
            if not snap.final:
                found.append(snap)
        return found

    async def release(self, task_id: str, owner: str) -> Released:
        """Record a waiting task of ``owner``'s as owned by nobody (compare-and-set).

        For a task that waits for input (INPUT_REQUIRED, AUTH_REQUIRED) as its
        record says: whoever takes its next message claims it (``claim``).
        ``owner`` is this instance at shutdown, or a lost instance when a
        survivor sweeps. The snapshot is rewritten from the record, so one
        behind it (its last write failed) is brought up to date. Only once
        every live instance reads format 2 (``formats``): a version before it
        would take a task owned by nobody for its own.

        Returns:
            ``RELEASED``; ``MOVED_ON`` if it is not ``owner``'s any more (owned
            by another instance or nobody, ended, or written meanwhile twice:
            it is read again once);
            ``KEPT`` if its record does not show it waiting, or an older
            version is in the cluster.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if self._formats.writing < CURRENT_FORMAT:
            return Released.KEPT
        for _ in range(RELEASE_ATTEMPTS - 1):
            released = await self._release_once(task_id, owner)
            if released is not None:
                return released
        return await self._release_once(task_id, owner) or Released.MOVED_ON

    async def _release_once(self, task_id: str, owner: str) -> Released | None:
        """One attempt of ``release``; None if the snapshot moved under it (try again)."""
        snap = await self._read(task_id)
        if snap is None:
            return Released.KEPT
        if snap.owner != owner or snap.final:
            return Released.MOVED_ON
        recorded = await self._fold(task_id, snap)
        if taskops.is_final(recorded.task):
            return Released.MOVED_ON
        if recorded.task.status.state not in taskops.INTERRUPTED:
            return Released.KEPT
        value = encode(
            "", recorded.task, recorded.seq, recorded.version, snap.scope, self._formats.writing
        )
        try:
            await self._snapshots.put(
                recorded.task, value, snap.rev, snap.scope, "", snap.index, snap.owner, snap.shard
            )
        except VersionConflictError:
            return None  # written meanwhile (by its owner's last frames, say): read it again
        self._forget(task_id)
        return Released.RELEASED

    async def claim(self, task_id: str) -> RecordedTask | None:
        """Take over a waiting task nobody owns (compare-and-set on its snapshot).

        The claim holds the version the release recorded: a change anyone
        appends after it (a partitioned former owner's, say) makes the
        claimer's first write fail its compare-and-set, so no message runs on
        two instances.

        Returns:
            The task, now owned by this instance; None if it is not a waiting
            task owned by nobody (another instance claimed it first), or its
            record moved past the release.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        snap = await self._read(task_id)
        if snap is None or snap.owner or snap.state not in taskops.INTERRUPTED:
            return None
        last = await self._last_entry(task_id)
        if last is not None and (last.seq != snap.seq or last.pos != snap.pos):
            return None  # written after the release: not the waiting task it shows
        if await self._set_owner(snap, self._owner) is None:
            return None
        return RecordedTask(snap.task(), snap.pos, self._owner, snap.seq, snap.scope)

    async def _set_owner(self, snap: Snapshot, owner: str) -> Snapshot | None:
        task = snap.task()
        value = encode(owner, task, snap.seq, snap.pos, snap.scope, self._formats.writing)
        try:
            rev, index = await self._snapshots.put(
                task, value, snap.rev, snap.scope, owner, snap.index, snap.owner, snap.shard
            )
        except VersionConflictError:
            return None
        self._forget(task.id)  # (read again at its next change)
        return Snapshot(
            owner, snap.state, snap.seq, snap.pos, snap.scope, snap.body, rev, index, snap.shard
        )

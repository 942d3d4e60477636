"""``ListTasks`` on JetStream, and the listing index's marker.

A page is read through the listing index (``index``) once the whole cluster
keeps it; until then, and for a page token issued then, by reading every
snapshot. The marker that says the index can be trusted is kept here too
(``keep_index``, run by the lease). See ``index`` for the entries and the
marker, ``snapshots`` for the snapshots they name.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from a2a.types.a2a_pb2 import Task

from ..journal import (
    InvalidPageTokenError,
    PageTokens,
    RecordedTask,
    TaskPage,
    TaskQuery,
    VersionConflictError,
    paginate,
    status_ns,
)
from .formats import Formats
from .index import (
    CLOCK_SKEW,
    FEATURE,
    MARKER_RENEW,
    STALE_AFTER,
    IndexEntry,
    TaskIndex,
    ahead,
    digest,
    listing,
)
from .records import Snapshot
from .snapshots import SnapshotStore

logger = logging.getLogger(__name__.replace("._internal", ""))

INDEXED = "i"
"""The mark of page tokens issued through the index (``n``: by reading every snapshot)."""
INDEX_BATCH = 256
"""Entries a count by status timestamp, or a read of ``f`` entries, reads at once."""
INDEX_CONCURRENCY = 16
"""Snapshots ``index_unindexed`` writes at once."""
MARKER_FRESH = 600 * 1_000_000_000
"""Nanoseconds after its last renewal past which the marker is not trusted."""


class Coverage(Protocol):
    """Another marker the lease keeps with the index's (``DeliveryCoverage``)."""

    def due(self) -> bool:
        """Whether ``keep`` has something to do (cheap: no request)."""
        ...

    async def keep(self, live: set[str]) -> None:
        """Remove, build or renew the marker."""
        ...


class _Ahead:
    """A listing's reader of the ``f`` entries: tasks whose status is later than their write.

    Read down alongside the listing's walk, a batch at a time, never all at once.
    """

    def __init__(self, index: TaskIndex, subject: str, before: int | None, *, enabled: bool):
        self._index, self._subject, self._cursor = index, subject, before
        self._pending: builtins.list[IndexEntry] = []
        self.done = not enabled
        """Every ``f`` entry below the page token has been read from the index."""

    @property
    def exhausted(self) -> bool:
        """Every ``f`` entry below the page token has been handed out."""
        return self.done and not self._pending

    async def down_to(self, low: int, most: int) -> builtins.list[IndexEntry]:
        """The entries at ``low`` or above not handed out yet, newest first.

        With ``low`` 0 (the walk has ended), at most ``most`` of the rest.
        """
        taken: builtins.list[IndexEntry] = []
        while not (self.done and not self._pending):
            while self._pending and self._pending[0].pos >= low and (low or len(taken) < most):
                taken.append(self._pending.pop(0))
            if self._pending or (not low and len(taken) >= most):
                break
            entries, more = await self._index.below(self._subject, self._cursor, INDEX_BATCH)
            self._pending.extend(entries)
            self._cursor = entries[-1].pos if entries else self._cursor
            self.done = not more or not entries
        return taken


class Listing:
    """``ListTasks`` pages, and the index's marker, for one journal.

    Args:
        snapshots: The snapshots (read, scanned, rewritten with their entries).
        index: The listing index.
        tokens: Seals page tokens.
        formats: What the cluster's instances read and keep.
        owner: This instance's id (the marker names who renewed it).
        read: Reads a task's snapshot (the journal's: it remembers where records are).
        fold: A snapshot's task brought up to its last change.
    """

    def __init__(
        self,
        snapshots: SnapshotStore,
        index: TaskIndex,
        tokens: PageTokens,
        formats: Formats,
        owner: str,
        read: Callable[[str], Awaitable[Snapshot | None]],
        fold: Callable[[str, Snapshot], Awaitable[RecordedTask]],
    ) -> None:
        self._snapshots = snapshots
        self._index = index
        self._tokens = tokens
        self._formats = formats
        self._owner = owner
        self._read = read
        self._fold = fold
        self.coverage: Coverage | None = None
        """Another marker kept with the index's (the push configs' deliverers)."""
        self._built = False
        """Whether this instance has seen the index's marker (see ``keep_index``)."""
        self._unmarked = False
        """Whether this instance removed the marker since it heard one that does not keep it."""
        self._renew_at = 0.0
        """When (monotonic) ``keep_index`` next renews the marker, or notes it was renewed."""

    async def list(self, query: TaskQuery) -> TaskPage:
        """Return one page, most recently updated first.

        Through the listing index once the whole cluster keeps it (see
        ``index``): a page reads its entries and its tasks' snapshots. Until
        then by reading every snapshot (O(tasks)). A page token says which way
        issued it, and the next page is read the same way.

        Raises:
            InvalidPageTokenError: The token is malformed.
            StoreUnavailableError: NATS did not answer.
        """
        if query.page_token:
            try:
                before = self._tokens.decode(query.page_token, INDEXED, query.scope)
            except InvalidPageTokenError:
                return await self._list_scanning(query)
            return await self._list_indexed(query, before)
        if not self._formats.everyone(FEATURE):
            self._built = False  # (read the marker again once everyone is heard keeping it)
        if self._built:
            return await self._list_indexed(query, None)
        return await self._list_scanning(query)

    @property
    def index(self) -> TaskIndex:
        """The listing index (shared with the push configs' delivery entries)."""
        return self._index

    @property
    def indexed(self) -> bool:
        """Whether a first page is read through the listing index now."""
        return self._built and self._formats.everyone(FEATURE)

    async def _list_indexed(self, query: TaskQuery, before: int | None) -> TaskPage:
        subject, which = listing(query.scope, query.context_id, query.state)
        want = query.page_size + 1
        after = query.status_after_ns
        ahead_of = _Ahead(self._index, ahead(query.scope), before, enabled=bool(after))
        found: dict[str, tuple[IndexEntry, Snapshot]] = {}
        stale: builtins.list[int] = []
        cursor = before
        walked = False
        while True:
            entries, more = (
                ([], False) if walked else await self._index.below(subject, cursor, want)
            )
            if after:
                recent = [e for e in entries if e.written_ns >= after - 3 * CLOCK_SKEW]
                more = more and len(recent) == len(entries)
                entries = recent
            # Down to the lowest entry walked; once the walk ends, below it too.
            low = entries[-1].pos if entries and more else 0
            candidates = [(e, which) for e in entries]
            candidates += [(e, "f") for e in await ahead_of.down_to(low, want)]
            await self._validate(candidates, query, before, found, stale)
            cursor = entries[-1].pos if entries else cursor
            walked = not more  # (the rest comes from the f entries, if any)
            enough = sum(e.pos >= low for e, _ in found.values()) >= want
            if enough or (not more and ahead_of.exhausted):
                break
        if stale:
            await self._index.drop(stale)
        ranked = sorted(found.values(), key=lambda item: item[0].pos, reverse=True)
        page_items = ranked[: query.page_size]
        scope = query.scope
        page = TaskPage(
            tasks=[snap.task() for _, snap in page_items],
            next_page_token=self._tokens.encode(page_items[-1][0].pos, INDEXED, scope)
            if len(ranked) > query.page_size
            else "",
            after=[self._tokens.encode(entry.pos, INDEXED, scope) for entry, _ in page_items],
        )
        page.total_size, _ = await asyncio.gather(
            self._indexed_total(query, subject),
            self._fold_page(page, [snap for _, snap in page_items]),
        )
        return page

    async def _validate(
        self,
        entries: builtins.list[tuple[IndexEntry, str]],
        query: TaskQuery,
        before: int | None,
        found: dict[str, tuple[IndexEntry, Snapshot]],
        stale: builtins.list[int],
    ) -> None:
        """Add to ``found`` the tasks of the entries their snapshots name, that match ``query``.

        An entry its snapshot no longer names, because the snapshot names a newer one
        of the same kind, stands for that one when it lies in the range listed (below
        the page token): written while this listing ran, the newer entry may have
        been passed over before its snapshot was written. A task met through two
        entries (its ``s`` or ``c`` one and its ``f`` one) is kept at the lower
        position (a page token after it passes both).
        """
        gate = asyncio.Semaphore(INDEX_CONCURRENCY)

        async def read(task_id: str) -> Snapshot | None:
            async with gate:
                return await self._read(task_id)

        snaps = await asyncio.gather(*(read(e.task_id) for e, _ in entries))
        old = time.time_ns() - STALE_AFTER
        for (entry, which), snap in zip(entries, snaps, strict=True):
            named = snap.index.of(which) if snap is not None and snap.index is not None else 0
            if snap is None or named != entry.pos:
                if which != "f" and named > entry.pos and (before is None or named < before):
                    entry = dataclasses.replace(entry, pos=named)  # (its stand-in)
                else:
                    if entry.written_ns < old:
                        stale.append(entry.pos)
                    continue  # its task was written again since, or the write failed
            assert snap is not None
            task = snap.task()
            if not query.matches(task.context_id, task.status.state, status_ns(task), snap.scope):
                continue
            known = found.get(entry.task_id)
            if known is None or entry.pos < known[0].pos:
                found[entry.task_id] = (entry, snap)

    async def _ahead(self, query: TaskQuery, before: int | None) -> builtins.list[IndexEntry]:
        """The scope's entries of tasks whose status is later than their write (for a count)."""
        found: builtins.list[IndexEntry] = []
        cursor = before
        while True:
            entries, more = await self._index.below(ahead(query.scope), cursor, INDEX_BATCH)
            found.extend(entries)
            if not more or not entries:
                return found
            cursor = entries[-1].pos

    async def _indexed_total(self, query: TaskQuery, subject: str) -> int:
        """How many entries match (by status timestamp: those written since, read back)."""
        after = query.status_after_ns
        if not after:
            return await self._index.count_from(subject, 1)
        matching: set[str] = set()
        cursor = None
        while True:
            entries, more = await self._index.below(subject, cursor, INDEX_BATCH)
            recent = [e for e in entries if e.written_ns >= after - 3 * CLOCK_SKEW]
            matching.update(e.task_id for e in recent if e.status_ns >= after)
            if len(recent) < len(entries) or not more or not entries:
                break
            cursor = entries[-1].pos
        context = digest(query.context_id) if query.context_id else ""
        for entry in await self._ahead(query, None):
            if (
                entry.status_ns >= after
                and (not context or entry.context == context)
                and query.state in (0, entry.state)
            ):
                matching.add(entry.task_id)
        return len(matching)

    async def _fold_page(self, page: TaskPage, snaps: builtins.list[Snapshot]) -> None:
        """Bring the page's live tasks up to their last change (their snapshots may lag)."""
        live = [i for i, snap in enumerate(snaps) if not snap.final]
        folded = await asyncio.gather(*(self._fold(page.tasks[i].id, snaps[i]) for i in live))
        for i, recorded in zip(live, folded, strict=True):
            page.tasks[i] = recorded.task

    async def _list_scanning(self, query: TaskQuery) -> TaskPage:
        """One page from every snapshot (before the index, or a page token from then)."""
        if query.page_token:  # (refused before anything is read)
            self._tokens.decode(query.page_token, "n", query.scope)
        found: builtins.list[tuple[int, Snapshot]] = []
        for value, revision, headers in await self._snapshots.scan():
            snap = Snapshot.decode(value, revision, headers)
            if snap.scope != query.scope:
                continue  # another caller's task: not even decoded
            task = snap.task()
            if query.matches(task.context_id, task.status.state, status_ns(task), snap.scope):
                found.append((revision, snap))
        snaps: dict[str, Snapshot] = {}

        def remember(snap: Snapshot) -> Task:
            task = snap.task()
            snaps[task.id] = snap
            return task

        page = paginate(found, query, "n", remember, self._tokens)
        await self._fold_page(page, [snaps[task.id] for task in page.tasks])
        return page

    def index_due(self) -> bool:
        """Whether ``keep_index`` has something to do (cheap: no request)."""
        if self.coverage is not None and self.coverage.due():
            return True
        if self._formats.lacking(FEATURE):
            return not self._unmarked
        return not self._built or time.monotonic() >= self._renew_at

    async def keep_index(self, live: set[str]) -> None:
        """Keep the index's marker true, then ``coverage``'s; run by the lease, once settled.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        await self._keep_listing(live)
        if self.coverage is not None:
            await self.coverage.keep(live)

    async def _keep_listing(self, live: set[str]) -> None:
        """Keep the index's marker true (see ``index``).

        An instance that does not keep the index is live: remove the marker.
        Everyone keeps it and the marker is missing (or was not renewed for
        ``MARKER_FRESH``: the cluster was down, or an older version ran alone):
        the smallest live instance indexes the snapshots written without
        entries, then writes it, and renews it every ``MARKER_RENEW``.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if self._formats.lacking(FEATURE):
            self._built = False
            if not self._unmarked:  # (once while such an instance is heard)
                await self._index.unmark()
                self._unmarked = True
            return
        self._unmarked = False
        if not self._formats.everyone(FEATURE):
            self._built = False
            return
        smallest = self._owner == min(live | {self._owner})
        if self._built:
            self._renew_at = time.monotonic() + MARKER_RENEW
            if smallest:
                await self._index.mark_built(self._owner, await self._snapshots.bucket_seq())
            return
        if await self.index_fresh():
            self._built = True
            self._renew_at = time.monotonic() + MARKER_RENEW
            logger.info("ListTasks and sweeps read the listing index")
            return
        if not smallest:
            return
        seq = await self._snapshots.bucket_seq()  # (what is written from now on is indexed)
        done = await self.index_unindexed()
        if self._formats.everyone(FEATURE):
            await self._index.mark_built(self._owner, seq)
            self._built = True
            self._renew_at = time.monotonic() + MARKER_RENEW
            logger.info("listing index built (%d snapshots indexed); ListTasks reads it", done)

    async def index_fresh(self) -> bool:
        """Whether the marker stands and was renewed within ``MARKER_FRESH``.

        Before this instance has heard the others (at start), it is what says the
        index can be trusted: an older version heard removes the marker.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if self._formats.lacking(FEATURE):
            return False
        marker = await self._index.built()
        if marker is None or time.time_ns() - marker.at >= MARKER_FRESH:
            return False
        return not await self._snapshots.unindexed_since(marker.kv_seq)

    async def index_unindexed(self) -> int:
        """Index every snapshot written without entries (by a version before the index).

        Each is written again unchanged, with its entries, by compare-and-set;
        one written meanwhile by its task's writer already has them.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        gate = asyncio.Semaphore(INDEX_CONCURRENCY)

        async def index(snap: Snapshot, value: bytes) -> int:
            async with gate:
                try:
                    await self._snapshots.put(
                        snap.task(), value, snap.rev, snap.scope, snap.owner, None, "", snap.shard
                    )
                except VersionConflictError:
                    return 0
                return 1

        todo = []
        for value, revision, headers in await self._snapshots.scan():
            snap = Snapshot.decode(value, revision, headers)
            if snap.index is None:
                todo.append(index(snap, value))
        return sum(await asyncio.gather(*todo))

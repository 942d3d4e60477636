"""The task journal on JetStream: the event stream is the record, a KV bucket holds snapshots.

The record is stream ``A2A_EVENTS``, one message per write of a task, each
naming the number of its first change (``records`` has the format).

A task's version is the stream sequence of its last message. Every message
carries ``Nats-Expected-Last-Subject-Sequence`` set to the version the writer
holds: JetStream refuses it if anyone wrote the task meanwhile, so two
instances can never both extend the same version (an owner and a survivor
that took it for lost, say). A write that takes several messages and fails
after the first leaves the ones before standing (``PartialWriteError`` says
how many changes). A final change is never followed by another: a writer can
only hold a final task's version by having written or read it through a
journal, and every journal remembers the final versions it has seen
(bounded) and refuses to extend them with ``FinalTaskError``; a writer whose
compare-and-set fails on a final change gets the same.

Snapshots are in the KV bucket ``A2A_TASKS``, one key per task (``records``): written
right after the task's first changes are in the stream, when its state
changes, every ``snapshot_every`` changes, and when it ends (each a
compare-and-set on the key's revision). Reading a task is its
snapshot plus the changes after it (at most ``snapshot_every``, one batched
direct get); ``ListTasks`` filters on snapshots, which carry the current
state, and folds the changes of the live tasks on the page. A snapshot write
that fails is retried at the task's next change; the change itself, already
in the stream, stands. A task that ends in the write that creates it, with
no client able to ask for its frames (see ``create``), is recorded as its
final snapshot alone, as the in-memory journal keeps no frames of it either.

Writes survive a NATS node failover: an attempt that timed out is retried;
if the retry finds its own change already stored (same ``Nats-Msg-Id``, or the
same snapshot bytes), the first attempt landed and counts.

Who runs what: the owner writes a task under the task's lock (``LiveTask``),
so its writes are in order; a survivor writes a lost owner's task only
through the same compare-and-set. An owner that dies between a new task's
first publish and its snapshot leaves a record no snapshot points to: no
instance lists or serves it, and nobody can have subscribed to it.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import nats.js.errors
from a2a.types.a2a_pb2 import StreamResponse, Task
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from ..journal import (
    Change,
    FinalTaskError,
    InvalidPageTokenError,
    PageTokens,
    PartialWriteError,
    RecordedTask,
    Released,
    StoreError,
    TaskExistsError,
    TaskPage,
    TaskQuery,
    UnknownTaskError,
    VersionConflictError,
    paginate,
    status_ns,
)
from ..model import taskops
from .conn import events_stream
from .formats import CURRENT as CURRENT_FORMAT
from .formats import Formats
from .index import (
    CLOCK_SKEW,
    FEATURE,
    MARKER_RENEW,
    STALE_AFTER,
    IndexEntry,
    Positions,
    TaskIndex,
    ahead,
    digest,
    listing,
)
from .index import HEADER as INDEX_HEADER
from .pullread import PullRead, after, last_per_subject
from .records import (
    MSG_ID,
    PAYLOAD_SLACK,
    PENDING,
    SHARDS,
    STATE,
    STREAM_SEQ,
    TASKS_ALL,
    TASKS_STREAM,
    messages,
    snapshot_subject,
)
from .records import SHARD as SHARD
from .records import Entry as Entry
from .records import Snapshot as Snapshot
from .records import encode as encode
from .records import shard_for as shard_for
from .records import subject as subject
from .requests import EXPECT, JetStreamRequests, WrongLastSequenceError
from .retry import Retry

logger = logging.getLogger(__name__)

FOLD_BATCH = 256
"""Messages one direct get returns at most."""
IDLE_HEARTBEAT = 1.0
"""Seconds between JetStream heartbeats of a follower's consumer (how soon a lost one
is noticed)."""
_KEY = re.compile(r"^[A-Za-z0-9_=-]+$")
_KNOWN_FINAL = 4096


_KNOWN_SHARDS = 65_536


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


def _new(positions: Positions, kept: Positions | None) -> tuple[int, ...]:
    """The positions of ``positions`` that ``kept`` does not name too."""
    keep = set(kept.all()) if kept is not None else set()
    return tuple(p for p in positions.all() if p not in keep)


@dataclass(slots=True)
class _Snapshotted:
    """What this instance knows of the snapshot of a task it writes."""

    rev: int
    seq: int
    state: int
    scope: str
    index: Positions | None = None
    owner: str = ""
    shard: int = 0


INDEXED = "i"
"""The mark of page tokens issued through the index (``n``: by reading every snapshot)."""
INDEX_BATCH = 256
"""Entries a count by status timestamp, or a read of ``f`` entries, reads at once."""
INDEX_CONCURRENCY = 16
"""Snapshots ``index_unindexed`` writes at once."""
MARKER_FRESH = 600 * 1_000_000_000
"""Nanoseconds after its last renewal past which the marker is not trusted."""
UNINDEXED_CHECK = 100_000
"""Most snapshot writes since the marker's last renewal an instance that starts checks."""

SWEEP_BATCH = 500
"""Snapshots a sweep reads at a time through the index (it ends them before reading more)."""
RELEASE_ATTEMPTS = 2
"""Reads of a task ``release`` makes when its snapshot moves under it."""


class Coverage(Protocol):
    """Another marker the lease keeps with the index's (``DeliveryCoverage``)."""

    def due(self) -> bool:
        """Whether ``keep`` has something to do (cheap: no request)."""
        ...

    async def keep(self, live: set[str]) -> None:
        """Remove, build or renew the marker."""
        ...


class JetStreamJournal:
    """``TaskJournal`` on the ``A2A_EVENTS`` stream and the ``A2A_TASKS`` bucket.

    Args:
        requests: Lean requests on the connection (publish, direct get).
        js: The JetStream context (consumers, KV reads).
        kv: The snapshot bucket.
        owner: This instance's id, recorded with every task it creates.
        snapshot_every: Changes between two snapshots of a running task.
        retry: How long an operation retries through a NATS outage.
        formats: Which format to write (see ``formats``; None: format 1 only).
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        js: JetStreamContext,
        kv: KeyValue,
        owner: str,
        snapshot_every: int = 32,
        retry: Retry | None = None,
        formats: Formats | None = None,
        page_tokens: PageTokens | None = None,
        event_streams: int = 1,
        task_ttl: float = 86_400.0,
    ) -> None:
        self._requests = requests
        self._tokens = page_tokens or PageTokens()
        self._formats = formats or Formats()
        self._retry = retry or Retry()
        self._js = js
        self._kv = kv
        self._owner = owner
        self._every = snapshot_every
        self._streams = event_streams
        self._entry_ttl = task_ttl
        """How long the index keeps an entry (its stream's max age)."""
        self._shards: OrderedDict[str, int] = OrderedDict()
        """The event stream of tasks this instance wrote or read lately (their snapshots say)."""
        self._snapshotted: dict[str, _Snapshotted] = {}
        self._final: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._index = TaskIndex(requests, self._retry)
        self.coverage: Coverage | None = None
        """Another marker kept with the index's (the push configs' deliverers)."""
        self._built = False
        """Whether this instance has seen the index's marker (see ``keep_index``)."""
        self._unmarked = False
        """Whether this instance removed the marker since it heard one that does not keep it."""
        self._renew_at = 0.0
        """When (monotonic) ``keep_index`` next renews the marker, or notes it was renewed."""

    @property
    def owner(self) -> str:
        """The instance id this journal records as owner."""
        return self._owner

    def scope_of(self, task_id: str) -> str | None:
        """None: a task's scope is in its snapshot, read over the network like its body."""
        return None

    async def get(self, task_id: str) -> RecordedTask | None:
        """Return the task (its snapshot and the changes after it), or None.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        snap = await self.snapshot(task_id)
        if snap is None:
            return None
        return await self._fold(task_id, snap)

    async def snapshot(self, task_id: str) -> Snapshot | None:
        """The task's snapshot, or None.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if not _KEY.match(task_id):
            return None  # such an id was never created here
        entry = await self._kv_entry(task_id)
        if entry is None:
            return None
        snap = Snapshot.decode(*entry)
        self._remember_shard(task_id, snap.shard)
        return snap

    def _remember_shard(self, task_id: str, shard: int) -> None:
        self._shards[task_id] = shard
        self._shards.move_to_end(task_id)
        while len(self._shards) > _KNOWN_SHARDS:
            self._shards.popitem(last=False)

    async def _shard(self, task_id: str) -> int:
        """The event stream of the task's record: as last seen, else as its snapshot says."""
        known = self._shards.get(task_id)
        if known is None:
            snap = await self.snapshot(task_id)
            known = snap.shard if snap is not None else 0
        return known

    def _new_shard(self, task_id: str) -> int:
        """The event stream of a new task (and remembered as its own).

        Spread over ``event_streams`` once every live instance reads a record
        where its snapshot says; else the first, as before.
        """
        shard = shard_for(task_id, self._streams) if self._formats.everyone(SHARDS) else 0
        self._remember_shard(task_id, shard)
        return shard

    async def create(
        self, task: Task, changes: Sequence[Change], *, keep_frames: bool = True, scope: str = ""
    ) -> int:
        """Record the new task's first changes, then snapshot it.

        A task that ended in this write and whose frames nobody can ask for
        (``keep_frames`` False) is recorded as its final snapshot alone: one
        write instead of two.

        Raises:
            TaskExistsError: The id is taken.
            PartialWriteError: The task and some changes were recorded, then one failed.
            StoreUnavailableError: NATS did not answer.
        """
        shard = self._new_shard(task.id)
        if not keep_frames and taskops.is_final(task):
            value = encode(self._owner, task, changes[-1].seq, 0, scope, self._formats.writing)
            try:
                await self._put_snapshot(task, value, 0, scope, self._owner, None, "", shard)
            except VersionConflictError:
                self._shards.pop(task.id, None)  # (someone else's, wherever its snapshot says)
                raise TaskExistsError(task.id) from None
            self._remember_final(task.id, 0)
            return 0
        try:
            version, positions = await self._append_indexed(task, changes, 0, scope, None, "")
        except (VersionConflictError, FinalTaskError, UnknownTaskError):
            self._shards.pop(task.id, None)  # (someone else's, wherever its snapshot says)
            raise TaskExistsError(task.id) from None
        except PartialWriteError as exc:
            # Snapshot what stands from the task as it was created (its first frame).
            initial = StreamResponse.FromString(changes[0].frame).task
            await self._snapshot_new(initial, 1, 0, scope, shard)
            raise exc from exc.__cause__
        if taskops.is_final(task):
            self._remember_final(task.id, version)
        await self._snapshot_new(task, changes[-1].seq, version, scope, shard, positions)
        return version

    async def _append_indexed(
        self,
        task: Task,
        changes: Sequence[Change],
        expected: int,
        scope: str,
        replaced: Positions | None,
        replaced_owner: str,
    ) -> tuple[int, Positions | None]:
        """``_append``, and the entries of the snapshot that follows it, published meanwhile.

        Returns:
            The version, and the entries' positions (None if they could not be
            published: the snapshot's write publishes them).

        Raises:
            As ``_append`` (the entries, published for nothing, are dropped).
        """
        appended, indexed = await asyncio.gather(
            self._append(task.id, changes, expected),
            self._add(task, scope, self._owner, replaced, replaced_owner),
            return_exceptions=True,
        )
        if isinstance(appended, BaseException):
            if not isinstance(indexed, BaseException):
                self._index.drop_later(_new(indexed, replaced))
            raise appended
        return appended, None if isinstance(indexed, BaseException) else indexed

    async def _snapshot_new(
        self,
        task: Task,
        seq: int,
        pos: int,
        scope: str,
        shard: int,
        positions: Positions | None = None,
    ) -> None:
        """Write a new task's first snapshot (best effort: the record stands without it)."""
        try:
            value = encode(self._owner, task, seq, pos, scope, self._formats.writing)
            rev, index = await self._put_snapshot(
                task, value, 0, scope, self._owner, None, "", shard, positions
            )
        except VersionConflictError:
            # Its id has a snapshot already: another task's, recorded in another event
            # stream (only two instances spreading over different numbers of streams
            # could pick the same id in two): this record is nobody's.
            self._shards.pop(task.id, None)
            raise TaskExistsError(task.id) from None
        except StoreError as exc:
            # Written at the task's next change (revision 0: the key is still new).
            logger.warning("could not snapshot new task %s: %s", task.id, exc)
            if not taskops.is_final(task):
                self._snapshotted[task.id] = _Snapshotted(0, 0, -1, scope, shard=shard)
            return
        if not taskops.is_final(task):
            self._snapshotted[task.id] = _Snapshotted(
                rev, seq, task.status.state, scope, index, self._owner, shard
            )

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        """Record ``changes`` if nobody wrote the task since ``expected_version``.

        Raises:
            UnknownTaskError: The task's record is gone.
            FinalTaskError: The task ended.
            VersionConflictError: Someone else wrote it.
            StoreUnavailableError: NATS did not answer.
        """
        if (task.id, expected_version) in self._final:
            raise FinalTaskError(task.id)
        known, seq = self._snapshotted.get(task.id), changes[-1].seq
        positions = None
        if known is not None and self._due(known, task, seq):
            # (its entries published beside the change: the snapshot costs one round trip)
            version, positions = await self._append_indexed(
                task, changes, expected_version, known.scope, known.index, known.owner
            )
        else:
            version = await self._append(task.id, changes, expected_version)
        if taskops.is_final(task):
            self._remember_final(task.id, version)
        await self._maybe_snapshot(task, seq, version, positions=positions)
        return version

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
                return await self.snapshot(task_id)

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
        for value, revision, headers in await self._scan():
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
                await self._index.mark_built(self._owner, await self._bucket_seq())
            return
        if await self.index_fresh():
            self._built = True
            self._renew_at = time.monotonic() + MARKER_RENEW
            logger.info("ListTasks and sweeps read the listing index")
            return
        if not smallest:
            return
        seq = await self._bucket_seq()  # (what is written from now on is indexed)
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
        return not await self._unindexed_since(marker.kv_seq)

    async def _bucket_seq(self) -> int:
        """The snapshot bucket's last sequence."""

        async def attempt() -> int:
            info = await self._js.stream_info(TASKS_STREAM)
            return int(info.state.last_seq)

        return await self._retry(attempt, "read the task bucket's state")

    async def _unindexed_since(self, seq: int) -> bool:
        """Whether a snapshot written after bucket sequence ``seq`` has no index entries.

        Reads the headers of what was written since (the marker's last renewal,
        a minute ago while the cluster ran): a version before the index that ran
        alone since (a rollback of every instance, and back) wrote without them.
        More than ``UNINDEXED_CHECK`` writes since: taken as yes (rebuilt).
        """
        return await self._retry(lambda: self._unindexed_once(seq), "check the task bucket")

    async def _unindexed_once(self, seq: int) -> bool:
        async with PullRead(self._js, TASKS_STREAM, TASKS_ALL, after(seq), timeout=5.0) as read:
            if read.pending > UNINDEXED_CHECK:
                return True
            async for msg in read:
                headers = msg.headers or {}
                if "KV-Operation" not in headers and INDEX_HEADER not in headers:
                    return True
        return False

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
                return await self.snapshot(task_id)

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
                    await self._put_snapshot(
                        snap.task(), value, snap.rev, snap.scope, snap.owner, None, "", snap.shard
                    )
                except VersionConflictError:
                    return 0
                return 1

        todo = []
        for value, revision, headers in await self._scan():
            snap = Snapshot.decode(value, revision, headers)
            if snap.index is None:
                todo.append(index(snap, value))
        return sum(await asyncio.gather(*todo))

    async def unfinished(self) -> builtins.list[Snapshot]:
        """The snapshot of every task that is not final (for the lease reaper).

        Final tasks are skipped without being decoded.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        found = []
        for value, revision, headers in await self._scan():
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
        snap = await self.snapshot(task_id)
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
            await self._put_snapshot(
                recorded.task, value, snap.rev, snap.scope, "", snap.index, snap.owner, snap.shard
            )
        except VersionConflictError:
            return None  # written meanwhile (by its owner's last frames, say): read it again
        self._snapshotted.pop(task_id, None)
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
        snap = await self.snapshot(task_id)
        if snap is None or snap.owner or snap.state not in taskops.INTERRUPTED:
            return None
        last = await self.last_entry(task_id)
        if last is not None and (last.seq != snap.seq or last.pos != snap.pos):
            return None  # written after the release: not the waiting task it shows
        if await self._set_owner(snap, self._owner) is None:
            return None
        return RecordedTask(snap.task(), snap.pos, self._owner, snap.seq, snap.scope)

    async def _set_owner(self, snap: Snapshot, owner: str) -> Snapshot | None:
        task = snap.task()
        value = encode(owner, task, snap.seq, snap.pos, snap.scope, self._formats.writing)
        try:
            rev, index = await self._put_snapshot(
                task, value, snap.rev, snap.scope, owner, snap.index, snap.owner, snap.shard
            )
        except VersionConflictError:
            return None
        self._snapshotted.pop(task.id, None)  # (read again at its next change)
        return Snapshot(
            owner, snap.state, snap.seq, snap.pos, snap.scope, snap.body, rev, index, snap.shard
        )

    async def repair(self, recorded: RecordedTask) -> None:
        """Write the snapshot of a task whose record ended but whose snapshot says it runs.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        await self._maybe_snapshot(recorded.task, recorded.seq, recorded.version, force=True)

    async def entries(
        self, task_id: str, after_pos: int, messages: int | None = None
    ) -> builtins.list[Entry]:
        """The task's changes in the messages stored after stream sequence ``after_pos``.

        Args:
            task_id: The task.
            after_pos: Read the messages after this stream sequence.
            messages: Read at most this many messages (None: all of them).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        found: builtins.list[Entry] = []
        read = 0
        shard = await self._shard(task_id)
        while messages is None or read < messages:
            most = FOLD_BATCH if messages is None else min(FOLD_BATCH, messages - read)
            request: dict[str, object] = {
                "seq": after_pos + 1,
                "next_by_subj": subject(task_id, shard),
                "batch": most,
            }
            msgs = await self._retry(
                lambda r=request, t=self._retry.timeout: self._requests.direct_get(  # type: ignore[misc]
                    events_stream(shard), r, t
                ),
                f"read the changes of task {task_id}",
            )
            for msg in msgs:
                after_pos = int((msg.headers or {})[STREAM_SEQ])
                found.extend(Entry.unpack(msg, after_pos))
            read += len(msgs)
            if not msgs or (msgs[-1].headers or {}).get(PENDING, "0") == "0":
                break
        return found

    async def last_entry(self, task_id: str) -> Entry | None:
        """The task's last change in the stream (of its last message), or None.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        msg = await self._last_message(task_id)
        if msg is None:
            return None
        return Entry.unpack(msg, int((msg.headers or {})[STREAM_SEQ]))[-1]

    async def _last_message(self, task_id: str) -> Msg | None:
        """The task's last message in the stream, or None."""
        shard = await self._shard(task_id)
        request: dict[str, object] = {"last_by_subj": subject(task_id, shard)}
        msgs = await self._retry(
            lambda: self._requests.direct_get(events_stream(shard), request, self._retry.timeout),
            f"read the last change of task {task_id}",
        )
        return msgs[0] if msgs else None

    async def follow(
        self, task_id: str, after_pos: int, handle: Callable[[Msg], Awaitable[None]]
    ) -> JetStreamContext.PushSubscription:
        """Deliver every change of the task after stream sequence ``after_pos`` to ``handle``.

        An ordered consumer: in order, and recreated from the last delivered
        sequence if the server serving it is lost.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE
            if after_pos
            else api.DeliverPolicy.ALL,
            opt_start_seq=after_pos + 1 if after_pos else None,
        )
        shard = await self._shard(task_id)
        return await self._retry(
            lambda: self._js.subscribe(
                subject(task_id, shard),
                stream=events_stream(shard),
                cb=handle,
                ordered_consumer=True,
                idle_heartbeat=IDLE_HEARTBEAT,
                config=config,
            ),
            f"follow task {task_id}",
        )

    async def _fold(self, task_id: str, snap: Snapshot) -> RecordedTask:
        """The task of ``snap`` with every change recorded after it applied."""
        task, seq, pos = snap.task(), snap.seq, snap.pos
        if snap.final:
            self._remember_final(task_id, pos)
            return RecordedTask(task, pos, snap.owner, seq, snap.scope)
        index = taskops.index_artifacts(task)
        for entry in await self.entries(task_id, pos):
            if entry.seq <= seq:
                pos = entry.pos
                continue  # already in the snapshot (written before its pos was known)
            if entry.seq != seq + 1:
                # Changes after the snapshot left the stream (its limits): the task
                # as of the last change still there is what can be told.
                logger.warning("task %s: changes %d to %d are gone", task_id, seq + 1, entry.seq)
                break
            pos, seq = entry.pos, entry.seq
            applied = entry.apply(task, index)
            if applied is not task:
                task, index = applied, taskops.index_artifacts(applied)
        if taskops.is_final(task):
            self._remember_final(task_id, pos)
        return RecordedTask(task, pos, snap.owner, seq, snap.scope)

    def _remember_final(self, task_id: str, pos: int) -> None:
        self._final[(task_id, pos)] = None
        while len(self._final) > _KNOWN_FINAL:
            self._final.popitem(last=False)

    async def _append(self, task_id: str, changes: Sequence[Change], expected: int) -> int:
        """Publish the changes, each message a compare-and-set; return the last one's position.

        Raises:
            PartialWriteError: The first messages were recorded, then one failed.
            As ``update``, if the first one failed.
        """
        most = max(self._requests.max_payload - PAYLOAD_SLACK, 1)
        version, done = expected, 0
        for count, payload, headers in messages(
            task_id, changes, most, self._owner, self._formats.writing
        ):
            try:
                version = await self._publish(task_id, payload, headers, version)
            except StoreError as exc:
                if not done:
                    raise
                raise PartialWriteError(done, version) from exc
            done += count
        return version

    async def _publish(
        self, task_id: str, payload: bytes, headers: dict[str, str], expected: int
    ) -> int:
        """Publish one message with a compare-and-set on the subject's last sequence."""
        headers[EXPECT] = str(expected)
        attempts = 0
        where = subject(task_id, await self._shard(task_id))

        async def attempt() -> int:
            nonlocal attempts
            attempts += 1
            return await self._requests.publish(where, payload, headers, self._retry.timeout)

        try:
            return await self._retry(attempt, f"record a change of task {task_id}")
        except WrongLastSequenceError:
            if attempts > 1 and (landed := await self._landed(task_id, expected, headers)):
                return landed  # the attempt that timed out had landed (others wrote after it)
            last = await self._last_message(task_id)
            found = (last.headers or {}) if last is not None else {}
            if last is None and expected and await self.snapshot(task_id) is not None:
                # The task's messages left the stream (a task parked past
                # events_ttl); its snapshot holds it. Extending an empty subject
                # is still a compare-and-set: of two writers, one wins.
                return await self._publish(task_id, payload, headers, 0)
            if last is None:
                raise UnknownTaskError(task_id) from None
            if taskops.is_final_state(int(found.get(STATE, "0"))):  # type: ignore[arg-type]
                raise FinalTaskError(task_id) from None
            raise VersionConflictError(f"{task_id}: not at version {expected}") from None

    async def _landed(self, task_id: str, expected: int, headers: dict[str, str]) -> int:
        """The position of the message with ``headers``' id if it is the one after ``expected``.

        A retried publish whose first attempt was stored meets its own message
        there, whatever was written after it (a survivor may have ended the task
        on top of it while this instance was paused); 0 if another message is.
        """
        shard = await self._shard(task_id)
        request: dict[str, object] = {
            "seq": expected + 1,
            "next_by_subj": subject(task_id, shard),
        }
        msgs = await self._retry(
            lambda: self._requests.direct_get(events_stream(shard), request, self._retry.timeout),
            f"read the change after {expected} of task {task_id}",
        )
        found = (msgs[0].headers or {}) if msgs else {}
        return int(found[STREAM_SEQ]) if found.get(MSG_ID) == headers[MSG_ID] else 0

    def _due(self, known: _Snapshotted, task: Task, seq: int) -> bool:
        """Whether a write of ``task`` up to change ``seq`` is snapshotted (module docstring)."""
        state = task.status.state
        return (
            taskops.is_final_state(state)
            or state in taskops.INTERRUPTED
            or state != known.state
            or seq - known.seq >= self._every
        )

    async def _maybe_snapshot(
        self,
        task: Task,
        seq: int,
        pos: int,
        *,
        force: bool = False,
        positions: Positions | None = None,
    ) -> None:
        """Write the task's snapshot if one is due (see the module docstring).

        ``positions``: its entries in the index, if already published.
        """
        known = self._snapshotted.get(task.id)
        state = task.status.state
        final = taskops.is_final_state(state)
        if known is None:
            stored = await self.snapshot(task.id)
            if stored is None:
                if positions is not None:
                    self._index.drop_later(positions.all())
                return  # its record is gone (retention)
            known = _Snapshotted(
                stored.rev,
                stored.seq,
                stored.state,
                stored.scope,
                stored.index,
                stored.owner,
                stored.shard,
            )
        if force or self._due(known, task, seq):
            # A survivor ending a lost owner's task records itself as its owner.
            value = encode(self._owner, task, seq, pos, known.scope, self._formats.writing)
            try:
                known.rev, known.index = await self._put_snapshot_of_own(
                    task, value, seq, known, positions
                )
                known.owner = self._owner
                known.seq, known.state = seq, state
            except VersionConflictError:
                logger.warning("snapshot of task %s was written by another instance", task.id)
                self._snapshotted.pop(task.id, None)  # read again at the next change
                return
            except StoreError as exc:
                # The change is in the stream; the snapshot is retried at the next one.
                logger.warning("could not snapshot task %s: %s", task.id, exc)
        elif positions is not None:  # (published for a snapshot not due after all)
            self._index.drop_later(_new(positions, known.index))
        if final:
            self._snapshotted.pop(task.id, None)
        else:
            self._snapshotted[task.id] = known

    async def _put_snapshot_of_own(
        self,
        task: Task,
        value: bytes,
        seq: int,
        known: _Snapshotted,
        positions: Positions | None = None,
    ) -> tuple[int, Positions]:
        """``_put_snapshot`` by the task's writer; once more if only its snapshot was rewritten.

        The snapshot may have been rewritten unchanged meanwhile, still this
        instance's and no further in the record (the index's catch-up, see
        ``index_unindexed``): the write is then made on that revision.
        """
        try:
            return await self._put_snapshot(
                task,
                value,
                known.rev,
                known.scope,
                self._owner,
                known.index,
                known.owner,
                known.shard,
                positions,
            )
        except VersionConflictError:
            stored = await self.snapshot(task.id)
            if stored is None or stored.owner != self._owner or stored.seq > seq:
                raise
            return await self._put_snapshot(
                task,
                value,
                stored.rev,
                known.scope,
                self._owner,
                stored.index,
                stored.owner,
                stored.shard,
            )

    async def _put_snapshot(
        self,
        task: Task,
        value: bytes,
        rev: int,
        scope: str,
        owner: str,
        replaced: Positions | None,
        replaced_owner: str,
        shard: int,
        positions: Positions | None = None,
    ) -> tuple[int, Positions]:
        """Index (unless ``positions`` are given), then CAS-write a snapshot.

        Args:
            task: The task the snapshot holds.
            value: The snapshot.
            rev: The revision it replaces (0: none).
            scope: Whose task it is.
            owner: The instance the snapshot says runs it.
            replaced: The entries of the snapshot it replaces (dropped in the
                background once it is written), if known.
            replaced_owner: That snapshot's owner.
            shard: The event stream of its task's record.
            positions: Its entries, if already published (``_add``).

        Returns:
            The snapshot's revision and its entries' positions.

        Raises:
            VersionConflictError: The snapshot is not at ``rev`` (its new entries are dropped).
            StoreUnavailableError: NATS did not answer (the entries may stand: stale).
        """
        if positions is None:
            positions = await self._add(task, scope, owner, replaced, replaced_owner)
        try:
            written = await self._write_snapshot(task.id, value, rev, positions.header(), shard)
        except VersionConflictError:
            self._index.drop_later(_new(positions, replaced))
            raise
        if replaced is not None:
            self._index.drop_later(_new(replaced, positions))
        return written, positions

    async def _add(
        self,
        task: Task,
        scope: str,
        owner: str,
        replaced: Positions | None,
        replaced_owner: str,
    ) -> Positions:
        """Publish the entries of a snapshot of ``task`` owned by ``owner``.

        An unfinished task someone runs has an entry among its owner's tasks,
        kept from the snapshot it replaces when that one had the same owner.
        """
        owned: int | None = None
        owned_at = 0
        if owner and not taskops.is_final(task):
            owned = 0
            # Kept while young: entries expire with the stream's max age (task_ttl), and
            # a task may run longer than that.
            if (
                replaced is not None
                and replaced_owner == owner
                and replaced.o
                and time.time() - replaced.ot < self._entry_ttl / 2
            ):
                owned, owned_at = replaced.o, replaced.ot
        return await self._index.add(
            scope,
            task.context_id,
            task.status.state,
            task.id,
            status_ns(task),
            owner,
            owned,
            owned_at,
        )

    async def close(self) -> None:
        """Finish the index's background deletes (bounded)."""
        await self._index.close()

    async def _write_snapshot(
        self, key: str, value: bytes, rev: int, index: str = "", shard: int = 0
    ) -> int:
        """CAS-write a snapshot; a retry that finds its own bytes already written succeeds."""
        attempts = 0
        headers = {EXPECT: str(rev)}
        if index:
            headers[INDEX_HEADER] = index
        if shard:
            headers[SHARD] = str(shard)

        async def attempt() -> int:
            nonlocal attempts
            attempts += 1
            return await self._requests.publish(
                snapshot_subject(key), value, dict(headers), self._retry.timeout
            )

        try:
            return await self._retry(attempt, f"snapshot task {key}")
        except WrongLastSequenceError:
            if attempts > 1:
                current = await self._kv_entry(key)
                if current is not None and current[0] == value:
                    return current[1]  # the attempt that timed out had landed
            raise VersionConflictError(f"{key}: snapshot not at revision {rev}") from None

    async def _kv_entry(self, key: str) -> tuple[bytes, int, dict[str, str]] | None:
        """A snapshot's value, revision and headers (None: no such key, or deleted)."""

        async def attempt() -> api.RawStreamMsg | None:
            try:
                async with asyncio.timeout(self._retry.timeout):
                    return await self._js.get_msg(TASKS_STREAM, subject=snapshot_subject(key))
            except nats.js.errors.NotFoundError:
                return None

        msg = await self._retry(attempt, f"read task {key}")
        if msg is None or not msg.data or msg.seq is None:
            return None
        headers = dict(msg.headers or {})
        if headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data, msg.seq, headers

    async def _scan(self) -> builtins.list[tuple[bytes, int, dict[str, str]]]:
        """The latest value of every key, read with one ephemeral pull consumer."""
        return await self._retry(self._scan_once, "list the task bucket")

    async def _scan_once(self) -> builtins.list[tuple[bytes, int, dict[str, str]]]:
        config = last_per_subject(headers_only=False)
        found: builtins.list[tuple[bytes, int, dict[str, str]]] = []
        async with PullRead(self._js, TASKS_STREAM, TASKS_ALL, config, self._retry.budget) as read:
            async for msg in read:
                headers = dict(msg.headers or {})
                if "KV-Operation" not in headers and msg.data:
                    found.append((msg.data, msg.metadata.sequence.stream, headers))
        return found

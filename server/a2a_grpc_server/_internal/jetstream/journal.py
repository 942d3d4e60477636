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
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from a2a.types.a2a_pb2 import StreamResponse, Task
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from ..journal import (
    Change,
    FinalTaskError,
    PageTokens,
    PartialWriteError,
    RecordedTask,
    StoreError,
    TaskExistsError,
    TaskPage,
    TaskQuery,
    UnknownTaskError,
    VersionConflictError,
)
from ..model import taskops
from . import pullread
from .conn import events_stream
from .formats import Formats
from .index import (
    Positions,
    TaskIndex,
)
from .listing import Listing
from .ownership import SWEEP_BATCH as SWEEP_BATCH
from .ownership import Ownership
from .records import (
    MSG_ID,
    PAYLOAD_SLACK,
    SHARDS,
    STATE,
    STREAM_SEQ,
    messages,
)
from .records import SHARD as SHARD
from .records import Entry as Entry
from .records import Snapshot as Snapshot
from .records import encode as encode
from .records import shard_for as shard_for
from .records import subject as subject
from .requests import EXPECT, JetStreamRequests, WrongLastSequenceError, batches, position
from .retry import Retry
from .snapshots import SnapshotStore, new_positions

logger = logging.getLogger(__name__.replace("._internal", ""))

FOLD_BATCH = 256
"""Messages one direct get returns at most."""
_KNOWN_FINAL = 4096
_KNOWN_SHARDS = 65_536


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


class JetStreamJournal:
    """``TaskJournal`` on the ``A2A_EVENTS`` stream and the ``A2A_TASKS`` bucket.

    Args:
        requests: Lean requests on the connection (publish, direct get).
        js: The JetStream context (consumers, snapshot reads).
        owner: This instance's id, recorded with every task it creates.
        snapshot_every: Changes between two snapshots of a running task.
        retry: How long an operation retries through a NATS outage.
        formats: Which format to write (see ``formats``; None: format 1 only).
        page_tokens: Seals ListTasks page tokens.
        event_streams: Event streams new tasks are spread over.
        task_ttl: How long a snapshot and its index entries are kept.
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        js: JetStreamContext,
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
        self._owner = owner
        self._every = snapshot_every
        self._streams = event_streams
        self._shards: OrderedDict[str, int] = OrderedDict()
        """The event stream of tasks this instance wrote or read lately (their snapshots say)."""
        self._snapshotted: dict[str, _Snapshotted] = {}
        self._final: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._index = TaskIndex(requests, self._retry)
        self._store = SnapshotStore(requests, js, self._index, self._retry, task_ttl)
        # (each through this façade at call time, so the components read as it does)
        self._listing = Listing(
            self._store,
            self._index,
            self._tokens,
            self._formats,
            owner,
            lambda task_id: self.snapshot(task_id),
            lambda task_id, snap: self._fold(task_id, snap),
        )
        self._ownership = Ownership(
            self._store,
            self._index,
            self._formats,
            owner,
            lambda task_id: self.snapshot(task_id),
            lambda task_id, snap: self._fold(task_id, snap),
            lambda task_id: self.last_entry(task_id),
            self._forget,
        )

    @property
    def owner(self) -> str:
        """The instance id this journal records as owner."""
        return self._owner

    def scope_of(self, task_id: str) -> str | None:
        """None: a task's scope is in its snapshot, read over the network like its body."""
        return None

    @property
    def snapshots(self) -> SnapshotStore:
        """The snapshot bucket and the index entries each snapshot names."""
        return self._store

    @property
    def index(self) -> TaskIndex:
        """The listing index (shared with the push configs' delivery entries)."""
        return self._index

    @property
    def listing(self) -> Listing:
        """``ListTasks`` and the index's marker."""
        return self._listing

    @property
    def ownership(self) -> Ownership:
        """Sweeps, releases and claims."""
        return self._ownership

    async def list(self, query: TaskQuery) -> TaskPage:
        """One page, most recently updated first (``Listing.list``).

        Raises:
            InvalidPageTokenError: The token is malformed.
            StoreUnavailableError: NATS did not answer.
        """
        return await self._listing.list(query)

    async def snapshot(self, task_id: str) -> Snapshot | None:
        """The task's snapshot, or None (and where its record is, remembered).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        snap = await self._store.read(task_id)
        if snap is not None:
            self._remember_shard(task_id, snap.shard)
        return snap

    def _forget(self, task_id: str) -> None:
        """Forget what is known of the task's snapshot (rewritten elsewhere: read it again)."""
        self._snapshotted.pop(task_id, None)

    async def get(self, task_id: str) -> RecordedTask | None:
        """Return the task (its snapshot and the changes after it), or None.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        snap = await self.snapshot(task_id)
        if snap is None:
            return None
        return await self._fold(task_id, snap)

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
                await self._store.put(task, value, 0, scope, self._owner, None, "", shard)
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
            self._store.add(task, scope, self._owner, replaced, replaced_owner),
            return_exceptions=True,
        )
        if isinstance(appended, BaseException):
            if not isinstance(indexed, BaseException):
                self._index.drop_later(new_positions(indexed, replaced))
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
            rev, index = await self._store.put(
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
        shard = await self._shard(task_id)

        async def get(request: dict[str, object]) -> builtins.list[Msg]:
            return await self._retry(
                lambda: self._requests.direct_get(
                    events_stream(shard), request, self._retry.timeout
                ),
                f"read the changes of task {task_id}",
            )

        walk = batches(get, subject(task_id, shard), after_pos + 1, messages, FOLD_BATCH)
        async with contextlib.aclosing(walk) as read:
            async for msgs in read:
                for msg in msgs:
                    found.extend(Entry.unpack(msg, position(msg)))
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
        shard = await self._shard(task_id)
        return await self._retry(
            lambda: pullread.follow(
                self._js, events_stream(shard), subject(task_id, shard), after_pos, handle
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
            self._index.drop_later(new_positions(positions, known.index))
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
            return await self._store.put(
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
            return await self._store.put(
                task,
                value,
                stored.rev,
                known.scope,
                self._owner,
                stored.index,
                stored.owner,
                stored.shard,
            )

    async def close(self) -> None:
        """Finish the index's background deletes (bounded)."""
        await self._index.close()

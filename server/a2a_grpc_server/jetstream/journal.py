"""The task journal on JetStream: the event stream is the record, a KV bucket holds snapshots.

Record: stream ``A2A_EVENTS``, subject ``a2a.events.<task id>``, one message
per change of the task, headers:

* ``A2a-Seq``: the change's number in the task's log (1, 2, 3, … no gap; the
  same numbers every instance's readers get);
* ``A2a-Kind``: ``frame`` (the payload is the ``StreamResponse`` readers
  get) or ``message`` (a follow-up user message, a change without a frame;
  the payload is the ``Message``);
* ``A2a-State``: the state the frame carries (a number; 0 for none);
* ``Nats-Msg-Id``: ``<task id>:<seq>``.

A task's version is the stream sequence of its last change. Every write is
one publish with ``Nats-Expected-Last-Subject-Sequence`` set to the version
the writer read: JetStream refuses it if anyone wrote the task meanwhile, so
two instances can never both extend the same version (an owner and a
survivor that took it for lost, say). A final change is never followed by
another: a writer can only hold a final task's version by having written or
read it through a journal, and every journal remembers the final versions it
has seen (bounded) and refuses to extend them with ``FinalTaskError``; a
writer whose compare-and-set fails on a final change gets the same.

Snapshots: KV bucket ``A2A_TASKS``, one key per task, value: owner, state,
seq and stream sequence, each ended by a newline, then the ``Task``; written
when the task is created, when its state changes, every ``snapshot_every``
changes, and when it ends (each a compare-and-set on the key's revision). Reading a task is its
snapshot plus the changes after it (at most ``snapshot_every``, one batched
direct get); ``ListTasks`` filters on snapshots, which carry the current
state, and folds the changes of the live tasks on the page. A snapshot write
that fails is retried at the task's next change; the change itself, already
in the stream, stands.

Writes survive a NATS node failover: an attempt that timed out is retried;
if the retry finds its own change already stored (same ``Nats-Msg-Id``, or the
same snapshot bytes), the first attempt landed and counts.

Who runs what: the owner writes a task under the task's lock (``LiveTask``),
so its writes are in order; a survivor writes a lost owner's task only
through the same compare-and-set.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.js.errors
from a2a.types.a2a_pb2 import Message, StreamResponse, Task
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from .. import taskops
from ..journal import (
    Change,
    FinalTaskError,
    RecordedTask,
    StoreError,
    TaskExistsError,
    TaskPage,
    TaskQuery,
    UnknownTaskError,
    VersionConflictError,
    paginate,
    status_ns,
)
from .conn import EVENTS_STREAM, EVENTS_SUBJECT, TASKS_BUCKET
from .requests import JetStreamRequests, WrongLastSequenceError
from .retry import REQUEST_TIMEOUT, RETRY_FOR, retrying

logger = logging.getLogger(__name__)

SEQ = "A2a-Seq"
KIND = "A2a-Kind"
STATE = "A2a-State"
FRAME = "frame"
MESSAGE = "message"
MSG_ID = "Nats-Msg-Id"
EXPECT = "Nats-Expected-Last-Subject-Sequence"
STREAM_SEQ = "Nats-Sequence"
SCAN_BATCH = 256
SCAN_IDLE = 30.0
"""Seconds before JetStream removes a scan's consumer left behind by a lost instance."""
FOLD_BATCH = 256
"""Changes one direct get returns at most."""
IDLE_HEARTBEAT = 1.0
"""Seconds between JetStream heartbeats of a follower's consumer (how soon a lost one
is noticed)."""
_KEY = re.compile(r"^[A-Za-z0-9_=-]+$")
_KNOWN_FINAL = 4096


def subject(task_id: str) -> str:
    """The subject that carries ``task_id``'s changes."""
    return f"{EVENTS_SUBJECT}.{task_id}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One change of a task as the stream holds it."""

    pos: int
    """Its stream sequence."""
    seq: int
    """Its number in the task's log."""
    kind: str
    data: bytes
    state: int

    @classmethod
    def of(cls, msg: Msg, pos: int) -> Entry:
        """The entry a stream message (delivered or read directly) carries."""
        headers = msg.headers or {}
        return cls(
            pos=pos,
            seq=int(headers.get(SEQ, "0")),
            kind=headers.get(KIND, FRAME),
            data=bytes(msg.data),
            state=int(headers.get(STATE, "0")),
        )

    @property
    def final(self) -> bool:
        """Whether the change ended the task."""
        return taskops.is_final_state(self.state)  # type: ignore[arg-type]

    def apply(self, task: Task, index: taskops.ArtifactIndex | None = None) -> Task:
        """``task`` after this change (see ``taskops.apply_frame``)."""
        if self.kind == MESSAGE:
            taskops.add_user_message(task, Message.FromString(self.data))
            return task
        return taskops.apply_frame(task, StreamResponse.FromString(self.data), index)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A task's snapshot in the KV bucket."""

    owner: str
    state: int
    seq: int
    """The last change it includes."""
    pos: int
    """That change's stream sequence (0 if it was not known when written)."""
    body: bytes
    rev: int
    """The key's revision."""

    @classmethod
    def decode(cls, value: bytes, rev: int) -> Snapshot:
        """Parse a stored value."""
        owner, state, seq, pos, body = value.split(b"\n", 4)
        return cls(owner.decode(), int(state), int(seq), int(pos), body, rev)

    @property
    def final(self) -> bool:
        """Whether the snapshot is of an ended task."""
        return taskops.is_final_state(self.state)  # type: ignore[arg-type]

    def task(self) -> Task:
        """The task it holds."""
        return Task.FromString(self.body)


def encode(owner: str, task: Task, seq: int, pos: int) -> bytes:
    """A snapshot value (see the module docstring)."""
    head = f"{owner}\n{task.status.state}\n{seq}\n{pos}\n".encode()
    return head + task.SerializeToString()


@dataclass(slots=True)
class _Snapshotted:
    """What this instance knows of the snapshot of a task it writes."""

    rev: int
    seq: int
    state: int


class JetStreamJournal:
    """``TaskJournal`` on the ``A2A_EVENTS`` stream and the ``A2A_TASKS`` bucket.

    Args:
        requests: Lean requests on the connection (publish, direct get).
        js: The JetStream context (consumers, KV reads).
        kv: The snapshot bucket.
        owner: This instance's id, recorded with every task it creates.
        snapshot_every: Changes between two snapshots of a running task.
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        js: JetStreamContext,
        kv: KeyValue,
        owner: str,
        snapshot_every: int = 32,
    ) -> None:
        self._requests = requests
        self._js = js
        self._kv = kv
        self._owner = owner
        self._every = snapshot_every
        self._snapshotted: dict[str, _Snapshotted] = {}
        self._final: OrderedDict[tuple[str, int], None] = OrderedDict()

    @property
    def owner(self) -> str:
        """The instance id this journal records as owner."""
        return self._owner

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

        async def attempt() -> KeyValue.Entry | None:
            try:
                return await self._kv.get(task_id)
            except nats.js.errors.KeyNotFoundError:
                return None

        entry = await retrying(attempt, f"read task {task_id}")
        if entry is None or entry.value is None or entry.revision is None:
            return None
        return Snapshot.decode(entry.value, entry.revision)

    async def create(self, task: Task, change: Change) -> int:
        """Snapshot the new task, then record its first change.

        Raises:
            TaskExistsError: The id is taken.
            StoreUnavailableError: NATS did not answer.
        """
        try:
            rev = await self._write_snapshot(task.id, encode(self._owner, task, change.seq, 0), 0)
        except VersionConflictError:
            raise TaskExistsError(task.id) from None
        self._snapshotted[task.id] = _Snapshotted(rev, change.seq, task.status.state)
        return await self._append(task.id, change, 0)

    async def update(self, task: Task, expected_version: int, change: Change) -> int:
        """Record ``change`` if nobody wrote the task since ``expected_version``.

        Raises:
            UnknownTaskError: The task's record is gone.
            FinalTaskError: The task ended.
            VersionConflictError: Someone else wrote it.
            StoreUnavailableError: NATS did not answer.
        """
        if (task.id, expected_version) in self._final:
            raise FinalTaskError(task.id)
        version = await self._append(task.id, change, expected_version)
        if taskops.is_final(task):
            self._remember_final(task.id, version)
        await self._maybe_snapshot(task, change.seq, version)
        return version

    async def list(self, query: TaskQuery) -> TaskPage:
        """Return one page, most recently updated first (reads every snapshot: O(tasks)).

        Raises:
            InvalidPageTokenError: The token is malformed.
            StoreUnavailableError: NATS did not answer.
        """
        found: builtins.list[tuple[int, Snapshot]] = []
        for value, revision in await self._scan():
            snap = Snapshot.decode(value, revision)
            task = snap.task()
            if query.matches(task.context_id, task.status.state, status_ns(task)):
                found.append((revision, snap))
        snaps: dict[str, Snapshot] = {}

        def remember(snap: Snapshot) -> Task:
            task = snap.task()
            snaps[task.id] = snap
            return task

        page = paginate(found, query, "n", remember)
        live = [i for i, task in enumerate(page.tasks) if not snaps[task.id].final]
        folded = await asyncio.gather(
            *(self._fold(page.tasks[i].id, snaps[page.tasks[i].id]) for i in live)
        )
        for i, recorded in zip(live, folded, strict=True):
            page.tasks[i] = recorded.task
        return page

    async def unfinished(self) -> builtins.list[Snapshot]:
        """The snapshot of every task that is not final (for the lease reaper).

        Final tasks are skipped without being decoded.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        found = []
        for value, revision in await self._scan():
            snap = Snapshot.decode(value, revision)
            if not snap.final:
                found.append(snap)
        return found

    async def repair(self, recorded: RecordedTask) -> None:
        """Write the snapshot of a task whose record ended but whose snapshot says it runs.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        await self._maybe_snapshot(recorded.task, recorded.seq, recorded.version, force=True)

    async def entries(
        self, task_id: str, after_pos: int, most: int = FOLD_BATCH
    ) -> builtins.list[Entry]:
        """The task's changes stored after stream sequence ``after_pos`` (at most ``most``).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        request: dict[str, object] = {
            "seq": after_pos + 1,
            "next_by_subj": subject(task_id),
            "batch": most,
        }
        msgs = await retrying(
            lambda: self._requests.direct_get(EVENTS_STREAM, request, REQUEST_TIMEOUT),
            f"read the changes of task {task_id}",
        )
        return [Entry.of(m, int((m.headers or {})[STREAM_SEQ])) for m in msgs]

    async def last_entry(self, task_id: str) -> Entry | None:
        """The task's last change in the stream, or None.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        request: dict[str, object] = {"last_by_subj": subject(task_id)}
        msgs = await retrying(
            lambda: self._requests.direct_get(EVENTS_STREAM, request, REQUEST_TIMEOUT),
            f"read the last change of task {task_id}",
        )
        return Entry.of(msgs[0], int((msgs[0].headers or {})[STREAM_SEQ])) if msgs else None

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
        return await retrying(
            lambda: self._js.subscribe(
                subject(task_id),
                stream=EVENTS_STREAM,
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
            return RecordedTask(task, pos, snap.owner, seq)
        index = taskops.index_artifacts(task)
        while True:
            batch = await self.entries(task_id, pos)
            for entry in batch:
                pos = entry.pos
                if entry.seq <= seq:
                    continue  # already in the snapshot (written before its pos was known)
                seq = entry.seq
                applied = entry.apply(task, index)
                if applied is not task:
                    task, index = applied, taskops.index_artifacts(applied)
            if len(batch) < FOLD_BATCH:
                if taskops.is_final(task):
                    self._remember_final(task_id, pos)
                return RecordedTask(task, pos, snap.owner, seq)

    def _remember_final(self, task_id: str, pos: int) -> None:
        self._final[(task_id, pos)] = None
        while len(self._final) > _KNOWN_FINAL:
            self._final.popitem(last=False)

    async def _append(self, task_id: str, change: Change, expected: int) -> int:
        """Publish one change with a compare-and-set on the subject's last sequence."""
        msg_id = f"{task_id}:{change.seq}"
        kind = FRAME if change.message is None else MESSAGE
        headers = {
            SEQ: str(change.seq),
            KIND: kind,
            STATE: str(change.state),
            MSG_ID: msg_id,
            EXPECT: str(expected),
        }
        data = change.frame if change.message is None else change.message.SerializeToString()
        attempts = 0

        async def attempt() -> int:
            nonlocal attempts
            attempts += 1
            return await self._requests.publish(subject(task_id), data, headers, REQUEST_TIMEOUT)

        try:
            return await retrying(attempt, f"record a change of task {task_id}")
        except WrongLastSequenceError:
            last = await self._last_msg_id(task_id)
            if attempts > 1 and last is not None and last[0] == msg_id:
                return last[1]  # the attempt that timed out had landed
            if last is None:
                raise UnknownTaskError(task_id) from None
            entry = await self.last_entry(task_id)
            if entry is not None and entry.final:
                raise FinalTaskError(task_id) from None
            raise VersionConflictError(f"{task_id}: not at version {expected}") from None

    async def _last_msg_id(self, task_id: str) -> tuple[str, int] | None:
        request: dict[str, object] = {"last_by_subj": subject(task_id)}
        msgs = await retrying(
            lambda: self._requests.direct_get(EVENTS_STREAM, request, REQUEST_TIMEOUT),
            f"read the last change of task {task_id}",
        )
        if not msgs:
            return None
        headers = msgs[0].headers or {}
        return headers.get(MSG_ID, ""), int(headers[STREAM_SEQ])

    async def _maybe_snapshot(self, task: Task, seq: int, pos: int, *, force: bool = False) -> None:
        """Write the task's snapshot if one is due (see the module docstring)."""
        known = self._snapshotted.get(task.id)
        state = task.status.state
        final = taskops.is_final_state(state)
        if known is None:
            stored = await self.snapshot(task.id)
            if stored is None:
                return  # its record is gone (retention)
            known = _Snapshotted(stored.rev, stored.seq, stored.state)
        due = (
            force
            or final
            or state in taskops.INTERRUPTED
            or state != known.state
            or seq - known.seq >= self._every
        )
        if due:
            # A survivor ending a lost owner's task records itself as its owner.
            value = encode(self._owner, task, seq, pos)
            try:
                known.rev = await self._write_snapshot(task.id, value, known.rev)
                known.seq, known.state = seq, state
            except VersionConflictError:
                logger.warning("snapshot of task %s was written by another instance", task.id)
            except StoreError as exc:
                # The change is in the stream; the snapshot is retried at the next one.
                logger.warning("could not snapshot task %s: %s", task.id, exc)
        if final:
            self._snapshotted.pop(task.id, None)
        else:
            self._snapshotted[task.id] = known

    async def _write_snapshot(self, key: str, value: bytes, rev: int) -> int:
        """CAS-write a snapshot; a retry that finds its own bytes already written succeeds."""
        attempts = 0

        async def attempt() -> int:
            nonlocal attempts
            attempts += 1
            return await self._requests.publish(
                f"$KV.{TASKS_BUCKET}.{key}", value, {EXPECT: str(rev)}, REQUEST_TIMEOUT
            )

        try:
            return await retrying(attempt, f"snapshot task {key}")
        except WrongLastSequenceError:
            if attempts > 1:
                current = await self._kv_entry(key)
                if current is not None and current[0] == value:
                    return current[1]  # the attempt that timed out had landed
            raise VersionConflictError(f"{key}: snapshot not at revision {rev}") from None

    async def _kv_entry(self, key: str) -> tuple[bytes, int] | None:
        async def attempt() -> KeyValue.Entry | None:
            try:
                return await self._kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None

        entry = await retrying(attempt, f"read task {key}")
        if entry is None or entry.value is None or entry.revision is None:
            return None
        return entry.value, entry.revision

    async def _scan(self) -> builtins.list[tuple[bytes, int]]:
        """The latest value of every key, read with one ephemeral pull consumer."""
        return await retrying(self._scan_once, "list the task bucket")

    async def _scan_once(self) -> builtins.list[tuple[bytes, int]]:
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=SCAN_IDLE,
            mem_storage=True,
            num_replicas=1,
        )
        sub = await self._js.pull_subscribe(
            f"$KV.{TASKS_BUCKET}.>", stream=f"KV_{TASKS_BUCKET}", config=config
        )
        found: builtins.list[tuple[bytes, int]] = []
        try:
            pending = (await sub.consumer_info()).num_pending
            while pending:
                for msg in await sub.fetch(batch=min(pending, SCAN_BATCH), timeout=RETRY_FOR):
                    pending = msg.metadata.num_pending
                    op = (msg.headers or {}).get("KV-Operation")
                    if op is None and msg.data:
                        found.append((msg.data, msg.metadata.sequence.stream))
        finally:
            with contextlib.suppress(Exception):  # the consumer also expires on its own
                await sub.unsubscribe()
        return found

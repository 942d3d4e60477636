"""The task log of format 3 (layout E): one message per change, on the task's own subjects.

docs/decisions/0001-cluster-store-layout.md chose this layout (issue 41). This
module is step 1 of its plan: the log alone, asserted on a real nats-server
(tests/cluster/test_tasklog.py). ``serve`` does not use it yet: the journal writes
format 2 until step 2 puts this log behind the upgrade rule (``formats``).

Stream ``A2A_LOG`` holds every change of every task, one message each, on

    a2a.log.t.<task id>.<owner>.<scope>.<context>.<kind>

``owner``, ``scope`` and ``context`` are digests (``token``: a subject token
whatever the id holds); ``kind`` is ``s`` (changes and the task's snapshot after
them), ``e`` (changes only) or ``f`` (the final change and the final snapshot).
A task's version is the stream sequence of its last message. Every message is a
compare-and-set over all of the task's subjects
(``Nats-Expected-Last-Subject-Sequence`` with ``...-Subject: a2a.log.t.<task id>.>``):
JetStream stores it only if nobody wrote the task since the version the writer
holds, so a claim under another owner, an ``e`` after an ``s``, a second create
(version 0) are all refused alike. Nothing is written after an ``f``: the check
cannot tell a final version from another, so a writer must have read or written
the ``f`` to hold its version, and every ``TaskLog`` remembers the final versions
it has seen (bounded) and refuses to extend them; a refused write reads its cause.

Headers: ``A2a-Format: 3``; ``A2a-Seq`` and ``A2a-Count`` (the number of the
message's first change in the task's log and how many it holds, as in format 2);
``A2a-State`` (the state its last frame carries); ``Nats-Msg-Id``
(``<task id>:<first seq>:<writer>:<nonce>``: a retried publish finds its own
earlier attempt). On ``s`` and ``f`` also: ``A2a-Scope`` and ``A2a-Owner``
(whose task it is and who runs it: the subject holds their digests);
``A2a-Status`` (the snapshot's state and status timestamp in nanoseconds: a
listing filters on them without decoding); ``A2a-Changes`` (the bytes of the
payload that are changes; the rest is the ``Task``). The
changes are encoded as in format 2 (``records``).

The listing index is kept by nats-server (``conn.current_config``): stream
``A2A_CURRENT`` sources each ``s`` and ``f`` through subject transforms onto

    a2a.cur.<scope>.<context>.<task id>

keeping one message per subject: each task's newest snapshot, whoever wrote it
(the owner is left out, so a claim lands on the same entry). Nothing of ours
writes, repairs or collects it; lifetimes are the streams' (``max_age``).

A reader refuses a message in another format with ``UnknownFormatError``.

Who runs what: a task's writer holds its lock (``LiveTask``), so its appends are
in order; any other writer (a survivor claiming it) goes through the same
compare-and-set. Reads take no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from a2a.types.a2a_pb2 import Task
from nats.aio.msg import Msg

from ..errors import UnknownFormatError
from ..journal import (
    Change,
    FinalTaskError,
    PartialWriteError,
    RecordedTask,
    StoreError,
    StoreRefusedError,
    StoreUnavailableError,
    TaskExistsError,
    UnknownTaskError,
    VersionConflictError,
    status_ns,
)
from ..model import taskops
from .conn import CURRENT_STREAM as CURRENT_STREAM
from .conn import CURRENT_SUBJECT as CURRENT_SUBJECT
from .conn import LOG_STREAM as LOG_STREAM
from .conn import LOG_SUBJECT as LOG_SUBJECT
from .conn import current_config as current_config
from .conn import log_config as log_config
from .formats import HEADER as FORMAT
from .records import (
    COUNT,
    MSG_ID,
    PAYLOAD_SLACK,
    SEQ,
    STATE,
    STREAM_SEQ,
    SUBJECT,
    Entry,
    record,
)
from .requests import EXPECT, JetStreamRequests, WrongLastSequenceError, batches
from .retry import TRANSIENT, Retry

LOG_FORMAT = 3
"""The format of this log's messages (the only one it reads)."""
EXPECT_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
"""The filter a compare-and-set checks (every subject of the task), not the message's own."""
SCOPE = "A2a-Scope"
OWNER = "A2a-Owner"
STATUS = "A2a-Status"
CHANGES = "A2a-Changes"
SOURCE = "Nats-Stream-Source"
"""A copied message's origin: ``<stream> <seq> <filters> <transforms> <subject> [<id>]``."""
SNAPSHOT, EVENTS, FINAL = "s", "e", "f"
KINDS = (SNAPSHOT, EVENTS, FINAL)
BATCH = 256
"""Messages one direct get returns at most."""
STATE_TIMEOUT = 1.0
"""Seconds a stream's state is waited for (only its leader answers: in a failover, the
caller reads a replica instead, see ``TaskLog.stream_state``)."""
READ_ATTEMPTS = 3
"""Reads of a task that changed between the requests of one read (see ``TaskLog.read``)."""
KNOWN_FINAL = 4096
"""Final versions a log remembers (a writer holding an older one gets its cause read)."""
_NOT_A_TOKEN = frozenset(".*> \t\r\n")


def token(text: str) -> str:
    """A subject token for ``text``: the first 32 hex digits of its SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _task_token(task_id: str) -> str:
    """``task_id`` as a subject token (task ids are one already).

    Raises:
        ValueError: It is empty or holds a character no subject token may.
    """
    if not task_id or not _NOT_A_TOKEN.isdisjoint(task_id):
        raise ValueError(f"task id {task_id!r} is not a subject token")
    return task_id


@dataclass(frozen=True, slots=True)
class Where:
    """Whose change it is: the task, who writes it, and the scope and context it lists under."""

    task_id: str
    owner: str
    scope: str
    context_id: str

    def subject(self, kind: str) -> str:
        """The subject of a change of ``kind`` (``s``, ``e`` or ``f``)."""
        task = _task_token(self.task_id)
        owner, scope, context = token(self.owner), token(self.scope), token(self.context_id)
        return f"{LOG_SUBJECT}.t.{task}.{owner}.{scope}.{context}.{kind}"


def task_filter(task_id: str) -> str:
    """Every subject of one task: its compare-and-set, and its reads."""
    return f"{LOG_SUBJECT}.t.{_task_token(task_id)}.>"


def kind_filter(task_id: str, kind: str) -> str:
    """The task's messages of one kind, whoever wrote them."""
    return f"{LOG_SUBJECT}.t.{_task_token(task_id)}.*.*.*.{kind}"


def events_of(snapshot: Logged) -> str:
    """The literal subject of the ``e`` written after ``snapshot`` (by its writer)."""
    return snapshot.subject.rsplit(".", 1)[0] + f".{EVENTS}"


def owner_filter(owner: str) -> str:
    """Every message an owner wrote (a sweep's filter)."""
    return f"{LOG_SUBJECT}.t.*.{token(owner)}.>"


def current_subject(scope: str, context_id: str, task_id: str) -> str:
    """A task's entry in the listing index."""
    return f"{CURRENT_SUBJECT}.{token(scope)}.{token(context_id)}.{_task_token(task_id)}"


@dataclass(frozen=True, slots=True)
class Logged:
    """One message of the log, decoded."""

    pos: int
    """Its stream sequence (of the index's copy, when read from the index)."""
    origin: int
    """Its stream sequence in the log."""
    task_id: str
    kind: str
    owner_token: str
    """The digest of its writer's id (from its subject)."""
    changes: list[Entry]
    snapshot: bytes | None = None
    """The serialized ``Task`` after its changes (``s`` and ``f``); the rest are theirs too."""
    scope: str = ""
    """Whose task it is."""
    owner: str = ""
    """The id of the instance that runs the task."""
    state: int = 0
    """The snapshot's state."""
    status_ns: int = 0
    """The snapshot's status timestamp, nanoseconds since 1970."""
    subject: str = ""
    """Its subject in the log."""
    seq: int = 0
    """The number of the last change it holds or follows (``A2a-Seq`` + ``A2a-Count`` - 1)."""

    @property
    def final(self) -> bool:
        """Whether the task ended with it."""
        return self.kind == FINAL

    def task(self) -> Task:
        """The snapshot it carries.

        Raises:
            ValueError: It carries none (an ``e``).
        """
        if self.snapshot is None:
            raise ValueError(f"message {self.pos} carries no snapshot")
        return Task.FromString(self.snapshot)


def encode(
    changes: Sequence[Change],
    snapshot: Task | None,
    where: Where,
    writer: str,
    nonce: str = "",
    seq: int = 0,
) -> tuple[str, bytes, dict[str, str]]:
    """A change as one message: its kind, payload and headers (see the module docstring).

    ``snapshot`` None makes an ``e``; a snapshot of an ended task an ``f``. ``writer``
    (in the message id) is the instance writing; ``where.owner`` the one that runs
    the task after it (another when a survivor ends a lost owner's task). A
    snapshot without changes (who runs the task changed: a release, a claim) says
    the number its next change will have (``seq``).

    Raises:
        ValueError: No changes and no snapshot, or an ``e`` that ends the task (a
            final change carries its snapshot).
    """
    if not changes and (snapshot is None or seq < 1):
        raise ValueError("a message holds a change, or a snapshot and the next change's number")
    body = b"".join(record(change) for change in changes)
    state = 0
    if changes and changes[-1].message is None:
        state = changes[-1].state
    first = changes[0].seq if changes else seq
    headers = {
        FORMAT: str(LOG_FORMAT),
        SEQ: str(first),
        COUNT: str(len(changes)),
        STATE: str(state),
        MSG_ID: f"{where.task_id}:{first}:{writer}:{nonce or os.urandom(4).hex()}",
    }
    if snapshot is None:
        if taskops.is_final_state(state):  # type: ignore[arg-type]
            raise ValueError("a final change carries the task's snapshot")
        return EVENTS, body, headers
    headers[SCOPE] = where.scope
    headers[OWNER] = where.owner
    headers[STATUS] = f"{snapshot.status.state} {status_ns(snapshot)}"
    headers[CHANGES] = str(len(body))
    kind = FINAL if taskops.is_final_state(snapshot.status.state) else SNAPSHOT
    return kind, body + snapshot.SerializeToString(), headers


def decode(msg: Msg, pos: int = 0) -> Logged:
    """A message read from the log or from the index (a direct get's answer).

    Read from the index, its position is the index's; its kind and owner are
    those of the log's message it copies. Delivered by a consumer, it says
    neither its subject nor its position in its headers: ``pos`` is the latter.

    Raises:
        UnknownFormatError: It is not in this log's format, or of a kind this
            version does not know.
    """
    headers: Mapping[str, str] = msg.headers or {}
    given = headers.get(FORMAT)
    if given != str(LOG_FORMAT):
        raise UnknownFormatError("a message of the task log", str(given)[:16])
    source = headers.get(SOURCE, "").split(" ")  # (read from the index: the log's message)
    copied = len(source) > 4 and source[1].isdigit()
    subject = source[4] if copied else headers.get(SUBJECT, msg.subject)
    tokens = subject.split(".")
    if len(tokens) != 8 or tokens[-1] not in KINDS:
        raise UnknownFormatError("a message of the task log", f"subject {subject[:64]}")
    task_id, owner, kind = tokens[3], tokens[4], tokens[-1]
    pos = int(headers.get(STREAM_SEQ, pos))
    origin = int(source[1]) if copied else pos
    data = msg.data
    split = int(headers.get(CHANGES, len(data)))
    first = int(headers.get(SEQ, "0"))
    changes = Entry.unpack_records(data[:split], origin, first)
    last = first + int(headers.get(COUNT, "0")) - 1
    if kind == EVENTS:
        return Logged(pos, origin, task_id, kind, owner, changes, subject=subject, seq=last)
    state, _, stamp = headers.get(STATUS, "0 0").partition(" ")
    return Logged(
        pos,
        origin,
        task_id,
        kind,
        owner,
        changes,
        bytes(data[split:]),
        headers.get(SCOPE, ""),
        headers.get(OWNER, ""),
        int(state),
        int(stamp or 0),
        subject,
        last,
    )


@dataclass(frozen=True, slots=True)
class LogRead:
    """A task as the log holds it: its newest snapshot and the changes after it."""

    snapshot: Logged
    after: list[Entry]
    """The changes written after the snapshot, in order."""
    version: int
    """The stream sequence of its last message (the next write's compare-and-set)."""

    @property
    def final(self) -> bool:
        """Whether the task has ended."""
        return self.snapshot.final

    @property
    def seq(self) -> int:
        """The number of the task's last change."""
        return self.after[-1].seq if self.after else self.snapshot.seq


class TaskLog:
    """Appends to and reads the log on one connection.

    Args:
        requests: Lean requests on the connection (publish, direct get).
        writer: This instance's id (in every message id it writes).
        retry: How long an operation retries through a NATS outage.
        stream: The log's stream (tests name their own).
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        writer: str,
        retry: Retry | None = None,
        stream: str = LOG_STREAM,
    ) -> None:
        self._requests = requests
        self._writer = writer
        self._retry = retry or Retry()
        self._stream = stream
        self._final: OrderedDict[tuple[str, int], None] = OrderedDict()
        """Final versions this log wrote or read, newest last (``KNOWN_FINAL`` at most)."""

    def _remember_final(self, task_id: str, pos: int) -> None:
        self._final[(task_id, pos)] = None
        if len(self._final) > KNOWN_FINAL:
            self._final.popitem(last=False)

    async def append(
        self,
        where: Where,
        changes: Sequence[Change],
        snapshot: Task | None,
        expected: int,
        seq: int = 0,
    ) -> int:
        """Write the changes (and the snapshot after them) at ``expected``; their position.

        ``expected`` 0 creates the task. Changes too large for one message take
        several, each a compare-and-set on the one before: the first ones as
        ``e``, the last with the snapshot. No changes: the snapshot alone (who
        runs the task changed), ``seq`` the number of its next change.

        Raises:
            TaskExistsError: ``expected`` is 0 and the task exists.
            FinalTaskError: The task has ended.
            UnknownTaskError: ``expected`` is not 0 and the task is not in the log.
            VersionConflictError: Someone wrote the task since ``expected``.
            PartialWriteError: The first messages were stored, then one failed.
            StoreError: The snapshot alone is larger than a message can be.
        """
        if (where.task_id, expected) in self._final:
            raise FinalTaskError(where.task_id)
        most = max(self._requests.max_payload - PAYLOAD_SLACK, 1)
        runs = _runs(changes, most)
        version, done = expected, 0
        for i, run in enumerate(runs):
            last = i == len(runs) - 1
            kind, payload, headers = encode(
                run, snapshot if last else None, where, self._writer, seq=seq
            )
            if len(payload) > most:
                raise StoreError(f"task {where.task_id}: its snapshot exceeds a NATS message")
            try:
                version = await self._publish(where, kind, payload, headers, version)
            except StoreError as exc:
                if not done:
                    raise
                raise PartialWriteError(done, version) from exc
            done += len(run)
        if kind == FINAL:
            self._remember_final(where.task_id, version)
        return version

    async def _publish(
        self, where: Where, kind: str, payload: bytes, headers: dict[str, str], expected: int
    ) -> int:
        """One compare-and-set publish; a refusal read for its cause."""
        headers[EXPECT] = str(expected)
        headers[EXPECT_SUBJECT] = task_filter(where.task_id)
        subject = where.subject(kind)
        attempts = 0

        async def attempt() -> int:
            nonlocal attempts
            attempts += 1
            return await self._requests.publish(subject, payload, headers, self._retry.timeout)

        try:
            return await self._retry(attempt, f"record a change of task {where.task_id}")
        except WrongLastSequenceError:
            if attempts > 1 and (landed := await self.landed(where.task_id, expected, headers)):
                return landed  # the attempt that timed out had landed
            last = await self.last(where.task_id)
            if last is None:
                raise UnknownTaskError(where.task_id) from None
            if last.final:
                raise FinalTaskError(where.task_id) from None
            if not expected:
                raise TaskExistsError(where.task_id) from None
            raise VersionConflictError(f"{where.task_id}: not at version {expected}") from None

    async def landed(self, task_id: str, expected: int, headers: Mapping[str, str]) -> int:
        """Where a retried publish's first attempt was stored; 0 if it was not.

        That is the position of the task's next message after ``expected`` if it
        holds the message id in ``headers``.
        """
        msgs = await self._get(
            {"seq": expected + 1, "next_by_subj": task_filter(task_id)},
            f"read the change after {expected} of task {task_id}",
        )
        found = (msgs[0].headers or {}) if msgs else {}
        return int(found[STREAM_SEQ]) if found.get(MSG_ID) == headers[MSG_ID] else 0

    async def last(self, task_id: str) -> Logged | None:
        """The task's last message (None: not in the log)."""
        msgs = await self._get(
            {"last_by_subj": task_filter(task_id)}, f"read the last change of task {task_id}"
        )
        if not msgs:
            return None
        last = decode(msgs[0])
        if last.final:
            self._remember_final(task_id, last.pos)
        return last

    async def holds_any(self) -> bool:
        """Whether the log holds any task (one direct get).

        A last message by a wildcard walks every task's subjects in nats-server
        (37 ms at 100,000 tasks; docs/decisions/0001-cluster-store-layout.md): a
        caller asks the index's state first (``LogJournal.holds_any``).
        """
        msgs = await self._get({"last_by_subj": f"{LOG_SUBJECT}.t.>"}, "read the task log")
        return bool(msgs)

    async def stream_state(self, stream: str | None = None) -> tuple[int, int] | None:
        """How many messages ``stream`` (default: the log) holds, and its last position.

        One stream info request, answered from counters (no subject walked). Only
        the stream's leader answers: None when none did within ``STATE_TIMEOUT`` (a
        failover), and the caller reads a replica the slow way instead.

        Raises:
            StoreRefusedError: NATS refused the request (no such stream).
        """
        name = stream or self._stream
        try:
            answer = await self._requests.api(
                f"$JS.API.STREAM.INFO.{name}", b"", min(STATE_TIMEOUT, self._retry.timeout)
            )
        except TRANSIENT:
            return None
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise StoreRefusedError(f"NATS refused to read stream {name}: {exc}") from exc
        state = answer.get("state")
        if not isinstance(state, dict):
            return 0, 0
        return int(state.get("messages", 0)), int(state.get("last_seq", 0))

    async def read(self, task_id: str) -> LogRead | None:
        """The task by id: its newest ``s`` or its ``f``, and the changes after it.

        Two requests at once (the newest ``s``, the ``f``), then, unless it ended,
        the ``e`` after the snapshot on the snapshot's owner's subject (an owner
        that takes a task over writes an ``s`` first), in batches. The ``e`` must
        number on from the snapshot without a gap: a gap means another ``s`` was
        written between the two reads (its changes are not on that subject), and
        the task is read again (``READ_ATTEMPTS``), the last time with every message
        after the snapshot, of any writer and kind.

        Raises:
            UnknownFormatError: A message in a format this version does not read.
            StoreUnavailableError: The task changed under every attempt.
        """
        what = f"read task {task_id}"
        for attempt in range(READ_ATTEMPTS):
            snaps, finals = await asyncio.gather(
                self._get({"last_by_subj": kind_filter(task_id, SNAPSHOT)}, what),
                self._get({"last_by_subj": kind_filter(task_id, FINAL)}, what),
            )
            if finals:
                final = decode(finals[0])
                self._remember_final(task_id, final.pos)
                return LogRead(final, [], final.pos)
            if not snaps:
                return None
            snap = decode(snaps[0])
            last = attempt == READ_ATTEMPTS - 1
            # (the last attempt reads every message after the s, whoever wrote it: one walk
            # of the task's filter, numbered on whatever was written meanwhile)
            after = await self.entries(task_id, snap.pos, None if last else events_of(snap))
            if numbered_on(snap.seq, after):
                return LogRead(snap, after, after[-1].pos if after else snap.pos)
        raise StoreUnavailableError(f"task {task_id} changed under every read; retry")

    async def entries(
        self, task_id: str, version: int, subject: str | None = None, most: int | None = None
    ) -> list[Entry]:
        """The changes stored after position ``version``, in order (of ``most`` messages).

        ``subject`` narrows the read to one literal subject (cheap at any size);
        None reads the task's filter: a wildcard ``next_by_subj`` walks the stream's
        blocks after ``version`` once it holds more than 64 Ki subjects, so a caller
        that knows the owner passes its subject.
        """
        what = f"read the changes of task {task_id} after {version}"
        found: list[Entry] = []
        where = subject or task_filter(task_id)
        walk = batches(lambda r: self._get(r, what), where, version + 1, most, BATCH)
        async with contextlib.aclosing(walk) as read:
            async for msgs in read:
                for msg in msgs:
                    found.extend(decode(msg).changes)
        return found

    async def _get(self, request: dict[str, object], what: str) -> list[Msg]:
        """A direct get on the log, retried through an outage."""
        return await self._retry(
            lambda: self._requests.direct_get(self._stream, request, self._retry.timeout), what
        )


def numbered_on(seq: int, after: Sequence[Entry]) -> bool:
    """Whether ``after`` numbers on from change ``seq`` without a gap."""
    return all(entry.seq == seq + 1 + i for i, entry in enumerate(after))


def _runs(changes: Sequence[Change], most: int) -> list[list[Change]]:
    """The changes cut into messages of at most ``most`` bytes of changes each."""
    runs: list[list[Change]] = [[]]
    size = 0
    for change in changes:
        length = len(record(change))
        if runs[-1] and size + length > most:
            runs.append([])
            size = 0
        runs[-1].append(change)
        size += length
    return runs


def fold(read: LogRead) -> RecordedTask:
    """The task of ``read``'s snapshot with the changes after it applied."""
    snap = read.snapshot
    task, seq = snap.task(), snap.seq
    version = read.version
    index = taskops.index_artifacts(task)
    for entry in read.after:
        if entry.seq <= seq:
            continue  # (in the snapshot already)
        seq = entry.seq
        applied = entry.apply(task, index)
        if applied is not task:
            task, index = applied, taskops.index_artifacts(applied)
    return RecordedTask(task, version, snap.owner, seq, snap.scope)

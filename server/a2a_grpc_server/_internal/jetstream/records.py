"""The task record's codec: what a change and a snapshot look like in NATS.

``journal`` writes and reads them; this module only encodes and decodes.

Record: stream ``A2A_EVENTS``, subject ``a2a.events.<task id>``, one message
per write of the task: the changes written together (one, or the events
a burst committed at once), at most ``max_payload`` bytes per message (a
write too large for one message takes several). Headers:

* ``A2a-Seq``: the number of the message's first change in the task's log
  (changes are numbered 1, 2, 3, … with no gap; the same numbers every
  instance's readers get); ``A2a-Count``: how many changes it holds;
* ``A2a-State``: the state its last frame carries (a number; 0 for none), so
  a final change is seen without decoding it;
* ``Nats-Msg-Id``: ``<task id>:<first seq>:<writer's instance id>:<nonce>`` (how a
  retried write recognises its own earlier attempt; the nonce, drawn once per write,
  keeps another write of the same change number by the same writer, such as the final
  state after a change whose outcome is not known yet, from passing for it);
* ``A2a-Format``: the format (see ``formats``; none: format 1). A change of a
  kind this version does not know is refused, not read as a frame.

The payload is the changes one after the other, each ``kind`` (one byte:
``f`` for a frame, the ``StreamResponse`` readers get; ``m`` for a follow-up
user message, a change without a frame, the ``Message``), ``state`` (one
byte) and the length of its data (4 bytes, big-endian), then the data.

Snapshots: KV bucket ``A2A_TASKS``, one key per task, value (in format 2
after the ``formats.MAGIC`` prefix and the format's number): owner, state,
seq, stream sequence and ``s:`` with the scope (whose task it is, see
``scope``; a one-line key), each ended by a newline, then the ``Task`` (a
value written before scopes existed has no scope line: the anonymous scope;
a serialized ``Task`` never starts with ``s``); written
right after the task's first changes are in the stream, when its state
changes, every ``snapshot_every`` changes, and when it ends (each a
compare-and-set on the key's revision).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from a2a.types.a2a_pb2 import Message, StreamResponse, Task
from nats.aio.msg import Msg

from ..errors import FrameNotKeptError, UnknownFormatError
from ..journal import Change
from ..model import taskops
from .conn import TASKS_BUCKET, events_subjects
from .formats import HEADER as FORMAT
from .formats import LEGACY, check_header, mark, unmark
from .index import HEADER as INDEX_HEADER
from .index import Positions
from .natsconfig import MAX_EVENT_STREAMS
from .requests import STREAM_SEQ as STREAM_SEQ

SEQ = "A2a-Seq"
COUNT = "A2a-Count"
STATE = "A2a-State"
FRAME = "frame"
MESSAGE = "message"
_KINDS = {FRAME: ord("f"), MESSAGE: ord("m")}
_NAMES = {code: name for name, code in _KINDS.items()}
_RECORD = struct.Struct(">BBI")
"""A change's head in a message: kind, state, length of its data."""
PAYLOAD_SLACK = 1024
"""Bytes of a server's ``max_payload`` left for a message's headers."""
MSG_ID = "Nats-Msg-Id"
SUBJECT = "Nats-Subject"
"""A direct get's answer: the subject its message was stored on."""
TASKS_STREAM = f"KV_{TASKS_BUCKET}"
"""The stream behind the snapshot bucket."""
TASKS_ALL = f"$KV.{TASKS_BUCKET}.>"
"""Every key of the snapshot bucket, as stream subjects."""


def subject(task_id: str, shard: int = 0) -> str:
    """The subject that carries ``task_id``'s changes (in event stream ``shard``)."""
    return f"{events_subjects(shard)}.{task_id}"


SHARD = "A2a-Shard"
"""A snapshot's header: the event stream its task's record is in (absent: 0)."""
SHARDS = "shards"
"""The feature of an instance that reads a task's record where its snapshot says."""


def snapshot_subject(task_id: str) -> str:
    """The stream subject of a task's snapshot (its key in the snapshot bucket)."""
    return f"$KV.{TASKS_BUCKET}.{task_id}"


def shard_for(task_id: str, streams: int) -> int:
    """The event stream a new task goes to, of ``streams``: by its id's hash."""
    if streams <= 1:
        return 0
    return int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:4], "big") % streams


@dataclass(frozen=True, slots=True)
class Entry:
    """One change of a task as the stream holds it."""

    pos: int
    """The stream sequence of the message that holds it."""
    seq: int
    """Its number in the task's log."""
    kind: str
    data: bytes
    state: int

    @classmethod
    def unpack(cls, msg: Msg, pos: int) -> list[Entry]:
        """The changes a stream message (delivered or read directly) holds."""
        check_header(msg.headers, "a message of the task record")
        return cls.unpack_records(msg.data, pos, int((msg.headers or {}).get(SEQ, "0")))

    @classmethod
    def unpack_records(cls, data: bytes, pos: int, seq: int) -> list[Entry]:
        """The changes encoded one after the other in ``data``, the first numbered ``seq``.

        Raises:
            UnknownFormatError: A change of a kind this version does not know.
        """
        view, offset, found = memoryview(data), 0, list[Entry]()
        while offset < len(view):
            kind, state, size = _RECORD.unpack_from(view, offset)
            offset += _RECORD.size
            body = bytes(view[offset : offset + size])
            offset += size
            name = _NAMES.get(kind)
            if name is None:
                raise UnknownFormatError("a change of the task record", f"kind {kind}")
            found.append(cls(pos, seq + len(found), name, body, state))
        return found

    @property
    def final(self) -> bool:
        """Whether the change ended the task."""
        return taskops.is_final_state(self.state)  # type: ignore[arg-type]

    @property
    def frame(self) -> bytes:
        """The frame readers get for it (empty for a change without one)."""
        return self.data if self.kind == FRAME else b""

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
    scope: str
    """Whose task it is (see ``scope``)."""
    body: bytes
    rev: int
    """The key's revision."""
    index: Positions | None = None
    """Its entries in the listing index (see ``index``; None: written without)."""
    shard: int = 0
    """The event stream its task's record is in (header ``A2a-Shard``)."""

    @classmethod
    def decode(cls, value: bytes, rev: int, headers: Mapping[str, str] | None = None) -> Snapshot:
        """Parse a stored value (format 1 or 2, see ``formats``) and its message's headers.

        Raises:
            UnknownFormatError: It is in a format this version does not read.
        """
        owner, state, seq, pos, rest = unmark(value, "a task's snapshot").split(b"\n", 4)
        scope = b""
        if rest.startswith(SCOPE_MARK):
            scope, rest = rest[len(SCOPE_MARK) :].split(b"\n", 1)
        index = Positions.read((headers or {}).get(INDEX_HEADER))
        shard = _shard_header((headers or {}).get(SHARD))
        return cls(
            owner.decode(), int(state), int(seq), int(pos), scope.decode(), rest, rev, index, shard
        )

    @property
    def final(self) -> bool:
        """Whether the snapshot is of an ended task."""
        return taskops.is_final_state(self.state)  # type: ignore[arg-type]

    def task(self) -> Task:
        """The task it holds."""
        return Task.FromString(self.body)


def resume_from(task_id: str, first: Sequence[Entry], after: int, last: int) -> int:
    """Where a stream resumed after change ``after`` follows from: before the oldest kept.

    ``first``: the record's changes from its start; ``last``: the task's newest change.

    Raises:
        FrameNotKeptError: The record no longer holds change ``after + 1``.
    """
    if not first or first[0].seq > after + 1:
        oldest = first[0].seq if first else last + 1
        raise FrameNotKeptError(task_id, after + 1, oldest, last)
    return first[0].pos - 1


def _shard_header(value: str | None) -> int:
    """The event stream an ``A2a-Shard`` header names (0 when absent).

    Raises:
        UnknownFormatError: Not a number this version can read.
    """
    if value is None:
        return 0
    if not value.isdigit() or int(value) >= MAX_EVENT_STREAMS:
        raise UnknownFormatError("a snapshot's event stream", value[:16])
    return int(value)


def record(change: Change) -> bytes:
    """One change as it goes into a message (see the module docstring)."""
    if change.message is not None:
        data = change.message.SerializeToString()
        return _RECORD.pack(_KINDS[MESSAGE], 0, len(data)) + data
    return _RECORD.pack(_KINDS[FRAME], change.state, len(change.frame)) + change.frame


def messages(
    task_id: str,
    changes: Sequence[Change],
    most: int,
    writer: str,
    fmt: int = LEGACY,
    nonce: str | None = None,
) -> list[tuple[int, bytes, dict[str, str]]]:
    """The changes as stream messages of at most ``most`` bytes: (changes, payload, headers).

    ``nonce`` ends each message id (None: drawn now, once for the whole write; "": none,
    as versions before it wrote, for the committed format samples).
    """
    runs: list[list[bytes]] = [[]]
    size = 0
    for change in changes:
        encoded = record(change)
        if runs[-1] and size + len(encoded) > most:
            runs.append([])
            size = 0
        runs[-1].append(encoded)
        size += len(encoded)
    out, seq = [], changes[0].seq
    if nonce is None:
        nonce = os.urandom(4).hex()  # (one per write: its retries keep it)
    suffix = f":{nonce}" if nonce else ""
    for run in runs:
        last = changes[seq - changes[0].seq + len(run) - 1]
        headers = {
            SEQ: str(seq),
            COUNT: str(len(run)),
            STATE: str(last.state if last.message is None else 0),
            MSG_ID: f"{task_id}:{seq}:{writer}{suffix}",
            FORMAT: str(fmt),
        }
        out.append((len(run), b"".join(run), headers))
        seq += len(run)
    return out


SCOPE_MARK = b"s:"
"""Starts a snapshot's scope line (see the module docstring)."""


def encode(owner: str, task: Task, seq: int, pos: int, scope: str, fmt: int = LEGACY) -> bytes:
    """A snapshot value in format ``fmt`` (see the module docstring and ``formats``)."""
    head = f"{owner}\n{task.status.state}\n{seq}\n{pos}\ns:{scope}\n".encode()
    return mark(head + task.SerializeToString(), fmt)

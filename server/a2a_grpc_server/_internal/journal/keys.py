"""Sent keys: which SendMessage requests a caller already sent, so a retry runs nothing twice.

A key is a digest of the caller's scope and the request's message id (or the
``idempotency-key`` metadata it sent). Its record says what the first
request with that key was (a digest of its body) and where its answer is:

* *pending*: the first request is starting (no task id yet for a new task);
  a retry waits for it (``rpc.idempotency``);
* *started*: the task it started or continued, and the number of the last
  change before its run (its outcome is the task's first final or
  interrupted state after that);
* *answered*: the executor answered with a message and no task (the message
  is kept);
* *uncertain*: a follow-up routed to the task's owner (cluster mode) got no
  answer it could trust, so it may or may not have run: the record names the
  owner asked (``asked``). A retry looks at the task (``rpc.idempotency``):
  its message in the history after what the task had when it was sent
  (``seen``) means it ran (answered as *started*); a task that ended, or
  that another owner (or none) holds now, or a time past ``until``, means
  it never will (the retry takes the key over and runs it); otherwise the
  retry is told to come back.

A pending record whose writer died is taken over after ``PENDING_FOR``
seconds (a follow-up's once its retry found it did not run, as for an
*uncertain* one). Records expire ``window`` seconds after they were claimed (the
``idempotency_window`` setting). The in-memory store keeps at most
``most`` records, and ``ANSWERS_KEPT_BYTES`` of answers; over a bound, the
record that goes is the oldest of the caller keeping the most (records, or
answers' bytes, as the bound is; the caller is the record's principal,
tenants aside, as for final tasks in ``journal.memory``): one caller sending
many keyed messages forgets its own oldest keys first (a retry of those runs
again). Each caller thus keeps at least its fair share, ``most`` divided by
the callers keeping keys; a caller over it loses keys when others send. An
answer over ``ANSWER_KEPT`` is not kept (a retry is told so). The shared
store (``jetstream.keys``) is a KV bucket whose max age is the window.
"""

from __future__ import annotations

import base64
import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from ..errors import UnknownFormatError

FORMAT = 1
UNCERTAIN_FORMAT = 2
"""An *uncertain* record's format: a version that does not know it refuses it, rather than
answer a message that may never have run as if it had."""
PENDING_FOR = 300.0
"""Seconds after which a pending record is taken for abandoned (its writer died starting;
a start takes milliseconds, or the journal's retries at worst)."""
ANSWER_KEPT = 64 * 1024
"""Largest message-only answer kept for a retry (a larger one: ``dropped``)."""
ANSWERS_KEPT_BYTES = 64 * 1024 * 1024
"""Bytes of answers the in-memory store keeps (past it the oldest records go)."""


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What the first request with a key was, and where its answer is (see the module)."""

    digest: str
    """A digest of the first request's body."""
    task_id: str = ""
    after: int = -1
    """The number of the task's last change before the first request's run (-1: pending)."""
    answer: bytes = b""
    """The executor's message-only answer (a serialized ``Message``), if it gave one."""
    at: float = 0.0
    """When it was claimed (seconds since the epoch)."""
    dropped: bool = False
    """The executor answered with a message larger than ``ANSWER_KEPT``: not kept."""
    caller: str = ""
    """Whose key it is (the principal): what the in-memory store bounds keys by. Not in
    ``encode``: the shared bucket's bound is its window."""
    asked: str = ""
    """The owner a follow-up was routed to, when it is not known whether it ran it."""
    seen: int = 0
    """*Uncertain*: the length of the task's history when the follow-up was sent (it is
    looked for after that)."""
    until: float = 0.0
    """*Uncertain*: when the owner can no longer act on it (seconds since the epoch)."""

    @property
    def pending(self) -> bool:
        """Whether the first request is still starting."""
        return self.after < 0 and not self.answer and not self.dropped

    def abandoned(self, now: float) -> bool:
        """Whether it is pending and older than ``PENDING_FOR`` (its writer died starting).

        A store takes an abandoned record of a new task over in ``claim``; one of
        a follow-up (``task_id`` set) it returns: the message may have been
        recorded in the task, which ``rpc.idempotency`` looks at first.
        """
        return self.pending and now - self.at > PENDING_FOR

    def started(self, task_id: str, after: int) -> KeyRecord:
        """This record once the first request's run started."""
        # (not dataclasses.replace, which reads the fields anew at every call)
        return KeyRecord(
            self.digest, task_id, max(after, 0), self.answer, self.at, self.dropped, self.caller
        )

    def uncertain(self, task_id: str, after: int, asked: str, seen: int, until: float) -> KeyRecord:
        """This record once ``asked``, routed the follow-up, did not say whether it ran it."""
        return KeyRecord(
            self.digest,
            task_id,
            max(after, 0),
            b"",
            self.at,
            False,
            self.caller,
            asked,
            seen,
            until,
        )

    def answered(self, answer: bytes) -> KeyRecord:
        """This record once the executor answered with a message and no task."""
        if len(answer) > ANSWER_KEPT:
            return KeyRecord(self.digest, self.task_id, self.after, b"", self.at, True, self.caller)
        return KeyRecord(
            self.digest, self.task_id, self.after, answer, self.at, self.dropped, self.caller
        )

    def stamped(self, at: float) -> KeyRecord:
        """This record, claimed at ``at``."""
        return KeyRecord(
            self.digest,
            self.task_id,
            self.after,
            self.answer,
            at,
            self.dropped,
            self.caller,
            self.asked,
            self.seen,
            self.until,
        )

    def encode(self) -> bytes:
        """The record as stored (JSON, with its format)."""
        body: dict[str, object] = {
            "format": UNCERTAIN_FORMAT if self.asked else FORMAT,
            "digest": self.digest,
            "task_id": self.task_id,
            "after": self.after,
            "answer": base64.b64encode(self.answer).decode(),
            "at": self.at,
            "dropped": self.dropped,
        }
        if self.asked:
            body.update(asked=self.asked, seen=self.seen, until=self.until)
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> KeyRecord:
        """A stored record.

        Raises:
            UnknownFormatError: It is in a format this version does not read.
        """
        try:
            found = json.loads(data)
            fmt = found["format"]
        except (ValueError, TypeError, KeyError):
            raise UnknownFormatError("a sent key's record", repr(data[:40])) from None
        if fmt not in (FORMAT, UNCERTAIN_FORMAT):
            raise UnknownFormatError("a sent key's record", str(fmt))
        try:
            return cls(
                str(found["digest"]),
                str(found["task_id"]),
                int(found["after"]),
                base64.b64decode(found["answer"]),
                float(found["at"]),
                bool(found.get("dropped", False)),
                asked=str(found["asked"]) if fmt == UNCERTAIN_FORMAT else "",
                seen=int(found["seen"]) if fmt == UNCERTAIN_FORMAT else 0,
                until=float(found["until"]) if fmt == UNCERTAIN_FORMAT else 0.0,
            )
        except (ValueError, TypeError, KeyError):
            raise UnknownFormatError("a sent key's record", repr(data[:40])) from None


class SentKeys(Protocol):
    """Where sent keys are kept (in memory, or shared by a cluster)."""

    immediate: bool
    """Whether ``settle`` and ``release`` complete without waiting (the keys are in this
    process): a new task's start on this instance's engine recorded here cannot be cut
    between its run and its record, so it needs no shield from the caller leaving (see
    ``rpc.servicer``)."""

    async def claim(
        self, key: str, record: KeyRecord, replacing: KeyRecord | None = None
    ) -> KeyRecord | None:
        """Keep ``record`` under ``key`` unless one is there (or only an abandoned one).

        ``replacing``: a record found there before that may be replaced too (an
        *uncertain* one that cannot have run, ``rpc.idempotency``), if it is
        still there unchanged.

        Returns:
            None if this claimed it, else the record there.

        Raises:
            StoreError: The store could not be reached.
        """
        ...

    async def settle(self, key: str, record: KeyRecord) -> None:
        """Replace the claimer's record (started, or answered).

        Raises:
            StoreError: The store could not be reached.
        """
        ...

    async def release(self, key: str) -> None:
        """Forget ``key``: its first request started nothing (a retry starts afresh).

        Raises:
            StoreError: The store could not be reached.
        """
        ...


class PerCaller:
    """Each caller's keys, oldest first, and which caller keeps the most, in O(1) each.

    Callers are kept by how many keys they hold (a count moves by one at a time,
    so the most is found without a scan); of callers holding equally many, the
    first to reach that count goes first.
    """

    def __init__(self) -> None:
        self._keys: dict[str, OrderedDict[str, None]] = {}
        self._by_count: dict[int, dict[str, None]] = {}
        self._top = 0

    def add(self, caller: str, key: str) -> None:
        """Count ``key`` as ``caller``'s newest (a key it holds already stays in its place)."""
        keys = self._keys.setdefault(caller, OrderedDict())
        if key not in keys:
            keys[key] = None
            self._move(caller, len(keys) - 1, len(keys))

    def discard(self, caller: str, key: str) -> None:
        """Stop counting ``key`` (no error if it is not counted)."""
        keys = self._keys.get(caller)
        if keys is None or key not in keys:
            return
        del keys[key]
        if not keys:
            del self._keys[caller]
        self._move(caller, len(keys) + 1, len(keys))

    def greediest_oldest(self) -> str:
        """The oldest key of the caller holding the most (there must be one)."""
        caller = next(iter(self._by_count[self._top]))
        return next(iter(self._keys[caller]))

    def _move(self, caller: str, old: int, new: int) -> None:
        if old:
            bucket = self._by_count[old]
            del bucket[caller]
            if not bucket:
                del self._by_count[old]
        if new:
            self._by_count.setdefault(new, {})[caller] = None
        self._top = max(self._top, new)
        while self._top and self._top not in self._by_count:
            self._top -= 1


_Kept = tuple[str, str, int, bytes, float, bool, str, str, int, float]
"""A ``KeyRecord``'s fields, in order."""
_ANSWER: Final = 3
_AT: Final = 4
_CALLER: Final = 6


class MemorySentKeys:
    """``SentKeys`` of one instance (see the module docstring).

    Its operations never wait (``immediate``).

    Args:
        window: Seconds a record is kept after it was claimed.
        most: Most records kept (past it the oldest of the caller keeping the most go).
        clock: Wall clock (seconds since the epoch).
        most_bytes: Most bytes of answers kept (past it the oldest answer of the
            caller keeping the most bytes goes).
    """

    def __init__(
        self,
        window: float,
        most: int,
        clock: Callable[[], float] = time.time,
        most_bytes: int = ANSWERS_KEPT_BYTES,
    ) -> None:
        self._window, self._most, self._clock = window, most, clock
        self._most_bytes = most_bytes
        self._records: OrderedDict[str, _Kept] = OrderedDict()
        """Records, oldest claim first (for the window), as plain tuples: the collector
        stops tracking a tuple of strings and numbers, so the records kept cost its full
        passes nothing."""
        self._by_caller = PerCaller()
        """Each caller's keys, oldest claim first (for ``most``)."""
        self._answers: dict[str, OrderedDict[str, None]] = {}
        """Each caller's keys whose record keeps an answer, oldest answer first."""
        self._caller_bytes: Counter[str] = Counter()
        """Bytes of the answers each caller keeps."""
        self._bytes = 0
        """Bytes of the answers kept."""

    immediate = True
    """See ``SentKeys.immediate``."""

    def __len__(self) -> int:
        return len(self._records)

    async def claim(
        self, key: str, record: KeyRecord, replacing: KeyRecord | None = None
    ) -> KeyRecord | None:
        """See ``SentKeys.claim``."""
        now = self._clock()
        self._expire(now)
        kept = self._records.get(key)
        found = KeyRecord(*kept) if kept is not None else None
        abandoned = found is not None and found.abandoned(now) and not found.task_id
        if found is not None and not abandoned and found != replacing:
            return found
        self._pop(key)
        self._add(key, record.stamped(now), record.caller)
        self._bound()
        return None

    async def settle(self, key: str, record: KeyRecord) -> None:
        """See ``SentKeys.settle``."""
        found = self._records.get(key)
        if found is not None:
            # (in place: its claim's time and caller, where its claim was)
            self._unkeep_answer(key, found)
            self._add(key, record.stamped(found[_AT]), found[_CALLER])
            self._bound()

    async def release(self, key: str) -> None:
        """See ``SentKeys.release``."""
        self._pop(key)

    def _add(self, key: str, record: KeyRecord, caller: str) -> None:
        """Keep ``record`` (a key already kept stays in its place)."""
        self._records[key] = (
            record.digest,
            record.task_id,
            record.after,
            record.answer,
            record.at,
            record.dropped,
            caller,
            record.asked,
            record.seen,
            record.until,
        )
        self._by_caller.add(caller, key)
        if record.answer:
            self._answers.setdefault(caller, OrderedDict())[key] = None
            size = len(record.answer)
            self._caller_bytes[caller] += size
            self._bytes += size

    def _pop(self, key: str) -> None:
        found = self._records.pop(key, None)
        if found is None:
            return
        self._unkeep_answer(key, found)
        self._by_caller.discard(found[_CALLER], key)

    def _unkeep_answer(self, key: str, found: _Kept) -> None:
        if not found[_ANSWER]:
            return
        caller, size = found[_CALLER], len(found[_ANSWER])
        answers = self._answers[caller]
        del answers[key]
        self._bytes -= size
        self._caller_bytes[caller] -= size
        if not answers:
            del self._answers[caller], self._caller_bytes[caller]

    def _bound(self) -> None:
        """Over a bound, the oldest of the caller keeping the most goes (see the module).

        Past ``most`` records that is O(1) (``PerCaller``); past the answers'
        bytes, O(callers keeping answers) (byte counts move by any amount).
        """
        answers = self._answers
        while len(self._records) > self._most:
            self._pop(self._by_caller.greediest_oldest())
        while self._bytes > self._most_bytes:
            greediest = max(answers, key=self._caller_bytes.__getitem__)
            self._pop(next(iter(answers[greediest])))

    def _expire(self, now: float) -> None:
        records = self._records
        while records:
            key, oldest = next(iter(records.items()))
            if now - oldest[_AT] < self._window:
                return
            self._pop(key)

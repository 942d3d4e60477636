"""The listing index on JetStream: ``ListTasks`` reads what a page touches, not the whole bucket.

Stream ``A2A_INDEX`` (subjects ``a2a.idx.>``, max age ``task_ttl``, as the
snapshots) holds two entries per snapshot write of a task, published before
the snapshot's compare-and-set:

* ``a2a.idx.s.<scope hash>.<state>``: for a listing of the scope, or of the
  scope and a state;
* ``a2a.idx.c.<scope hash>.<context hash>.<state>``: for a listing of one
  context (and a state).

A third, ``a2a.idx.f.<scope hash>``, only for a task whose status timestamp
is later than the writer's clock by more than ``CLOCK_SKEW`` (an agent that
sets its own): see below. And ``a2a.idx.o.<owner hash>`` for an unfinished
task an instance runs: published when the snapshot's owner changes (its
first snapshot, a claim), kept by the owner's later snapshots of it, dropped
when it ends or is released. The lease's sweep and an instance's start read
those of the owners they look for (``owners``), not every snapshot.

Hashes are the first 32 hex digits of SHA-256 (a subject token whatever the
scope or context id holds). An entry's payload is ``1`` (its format), the
task id, its status timestamp, the writer's clock when it wrote (both in
nanoseconds), the task's state, its context's hash and the snapshot's
owner, each on a line; a reader refuses another format with
``UnknownFormatError``.

The snapshot then written says which entries are its own: header
``A2a-Index: s=<position>,c=<position>[,f=<position>][,o=<position>]``
(the entries' stream sequences).
An entry whose task's snapshot does not name it is stale (the snapshot was
written again since, or its write failed): listings skip it. After a write
succeeds, the writer deletes the entries of the snapshot it replaced; one
that dies in between leaves stale entries, which a listing that meets them
deletes once they are older than ``STALE_AFTER`` (a write in flight is not
stale), and which expire with the stream's max age anyway.

Newest first is the stream's order backwards. JetStream reads forwards
only, but a direct get answers how many entries matching a filter come at or
after a position (``Nats-Num-Pending``), at a cost that grows with the
distance to the stream's end, not with what it holds before: a page is found
by galloping down from its token until enough entries lie between, then read
forwards in batches. A listing by status timestamp stops at the first entry
written ``3 * CLOCK_SKEW`` before the asked time (each instance's clock within
``CLOCK_SKEW`` of the true time: an entry further down was written no later
by more than twice that, and its status is no later than its write by more
than ``CLOCK_SKEW``), and adds the scope's ``f`` entries, whose status is.

The index is trusted only when the whole cluster keeps it: every live
instance's heartbeat says ``index`` among its features (``formats``), and the
marker ``a2a.idx.meta.built`` says every snapshot written before was indexed.
Until then ``ListTasks`` and the sweep read every snapshot, as versions
before the index did. The marker is removed by any instance that hears an
instance that does not keep the index (an older version in a rolling
update), and written again by the smallest live instance once it has
indexed the snapshots left without entries (``Listing.keep_index``),
which renews it every minute (one message: ``Nats-Rollup``). An instance
starting, before it has heard the others, trusts a marker renewed within
ten minutes; an older one (the whole cluster was down, or an older version
ran alone) is rebuilt.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import json
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from ..errors import UnknownFormatError
from ..model.names import TASK_PREFIX
from .conn import INDEX_STREAM, INDEX_SUBJECT
from .requests import JetStreamRequests, pending
from .retry import Retry

MARKER = f"{INDEX_SUBJECT}.meta.built"
HEADER = "A2a-Index"
"""The snapshot's header naming its entries."""
FORMAT = b"1"
FEATURE = "index"
"""What a heartbeat says of an instance that keeps the index."""
CLOCK_SKEW = 60 * 1_000_000_000
"""Nanoseconds instances' clocks may differ by (a listing by status timestamp reads this far)."""
STALE_AFTER = 600 * 1_000_000_000
"""Nanoseconds after which an entry its snapshot does not name is deleted by a listing."""
BATCH = 256
"""Entries one direct get returns at most."""
DROP_BATCH = 64
"""Entries deleted at once in the background."""
DROP_QUEUE = 100_000
"""Most entries waiting to be deleted in the background."""
MARKER_RENEW = 60.0
"""Seconds between two renewals of a marker by the smallest live instance."""
SEQ_HEADER = "Nats-Sequence"
SUBJECT_HEADER = "Nats-Subject"


def digest(text: str) -> str:
    """A subject token for ``text`` (see the module docstring)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def subjects(scope: str, context_id: str, state: int) -> tuple[str, str]:
    """The subjects of a task's two entries."""
    s = digest(scope)
    return (
        f"{INDEX_SUBJECT}.s.{s}.{state}",
        f"{INDEX_SUBJECT}.c.{s}.{digest(context_id)}.{state}",
    )


def ahead(scope: str) -> str:
    """The subject of a scope's entries whose status is later than their write."""
    return f"{INDEX_SUBJECT}.f.{digest(scope)}"


def owned_by(owner: str) -> str:
    """The subject of the entries of an instance's unfinished tasks."""
    return f"{INDEX_SUBJECT}.o.{digest(owner)}"


def listing(scope: str, context_id: str, state: int) -> tuple[str, str]:
    """The filter subject of a listing and which of a snapshot's entries it reads."""
    s, st = digest(scope), str(state) if state else "*"
    if context_id:
        return f"{INDEX_SUBJECT}.c.{s}.{digest(context_id)}.{st}", "c"
    return f"{INDEX_SUBJECT}.s.{s}.{st}", "s"


KINDS = ("s", "c", "f", "o", "ot")
"""The keys of an ``A2a-Index`` header."""


@dataclass(frozen=True, slots=True)
class Positions:
    """Where a snapshot's entries are (stream sequences; 0: none of that kind)."""

    s: int
    c: int
    f: int = 0
    o: int = 0
    ot: int = 0
    """When the ``o`` entry was published (seconds since the epoch)."""

    def of(self, kind: str) -> int:
        """The position of the entry of ``kind`` (``s``, ``c``, ``f`` or ``o``)."""
        return int(getattr(self, kind))

    def header(self) -> str:
        """The ``A2a-Index`` header value naming them, ``s=…,c=…[,f=…][,o=…,ot=…]``."""
        return ",".join(f"{k}={getattr(self, k)}" for k in KINDS if getattr(self, k))

    def all(self) -> tuple[int, ...]:
        """Every position named."""
        return tuple(p for p in (self.s, self.c, self.f, self.o) if p)

    @classmethod
    def read(cls, value: str | None) -> Positions | None:
        """The positions a header names (None: absent, or not a header this version wrote)."""
        if not value:
            return None
        found: dict[str, int] = {}
        for part in value.split(","):
            kind, _, pos = part.partition("=")
            if kind not in KINDS or not pos.isdigit():
                return None
            found[kind] = int(pos)
        if "s" not in found or "c" not in found:
            return None
        return cls(**found)


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One entry: a task at one of its snapshot writes."""

    pos: int
    task_id: str
    status_ns: int
    written_ns: int
    state: int
    context: str
    """Its context's hash."""
    owner: str
    """The instance the snapshot says runs it ("" for none)."""

    @classmethod
    def decode(cls, msg: Msg) -> IndexEntry:
        """Parse an entry read directly.

        Raises:
            UnknownFormatError: It is in a format this version does not read.
        """
        parts = msg.data.split(b"\n")
        if len(parts) != 7 or parts[0] != FORMAT:
            raise UnknownFormatError(
                "an entry of the task index", parts[0][:16].decode("ascii", "replace")
            )
        pos = int((msg.headers or {})[SEQ_HEADER])
        return cls(
            pos,
            parts[1].decode(),
            int(parts[2]),
            int(parts[3]),
            int(parts[4]),
            parts[5].decode(),
            parts[6].decode(),
        )


class _Positioned(Protocol):
    @property
    def pos(self) -> int: ...


_E = TypeVar("_E", bound=_Positioned)


@dataclass(frozen=True, slots=True)
class Marker:
    """The index's marker: every snapshot written up to ``kv_seq`` has its entries."""

    at: int
    """When it was last written (nanoseconds since the epoch, its writer's clock)."""
    kv_seq: int
    """The snapshot bucket's last sequence then (what was written after it is checked by
    an instance that starts: a version before the index may have run alone since)."""


class TaskIndex:
    """Writes and reads the ``A2A_INDEX`` stream.

    Args:
        requests: Lean requests on the connection.
        retry: How long an operation retries through a NATS outage.
    """

    def __init__(self, requests: JetStreamRequests, retry: Retry) -> None:
        self._requests = requests
        self._retry = retry
        self._to_drop: deque[int] = deque()
        self._dropping: asyncio.Task[None] | None = None

    def drop_later(self, positions: Sequence[int]) -> None:
        """Delete entries in the background (nothing waits for it; see ``drop``).

        At most ``DROP_QUEUE`` wait: past that the oldest are given up (stale
        entries: skipped by listings, and expired with the stream's max age).
        """
        self._to_drop.extend(p for p in positions if p)
        while len(self._to_drop) > DROP_QUEUE:
            self._to_drop.popleft()
        if self._to_drop and (self._dropping is None or self._dropping.done()):
            self._dropping = asyncio.create_task(self._drain(), name=f"{TASK_PREFIX}:index-drop")

    async def _drain(self) -> None:
        while self._to_drop:  # (a batch at a time, in one coroutine)
            batch = [self._to_drop.popleft() for _ in range(min(DROP_BATCH, len(self._to_drop)))]
            await self.drop(batch)

    async def close(self) -> None:
        """Finish the deletes asked for (bounded by a request's timeout), then stop."""
        if self._dropping is not None:
            await asyncio.wait([self._dropping], timeout=self._retry.timeout)
            self._dropping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dropping
            self._dropping = None

    async def add(
        self,
        scope: str,
        context_id: str,
        state: int,
        task_id: str,
        status_ns: int,
        owner: str = "",
        owned: int | None = None,
        owned_at: int = 0,
    ) -> Positions:
        """Publish a snapshot write's entries; return their positions.

        Args:
            scope: Whose task it is.
            context_id: Its context.
            state: Its state.
            task_id: The task.
            status_ns: Its status timestamp.
            owner: The instance the snapshot says runs it.
            owned: Its entry among ``owner``'s unfinished tasks: None for none (a
                final task, or nobody's), 0 to publish one, else the position of
                the one its last snapshot of the same owner has (kept).
            owned_at: When that one was published (seconds since the epoch).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        now = time.time_ns()
        body = b"\n".join(
            (
                FORMAT,
                task_id.encode(),
                str(status_ns).encode(),
                str(now).encode(),
                str(state).encode(),
                digest(context_id).encode(),
                owner.encode(),
            )
        )
        targets: list[str] = list(subjects(scope, context_id, state))
        ahead_of_write = status_ns > now + CLOCK_SKEW
        if ahead_of_write:
            targets.append(ahead(scope))
        if owned == 0:
            targets.append(owned_by(owner))
        found = await self._retry(
            lambda: self._requests.publish_many([(t, body) for t in targets], self._retry.timeout),
            f"index task {task_id}",
        )
        if owned == 0:
            return Positions(
                found[0], found[1], found[2] if ahead_of_write else 0, found[-1], now // 10**9
            )
        return Positions(
            found[0], found[1], found[2] if ahead_of_write else 0, owned or 0, owned_at
        )

    async def owners(self) -> dict[str, str]:
        """Every instance that has entries of unfinished tasks, and the subject of its entries.

        Costs one read per owner (JetStream lists the subjects), not what the
        stream holds.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        return await self.heads("o", lambda msg: IndexEntry.decode(msg).owner)

    async def heads(
        self, kind: str, name: Callable[[Msg], str], skip: AbstractSet[str] = frozenset()
    ) -> dict[str, str]:
        """Per subject under ``a2a.idx.<kind>.>`` but ``skip``: whom its first entry names."""
        request = json.dumps({"subjects_filter": f"{INDEX_SUBJECT}.{kind}.>"}).encode()
        info = await self._retry(
            lambda: self._requests.api(
                f"$JS.API.STREAM.INFO.{INDEX_STREAM}", request, self._retry.timeout
            ),
            "list the task index's instances",
        )
        state = info.get("state")
        subjects = (state.get("subjects") or {}) if isinstance(state, dict) else {}
        found: dict[str, str] = {}
        for subject in subjects:
            if subject in skip:
                continue
            first = await self._get({"seq": 1, "next_by_subj": subject})
            if first:
                found[name(first[0])] = subject
        return found

    async def publish(self, subject: str, body: bytes, headers: dict[str, str], what: str) -> None:
        """Publish one message to the index (``what`` names it in errors).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        await self._retry(
            lambda: self._requests.publish(subject, body, headers, self._retry.timeout), what
        )

    async def publish_many(self, messages: Sequence[tuple[str, bytes]], what: str) -> None:
        """Publish many messages to the index in one go.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if messages:
            await self._retry(
                lambda: self._requests.publish_many(messages, self._retry.timeout), what
            )

    async def all_of(self, subject: str) -> builtins.list[IndexEntry]:
        """Every entry on ``subject``, oldest first.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        return [entry async for batch in self.batches(subject) for entry in batch]

    def batches(self, subject: str) -> AsyncGenerator[builtins.list[IndexEntry]]:
        """The entries on ``subject``, oldest first, ``BATCH`` at a time (one read each).

        Entries written while it reads may or may not be included.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        return self.pages(subject, IndexEntry.decode)

    async def pages(
        self, subject: str, decode: Callable[[Msg], _E]
    ) -> AsyncGenerator[builtins.list[_E]]:
        """The entries on ``subject`` as ``decode`` makes them, oldest first, ``BATCH`` at a time.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        pos = 1
        while True:
            msgs = await self._get({"seq": pos, "next_by_subj": subject, "batch": BATCH})
            entries = [decode(msg) for msg in msgs]
            if entries:
                yield entries
            if len(msgs) < BATCH:
                return
            pos = entries[-1].pos + 1

    async def drop(self, positions: Sequence[int]) -> None:
        """Delete entries, all at once (best effort: one left behind is stale, and expires)."""
        subject = f"$JS.API.STREAM.MSG.DELETE.{INDEX_STREAM}"
        requests = [
            (subject, json.dumps({"seq": p, "no_erase": True}).encode()) for p in positions if p
        ]
        # One left behind is stale: skipped by listings, deleted by one later, or expired.
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            await self._requests.request_many(requests, self._retry.timeout)

    async def count_from(self, subject: str, start: int) -> int:
        """How many entries on ``subject`` (a filter) are at position ``start`` or after.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        msgs = await self._get({"seq": max(start, 1), "next_by_subj": subject, "batch": 1})
        if not msgs:
            return 0
        return 1 + pending(msgs[0])

    async def below(
        self, subject: str, before: int | None, want: int
    ) -> tuple[list[IndexEntry], bool]:
        """Up to ``want`` entries on ``subject`` before position ``before``, newest first.

        Counts move while it reads (entries are written and deleted meanwhile), so
        each step counts both ends afresh, and a range found empty is followed by
        the one below it: it never answers none while some lie below.

        Returns:
            The entries, and whether any other comes before the last of them.

        Raises:
            StoreUnavailableError: NATS did not answer.
            UnknownFormatError: An entry in a format this version does not read.
        """
        top = before if before is not None else await self._end(subject)
        found: list[IndexEntry] = []  # (ascending: each range read is put before the last)
        while len(found) < want and top > 1:
            missing = want - len(found)
            above, total = await asyncio.gather(
                self.count_from(subject, top), self.count_from(subject, 1)
            )
            if total - above <= 0:
                break
            lo = 1 if total - above <= 2 * missing else await self._start(subject, top, missing)
            found = await self._read(subject, lo, top) + found
            top = lo
        found = found[-want:] if want else []
        found.reverse()
        if not found:
            return [], False
        below_last = await self.count_from(subject, 1) - await self.count_from(
            subject, found[-1].pos
        )
        return found, below_last > 0

    async def _read(self, subject: str, lo: int, top: int) -> list[IndexEntry]:
        """The entries on ``subject`` from position ``lo`` to before ``top``, oldest first."""
        found: list[IndexEntry] = []
        pos = lo
        while pos < top:
            msgs = await self._get({"seq": pos, "next_by_subj": subject, "batch": BATCH})
            entries = [IndexEntry.decode(msg) for msg in msgs]
            found.extend(e for e in entries if e.pos < top)
            if len(msgs) < BATCH or entries[-1].pos >= top:
                break
            pos = entries[-1].pos + 1
        return found

    async def _end(self, subject: str) -> int:
        """One past the position of the last entry on ``subject``."""
        msgs = await self._get({"last_by_subj": subject})
        return int((msgs[0].headers or {})[SEQ_HEADER]) + 1 if msgs else 1

    async def _between(self, subject: str, lo: int, top: int) -> int:
        """How many entries on ``subject`` lie from ``lo`` to before ``top``, counted together."""
        at_lo, at_top = await asyncio.gather(
            self.count_from(subject, lo), self.count_from(subject, top)
        )
        return at_lo - at_top

    async def _start(self, subject: str, top: int, want: int) -> int:
        """A position from which between ``want`` and about ``4 * want`` entries lie before ``top``.

        Gallops down from ``top`` (steps of x4) until at least ``want`` lie between,
        then halves the span while more than four times ``want`` do.
        """
        span = 4 * want
        hi, lo = top, max(top - span, 1)
        while True:
            between = await self._between(subject, lo, top)
            if between >= want or lo == 1:
                break
            hi, span = lo, span * 4
            lo = max(top - span, 1)
        # Fewer than ``want`` lie from ``hi``; at least that many (or all) from ``lo``.
        while between > 4 * want and hi - lo > 1:
            mid = (lo + hi) // 2
            at_mid = await self._between(subject, mid, top)
            if at_mid >= want:
                lo, between = mid, at_mid
            else:
                hi = mid
        return lo

    async def _get(self, request: dict[str, object]) -> list[Msg]:
        return await self._retry(
            lambda: self._requests.direct_get(INDEX_STREAM, request, self._retry.timeout),
            "read the task index",
        )

    async def built(self) -> Marker | None:
        """The marker (see ``Marker``), or None if absent.

        Raises:
            StoreUnavailableError: NATS did not answer.
            UnknownFormatError: A marker in a format this version does not read.
        """
        found = await self.marker(MARKER, "the task index's marker", ("at", "kv_seq"))
        return None if found is None else Marker(*found)

    async def marker(self, subject: str, what: str, keys: tuple[str, ...]) -> list[int] | None:
        """The numbers ``keys`` of the marker on ``subject`` (format 1), or None if absent.

        Raises:
            StoreUnavailableError: NATS did not answer.
            UnknownFormatError: A marker in another format, or not one at all.
        """
        msgs = await self._get({"last_by_subj": subject})
        if not msgs:
            return None
        try:
            found = json.loads(msgs[0].data)
            fmt, numbers = found["format"], [int(found[key]) for key in keys]
        except (ValueError, TypeError, KeyError):
            raise UnknownFormatError(what, repr(msgs[0].data[:40])) from None
        if fmt != 1:
            raise UnknownFormatError(what, str(fmt))
        return numbers

    async def mark_built(self, by: str, kv_seq: int) -> None:
        """Write (or renew) the marker: it replaces the one before (see the module docstring).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        body = json.dumps({"format": 1, "by": by, "at": time.time_ns(), "kv_seq": kv_seq}).encode()
        await self._retry(
            lambda: self._requests.publish(
                MARKER, body, {"Nats-Rollup": "sub"}, self._retry.timeout
            ),
            "mark the task index built",
        )

    async def unmark(self) -> None:
        """Remove the marker: an instance that does not keep the index is in the cluster.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        await self.purge(MARKER, "remove the task index's marker")

    async def purge(self, subject: str, what: str) -> None:
        """Remove every message on ``subject`` (``what`` names it in errors).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        request = json.dumps({"filter": subject}).encode()
        await self._retry(
            lambda: self._requests.api(
                f"$JS.API.STREAM.PURGE.{INDEX_STREAM}", request, self._retry.timeout
            ),
            what,
        )

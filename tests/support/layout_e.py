"""Layout E on JetStream, the spike's reader and writer (issue 41; docs/decisions/0001).

One stream holds every change of every task, one message each, on the subject

    <p>.t.<task id>.<owner>.<scope hash>.<context hash>.<kind>     (id-first)
    <p>.t.<scope hash>.<task id>.<owner>.<context hash>.<kind>     (scope-first)

``kind`` is ``s`` (a change with the task's snapshot), ``e`` (events only) or ``f``
(the final change and snapshot). Each change is one publish, its compare-and-set
over all of the task's subjects (``Nats-Expected-Last-Subject-Sequence`` and
``...-Subject: <the task's filter>``). tests/cluster/test_jetstream_layout.py asserts
these helpers on a real nats-server; ``bench.nats_layout`` measures them. Nothing of
the server's code is used.

The listing index nats-server keeps by itself (``sourced``): a second stream
sources the ``s`` and ``f`` messages, its subject transforms mapping each to one
subject per task, at most one message each (``max_msgs_per_subject: 1``):

    <p>.cur.<scope hash>.<context hash>.<task id>

Each entry is the task's newest ``s`` or ``f``, its payload and headers, with
``Nats-Stream-Source: <stream> <seq> <filters> <transforms> <original subject> <id>``.

The literal index (spike 4, ``Layout.literal``): with ``Layout.states`` every subject
of E ends in one more token, the task's state after the change; a stream sources
the ``s`` and ``f`` three times (one source each) onto few literal subjects, no
per-subject limit:

    <p>.ix.s.<scope hash>.<state>      a scope's listing (``*``: every state)
    <p>.ix.c.<scope hash>.<context>    a context's
    <p>.ix.o.<owner>                   an owner's (sweeps)

Every ``s`` and ``f`` adds an entry; a task's older ones are stale, never deleted
(they go with the index's max age or copied ``Nats-TTL``s). A reader keeps an entry
only if its origin (``Nats-Stream-Source``) is its task's last ``s`` or ``f`` in E
(``Reader.listing``, ``Reader.owner_sweep``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import StreamConfig, StreamSource, SubjectTransform

TIMEOUT = 10.0
"""Seconds one request may take."""
BATCH = 256
"""Messages one batched direct get returns at most."""
MULTI_LAST_TASKS = 200
"""Tasks whose last messages one ``multi_last`` asks for (the server answers at most 1,024)."""
MULTI_LAST_SNAPSHOTS = 100
"""Tasks whose last ``s`` and ``f`` one ``multi_last`` asks for (a subject per owner and state)."""
PENDING = "Nats-Num-Pending"
SEQUENCE = "Nats-Sequence"
SUBJECT = "Nats-Subject"
SOURCE = "Nats-Stream-Source"
ORDERS = ("id-first", "scope-first")


def digest(text: str, size: int = 32) -> str:
    """A subject token for ``text``: the first ``size`` hex digits of its SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:size]


@dataclass(frozen=True)
class Where:
    """The tokens of one message of a task."""

    task: str
    owner: str
    scope: str
    context: str
    kind: str
    state: str = ""
    """The task's state after the change (a subject token only if ``Layout.states``)."""


@dataclass(frozen=True)
class Layout:
    """Subjects of layout E under ``prefix``, in one of two token orders (see the module)."""

    prefix: str
    order: str = "id-first"
    fwc: bool = False
    """Whether a task's filter ends in ``>`` (else ``*`` tokens)."""
    states: bool = False
    """Whether a subject ends in one more token, the task's state after the change."""

    @property
    def _tail(self) -> str:
        return ".*" if self.states else ""

    def subject(self, where: Where) -> str:
        """The subject of one change."""
        w, p = where, self.prefix
        state = f".{w.state}" if self.states else ""
        if self.order == "scope-first":
            return f"{p}.t.{w.scope}.{w.task}.{w.owner}.{w.context}.{w.kind}{state}"
        return f"{p}.t.{w.task}.{w.owner}.{w.scope}.{w.context}.{w.kind}{state}"

    def parse(self, subject: str) -> Where:
        """The tokens of a subject of this layout."""
        tokens = subject.split(".")[-6:] if self.states else [*subject.split(".")[-5:], ""]
        if self.order == "scope-first":
            scope, task, owner, context, kind, state = tokens
        else:
            task, owner, scope, context, kind, state = tokens
        return Where(task, owner, scope, context, kind, state)

    def task(self, task: str, scope: str) -> str:
        """Every subject of one task (its compare-and-set and reads by id).

        Each remaining token a ``*`` (``fwc``: one ``>``, the same subjects; the
        benchmark's writes to old tasks measure both).
        """
        if self.order == "scope-first":
            head, rest = f"{self.prefix}.t.{scope}.{task}", ".*.*.*"
        else:
            head, rest = f"{self.prefix}.t.{task}", ".*.*.*.*"
        return f"{head}.>" if self.fwc else head + rest + self._tail

    def snapshots(self, task: str, scope: str, kind: str = "s") -> str:
        """The task's ``kind`` messages, whoever wrote them."""
        if self.order == "scope-first":
            return f"{self.prefix}.t.{scope}.{task}.*.*.{kind}{self._tail}"
        return f"{self.prefix}.t.{task}.*.*.*.{kind}{self._tail}"

    def scope(self, scope: str) -> str:
        """Every message of the scope's tasks."""
        if self.order == "scope-first":
            return f"{self.prefix}.t.{scope}.>"
        return f"{self.prefix}.t.*.*.{scope}.>"

    def context(self, scope: str, context: str) -> str:
        """Every message of the tasks of one context of the scope."""
        if self.order == "scope-first":
            return f"{self.prefix}.t.{scope}.*.*.{context}.*{self._tail}"
        return f"{self.prefix}.t.*.*.{scope}.{context}.*{self._tail}"

    def owner(self, owner: str) -> str:
        """Every message an owner wrote."""
        if self.order == "scope-first":
            return f"{self.prefix}.t.*.*.{owner}.>"
        return f"{self.prefix}.t.*.{owner}.>"

    def current(self, scope: str, context: str, task: str) -> str:
        """A task's subject in the sourced index."""
        return f"{self.prefix}.cur.{scope}.{context}.{task}"

    def current_scope(self, scope: str) -> str:
        """Every entry of one scope in the sourced index."""
        return f"{self.prefix}.cur.{scope}.>"

    def current_context(self, scope: str, context: str) -> str:
        """Every entry of one context of the scope in the sourced index."""
        return f"{self.prefix}.cur.{scope}.{context}.*"

    def transforms(self) -> list[SubjectTransform]:
        """The sourced index's transforms: each ``s`` and ``f`` to its task's one subject.

        A ``{{wildcard(n)}}`` is the n-th ``*`` of the source filter; the owner's
        is left out, so a claim lands on the same subject.
        """
        if self.order == "scope-first":
            scope, task, context = 1, 2, 4
        else:
            task, scope, context = 1, 3, 4
        dest = (
            f"{self.prefix}.cur.{{{{wildcard({scope})}}}}.{{{{wildcard({context})}}}}"
            f".{{{{wildcard({task})}}}}"
        )
        return [SubjectTransform(src=self.kinds(k), dest=dest) for k in "sf"]

    def kinds(self, kind: str) -> str:
        """Every message of one kind (a source's filter; its ``*`` are the wildcards)."""
        return f"{self.prefix}.t.*.*.*.*.{kind}{self._tail}"

    def sourced(
        self, name: str, origin: str, start: int = 0, per_subject: int = 1, **options: Any
    ) -> StreamConfig:
        """The config of a stream ``name`` keeping one entry per task of ``origin``.

        ``start``: the origin's sequence to source from (0: its first); ``per_subject``:
        the entries kept per task (spike 3: 1; more only to measure what the limit costs).
        """
        source = StreamSource(
            name=origin, subject_transforms=self.transforms(), opt_start_seq=start or None
        )
        return StreamConfig(
            name=name,
            sources=[source],
            max_msgs_per_subject=per_subject,
            **{"allow_direct": True, **options},
        )

    def listing(self, scope: str, state: str = "*") -> str:
        """A scope's entries in the literal index, of one state (``*``: of every state)."""
        return f"{self.prefix}.ix.s.{scope}.{state}"

    def listing_context(self, scope: str, context: str) -> str:
        """A context's entries in the literal index."""
        return f"{self.prefix}.ix.c.{scope}.{context}"

    def listing_owner(self, owner: str) -> str:
        """An owner's entries in the literal index (its ``s`` and ``f``)."""
        return f"{self.prefix}.ix.o.{owner}"

    def literal_sources(
        self, origin: str, parts: str = "sco", start: int = 0
    ) -> list[StreamSource]:
        """The literal index's sources: ``s`` (scope, state), ``c`` (context), ``o`` (owner).

        One source of ``origin`` per part, each mapping the ``s`` and ``f``
        messages (their filters, ``kinds``) to the part's subject: the transforms
        of one source may not share a filter. Needs ``states``.
        """
        if not self.states:
            raise ValueError("the literal index needs the state token")
        if self.order == "scope-first":
            scope, _task, owner, context, state = 1, 2, 3, 4, 5
        else:
            _task, owner, scope, context, state = 1, 2, 3, 4, 5
        p = self.prefix
        dests = {
            "s": f"{p}.ix.s.{{{{wildcard({scope})}}}}.{{{{wildcard({state})}}}}",
            "c": f"{p}.ix.c.{{{{wildcard({scope})}}}}.{{{{wildcard({context})}}}}",
            "o": f"{p}.ix.o.{{{{wildcard({owner})}}}}",
        }
        return [
            StreamSource(
                name=origin,
                subject_transforms=[
                    SubjectTransform(src=self.kinds(k), dest=dests[part]) for k in "sf"
                ],
                opt_start_seq=start or None,
            )
            for part in parts
        ]

    def literal(
        self, name: str, origin: str, parts: str = "sco", start: int = 0, **options: Any
    ) -> StreamConfig:
        """The config of a stream ``name``: the literal index of ``origin`` (no per-subject limit).

        Every ``s`` and ``f`` adds an entry to each part's subject; older entries
        of its task stay (stale) until the index's max age or their copied ``Nats-TTL``.
        """
        return StreamConfig(
            name=name,
            sources=self.literal_sources(origin, parts, start),
            **{"allow_direct": True, **options},
        )

    def headers(
        self, where: Where, version: int, *, msg_id: str | None = None, ttl: str | None = None
    ) -> dict[str, str]:
        """A change's headers: the compare-and-set over the task's subjects, a retry key, a TTL."""
        headers = {
            "Nats-Expected-Last-Subject-Sequence": str(version),
            "Nats-Expected-Last-Subject-Sequence-Subject": self.task(where.task, where.scope),
        }
        if msg_id is not None:
            headers["Nats-Msg-Id"] = msg_id
        if ttl is not None:
            headers["Nats-TTL"] = ttl
        return headers


async def change(
    nc: NATS,
    layout: Layout,
    where: Where,
    version: int,
    payload: bytes = b"",
    *,
    msg_id: str | None = None,
    ttl: str | None = None,
) -> dict[str, Any]:
    """Publish one change at ``version`` (0: create); JetStream's answer (a PubAck or an error)."""
    headers = layout.headers(where, version, msg_id=msg_id, ttl=ttl)
    reply = await nc.request(layout.subject(where), payload, TIMEOUT, headers=headers)
    answer: dict[str, Any] = json.loads(reply.data)
    return answer


@dataclass
class Entry:
    """A task as a listing or a sweep sees it: its last message there."""

    where: Where
    seq: int
    origin: int = 0
    """In the sourced index: the sequence of the message in the stream it came from."""


@dataclass(frozen=True)
class Source:
    """Where a sourced message came from (its ``Nats-Stream-Source`` header)."""

    stream: str
    seq: int
    subject: str
    """Its subject there (before the transform)."""


def source(msg: Msg) -> Source | None:
    """The origin of a message read from a sourcing stream (None: not sourced).

    The header is ``<stream> <seq> <filters> <transforms> <subject> [<id>]``
    (filters and transforms joined by form feeds; server/stream.go, ``genSourceHeader``).
    """
    text = (msg.headers or {}).get(SOURCE)
    if text is None:
        return None
    fields = text.split(" ")
    return Source(fields[0], int(fields[1]), fields[4])


@dataclass
class Reader:
    """Direct gets on one stream of layout E, counting the requests they cost."""

    nc: NATS
    stream: str
    layout: Layout
    requests: int = 0
    _inbox: int = field(default=0, repr=False)

    async def get(self, request: dict[str, Any]) -> list[Msg]:
        """A direct get; its messages (none if nothing matched).

        Raises:
            AssertionError: Another status than found, not found and end of batch.
        """
        self.requests += 1
        subject = f"$JS.API.DIRECT.GET.{self.stream}"
        body = json.dumps(request).encode()
        if "batch" not in request and "multi_last" not in request:
            msg = await self.nc.request(subject, body, TIMEOUT)
            status = (msg.headers or {}).get("Status")
            if status == "404":
                return []
            if status is not None:
                raise AssertionError(f"{status} {(msg.headers or {}).get('Description')}")
            return [msg]
        found: list[Msg] = []
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def collect(msg: Msg) -> None:  # (a callback: 3-4 times cheaper than next_msg)
            status = (msg.headers or {}).get("Status")
            if done.done():
                return
            if status is None:
                found.append(msg)
            elif status == "204" or (status == "404" and not found):
                done.set_result(None)
            else:
                description = (msg.headers or {}).get("Description")
                done.set_exception(AssertionError(f"{status} {description}"))

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish(subject, body, inbox)
            async with asyncio.timeout(TIMEOUT):
                await done
            return found
        finally:
            await sub.unsubscribe()

    def entry(self, msg: Msg) -> Entry:
        """Where a message answered by a direct get was written, and its sequence.

        Of a sourced message: where it was written in the stream it came from
        (the owner and kind the index's subject leaves out) and its sequence there.
        """
        headers = msg.headers or {}
        origin = source(msg)
        if origin is not None:
            return Entry(self.layout.parse(origin.subject), int(headers[SEQUENCE]), origin.seq)
        return Entry(self.layout.parse(headers[SUBJECT]), int(headers[SEQUENCE]))

    async def task(self, task: str, scope: str) -> tuple[Msg | None, list[Msg], Msg | None]:
        """A task by id: its newest ``s``, the ``e`` after it, and its ``f`` if it ended.

        The newest ``s`` and the ``f`` together (last by subject, wildcards over
        owner and context), then, unless ended, a batch of the events on the
        literal subject of the snapshot's owner (a claim writes an ``s``). A batch
        on a wildcard would cost the whole stream: nats-server walks every block
        after the last match once the stream has more than 64 Ki subjects
        (``wcMaxSizeToCheck`` in server/filestore.go).
        """
        snaps, final = await asyncio.gather(
            self.get({"last_by_subj": self.layout.snapshots(task, scope)}),
            self.get({"last_by_subj": self.layout.snapshots(task, scope, "f")}),
        )
        if not snaps or final:
            return (snaps[0] if snaps else None), [], (final[0] if final else None)
        snap = self.entry(snaps[0])
        events = Where(task, snap.where.owner, snap.where.scope, snap.where.context, "e")
        request = {"seq": snap.seq + 1, "next_by_subj": self.layout.subject(events)}
        return snaps[0], await self.get({**request, "batch": BATCH}), None

    async def count_from(self, subject: str, start: int) -> int:
        """How many messages on ``subject`` (a filter) are at sequence ``start`` or after."""
        msgs = await self.get({"seq": max(start, 1), "next_by_subj": subject, "batch": 1})
        return 1 + int((msgs[0].headers or {}).get(PENDING, "0")) if msgs else 0

    async def end(self, subject: str) -> int:
        """One past the sequence of the last message on ``subject`` (1 if none)."""
        msgs = await self.get({"last_by_subj": subject})
        return int((msgs[0].headers or {})[SEQUENCE]) + 1 if msgs else 1

    async def start(self, subject: str, top: int, want: int) -> tuple[int, int]:
        """A sequence from which ``want`` messages (or all) on ``subject`` lie before ``top``.

        Gallops down from ``top`` in steps of x4, counting with ``Nats-Num-Pending``
        (what server/a2a_grpc_server/_internal/jetstream/index.py does). Returns the sequence
        and how many lie from it to before ``top``.
        """
        at_top = await self.count_from(subject, top)
        span = 4 * want
        while True:
            lo = max(top - span, 1)
            between = await self.count_from(subject, lo) - at_top
            if lo == 1 or between >= want:
                return lo, between
            span *= 4

    async def read(self, subject: str, lo: int, count: int) -> list[Msg]:
        """The ``count`` messages on ``subject`` from ``lo``, oldest first.

        Each batch asks for no more than remain: a batch that finds fewer walks
        the stream to its end.
        """
        found: list[Msg] = []
        pos = lo
        while len(found) < count:
            want = min(count - len(found), BATCH)
            msgs = await self.get({"seq": pos, "next_by_subj": subject, "batch": want})
            found.extend(msgs)
            if len(msgs) < want:
                break
            pos = int((msgs[-1].headers or {})[SEQUENCE]) + 1
        return found

    async def last_of(self, tasks: Sequence[tuple[str, str]]) -> dict[str, Entry]:
        """Each task's last message, by task id: ``multi_last`` of their filters, in chunks."""
        last: dict[str, Entry] = {}
        size = MULTI_LAST_SNAPSHOTS if self.layout.states else MULTI_LAST_TASKS
        for i in range(0, len(tasks), size):  # (a subject per state: fewer tasks at once)
            chunk = tasks[i : i + size]
            msgs = await self.get({"multi_last": [self.layout.task(t, s) for t, s in chunk]})
            for msg in msgs:
                entry = self.entry(msg)
                known = last.get(entry.where.task)
                if known is None or known.seq < entry.seq:
                    last[entry.where.task] = entry
        return last

    async def page(
        self, subject: str, before: int | None, want: int, per_task: int = 3
    ) -> list[Entry]:
        """Up to ``want`` tasks with messages on ``subject``, newest last change first.

        ``subject`` is a scope's or a context's filter; ``before`` the cursor (the
        sequence of the previous page's last entry; None: from the stream's end).
        Windows found by galloping are read forwards; each task counts once, at
        its last message in the windows read. From a cursor, a task may have
        newer messages above it (it was listed before, or changed since): the
        page keeps only tasks whose last message is the one read (``last_of``).
        Each window is sized for ``per_task`` messages per task missing.
        """
        top = before if before is not None else await self.end(subject)
        seen: set[str] = set()
        found: list[Entry] = []
        while len(found) < want and top > 1:
            lo, between = await self.start(subject, top, (want - len(found)) * per_task)
            window: dict[str, Entry] = {}
            for msg in await self.read(subject, lo, between):
                entry = self.entry(msg)
                if entry.seq < top and entry.where.task not in seen:
                    window[entry.where.task] = entry  # (oldest first: the last one stays)
            seen.update(window)
            fresh = sorted(window.values(), key=lambda e: -e.seq)
            if before is not None and fresh:
                current = await self.last_of([(e.where.task, e.where.scope) for e in fresh])
                fresh = [e for e in fresh if current[e.where.task].seq == e.seq]
            found.extend(fresh)
            top = lo
        return found[:want]

    async def subjects(self, subject: str) -> dict[str, int]:
        """The stream's subjects matching ``subject``, each with its count (stream info, paged)."""
        found: dict[str, int] = {}
        while True:
            self.requests += 1
            body = json.dumps({"subjects_filter": subject, "offset": len(found)}).encode()
            reply = await self.nc.request(f"$JS.API.STREAM.INFO.{self.stream}", body, TIMEOUT)
            info = json.loads(reply.data)
            if "error" in info:
                raise AssertionError(str(info["error"]))
            page = info["state"].get("subjects") or {}
            found.update(page)
            if not page or len(found) >= info.get("total", 0):
                return found

    async def sweep(self, owner: str) -> list[Entry]:
        """The owner's unfinished tasks: its tasks whose last message it wrote and is not ``f``.

        The owner's subjects (stream info, no message read) give its tasks; those
        without an ``f`` of its own are checked by their last message (``last_of``):
        another owner may have claimed or ended them since.
        """
        kinds: dict[tuple[str, str], set[str]] = {}
        for subject in await self.subjects(self.layout.owner(owner)):
            where = self.layout.parse(subject)
            kinds.setdefault((where.task, where.scope), set()).add(where.kind)
        open_ = [task for task, k in kinds.items() if "f" not in k]
        last = await self.last_of(open_)
        return sorted(
            (e for e in last.values() if e.where.owner == owner and e.where.kind != "f"),
            key=lambda e: e.seq,
        )

    async def latest(self, subject: str, before: int | None, want: int) -> list[Entry]:
        """The ``want`` newest entries on ``subject`` below ``before`` (None: all), newest first.

        A listing on an index of one entry per task (today's, or the sourced
        one): no task twice, none to check below a cursor (a task changed since
        has left it).
        """
        top = before if before is not None else await self.end(subject)
        lo, between = await self.start(subject, top, want)
        found = (await self.read(subject, lo, between))[-want:]
        return [self.entry(m) for m in reversed(found)]

    async def reached(self, subject: str = ">") -> int:
        """The origin's sequence this sourced index holds everything up to (0: nothing).

        Its last entry's ``Nats-Stream-Source`` (one direct get, ``>``: no subject
        walked). Sourcing stores in the origin's order, so every ``s`` and ``f``
        below it is in. (If that entry expired, this answers 0 until the next.)
        Of an index with several sources (the literal one), ``subject`` names
        one source's entries: each keeps its own order, not the others'.
        """
        msgs = await self.get({"last_by_subj": subject})
        origin = source(msgs[0]) if msgs else None
        return origin.seq if origin is not None else 0

    async def wait_for(self, seq: int, subject: str = ">") -> int:
        """Return once this sourced index holds the origin's message ``seq``; polls made.

        Read-your-writes for a writer: ``seq`` is its last ``s`` or ``f``'s ack.
        The caller bounds the wait. ``subject``: as in ``reached``.
        """
        polls = 1
        while await self.reached(subject) < seq:
            polls += 1
        return polls

    async def catch_up(self, origin: Reader) -> int:
        """Return once this sourced index holds every ``s`` and ``f`` ``origin`` had; polls made.

        Read-your-writes for any reader: the origin's last sequence (``>``, no
        walk), then, while the index is below it, the first ``s`` and ``f`` in
        between (``next_by_subj`` from the index's position, near the end). The
        caller bounds the wait.
        """
        target = await origin.end(">") - 1
        polls = 0
        while True:
            reached = await self.reached()
            polls += 1
            if reached >= target:
                return polls
            first = await asyncio.gather(
                *(
                    origin.get({"seq": reached + 1, "next_by_subj": t.src, "batch": 1})
                    for t in self.layout.transforms()
                )
            )
            due = [int((m[0].headers or {})[SEQUENCE]) for m in first if m]
            if not any(seq <= target for seq in due):
                return polls

    async def last_changes(self, tasks: Sequence[tuple[str, str]]) -> dict[str, int]:
        """Each task's last ``s`` or ``f`` (its sequence), by task id: ``multi_last``, in chunks.

        Two filters per task (its ``s``, its ``f``): the events are not read.
        """
        last: dict[str, int] = {}
        for i in range(0, len(tasks), MULTI_LAST_SNAPSHOTS):
            chunk = tasks[i : i + MULTI_LAST_SNAPSHOTS]
            filters = [self.layout.snapshots(t, s, k) for t, s in chunk for k in "sf"]
            for msg in await self.get({"multi_last": filters}):
                entry = self.entry(msg)
                last[entry.where.task] = max(last.get(entry.where.task, 0), entry.seq)
        return last

    async def listing(
        self, subject: str, before: int | None, want: int, origin: Reader, per_task: int = 3
    ) -> list[Entry]:
        """Up to ``want`` tasks on ``subject`` of the literal index, newest change first.

        ``subject`` is literal (a scope's state, a context) or a few of them (a
        scope's states); ``before`` the cursor (an entry's sequence here; None:
        from the end). Each window found by galloping is read forwards; a task
        counts at its newest entry in the windows read, and only if that entry is
        its task's last ``s`` or ``f`` in ``origin`` (one ``multi_last`` per
        window): the older entries of a task written since are stale, never
        deleted. Each window is sized for ``per_task`` entries per task missing.
        """
        top = before if before is not None else await self.end(subject)
        seen: set[str] = set()
        found: list[Entry] = []
        while len(found) < want and top > 1:
            lo, between = await self.tight(subject, top, (want - len(found)) * per_task)
            window: dict[str, Entry] = {}
            for msg in await self.read(subject, lo, between):
                entry = self.entry(msg)
                if entry.seq < top and entry.where.task not in seen:
                    window[entry.where.task] = entry  # (oldest first: the last one stays)
            seen.update(window)
            candidates = sorted(window.values(), key=lambda e: -e.seq)
            while candidates and len(found) < want:  # the newest first, as many as missing
                chunk, candidates = (
                    candidates[: want - len(found)],
                    candidates[want - len(found) :],
                )
                last = await origin.last_changes([(e.where.task, e.where.scope) for e in chunk])
                found.extend(e for e in chunk if last.get(e.where.task) == e.origin)
            top = lo
        return found[:want]

    async def tight(self, subject: str, top: int, want: int) -> tuple[int, int]:
        """As ``start``, but steps sized by the density found, then narrowed to 5/4 of ``want``.

        On an index whose entries are large (the literal one copies snapshots),
        a few one-message probes cost less than the entries read past ``want``:
        each probe's count sizes the next step (interpolated; at most 8 to narrow).
        """
        at_top = await self.count_from(subject, top)
        hi, at_hi, span = top, 0, 4 * want
        while True:
            lo = max(top - span, 1)
            between = await self.count_from(subject, lo) - at_top
            if lo == 1 or between >= want:
                break
            hi, at_hi = lo, between
            span = span * 4 if between == 0 else max(span * 5 // 4, span * want * 5 // between // 4)
        for _ in range(8):
            if between <= want * 5 // 4 or hi - lo <= 1:
                break
            goal = want * 9 // 8  # (interpolated: entries spread about evenly)
            mid = hi - (hi - lo) * (goal - at_hi) // max(between - at_hi, 1)
            mid = min(max(mid, lo + 1), hi - 1)
            count = await self.count_from(subject, mid) - at_top
            if count >= want:
                lo, between = mid, count
            else:
                hi, at_hi = mid, count
        return lo, between

    async def owner_sweep(self, owner: str, origin: Reader) -> list[Entry]:
        """The owner's unfinished tasks, from its entries in the literal index.

        Every entry on ``<p>.ix.o.<owner>`` (the owner's ``s`` and ``f``, all
        read), the newest per task; those not ``f`` are checked by their task's
        last message in ``origin`` (``last_of``): it must be the owner's and not
        ``f`` (another owner may have claimed or ended it since). Returns the
        origin's entries, oldest first.
        """
        subject = self.layout.listing_owner(owner)
        newest: dict[str, Entry] = {}
        for msg in await self.read(subject, 1, await self.count_from(subject, 1)):
            entry = self.entry(msg)
            newest[entry.where.task] = entry
        open_ = [(e.where.task, e.where.scope) for e in newest.values() if e.where.kind != "f"]
        last = await origin.last_of(open_)
        return sorted(
            (e for e in last.values() if e.where.owner == owner and e.where.kind != "f"),
            key=lambda e: e.seq,
        )

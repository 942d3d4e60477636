"""Listing of the task log (format 3): pages read from the index nats-server keeps.

Part of ``logjournal`` (issue 41, docs/decisions/0001-cluster-store-layout.md),
which holds one and hands ``list`` and ``total`` to it.

Listing reads the index (``A2A_CURRENT``): one entry per task, its newest ``s``
or ``f``, in the order they were written, so newest first is the index read
backwards. JetStream reads forwards only; a direct get says how many entries
matching a filter lie at or after a position (``Nats-Num-Pending``), so a page
gallops down from its token until enough entries lie between, then reads them
forwards. A scope, or a scope and a context, is the filter; a state or a status
time is read from each entry's ``A2a-Status`` header: such a page reads at most
``SCAN_MOST`` entries, and may come short of its size with a token that
continues below what it read. ``total_size`` is the filter's count (one request)
without those. With them, the newest ``COUNT_MOST`` entries are counted (a first
page's and those below, headers only): exact if there are no more. Beyond, the
rest is estimated from ``SAMPLE_WINDOWS`` windows of equal spans below them
(``SAMPLE_MOST`` entries in all, the first of each window). Entries are in the
order they were written, so the matches of a status time filter, and of a state
tasks pass through (working), lie mostly in the newest, which are counted.

The index lags the log (0.3 ms at p50 in ``bench.nats_layout``). A listing first
waits until the index holds every ``s`` and ``f`` the log held when it began
(``caught_up``), so a caller sees its own writes, as far as the replica that
answers a page's reads holds them (on R3 one may lag:
docs/explanation/cluster.md); if the index is not there
within ``Retry.timeout`` (its source stalled, R3 after a failover) the listing
fails UNAVAILABLE, retryable. A page's running tasks are folded with the ``e``
after their entry (one ``multi_last`` says which have any).

Who runs what: reads only, on any task of the caller's event loop; nothing held
between calls but the page tokens' key.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from a2a.types.a2a_pb2 import Task
from nats.aio.msg import Msg

from ..errors import UnknownFormatError
from ..journal import (
    InvalidPageTokenError,
    PageTokens,
    StoreUnavailableError,
    TaskPage,
    TaskQuery,
)
from .formats import HEADER as FORMAT
from .records import STREAM_SEQ, SUBJECT
from .requests import JetStreamRequests, batches, ended, pending
from .requests import position as _pos
from .retry import Retry
from .tasklog import (
    CURRENT_SUBJECT,
    FINAL,
    LOG_FORMAT,
    LOG_SUBJECT,
    SCOPE,
    SNAPSHOT,
    SOURCE,
    STATUS,
    Logged,
    LogRead,
    TaskLog,
    decode,
    events_of,
    fold,
    numbered_on,
    token,
)

MARK = "log"
"""What this journal's page tokens are sealed for (another journal's do not open)."""
SCAN_MOST = 2_000
"""Entries a page filtered by state or status time reads at most."""
COUNT_MOST = 1_000
"""Entries a ``total_size`` with those filters counts at most (beyond: an estimate)."""
SAMPLE_WINDOWS = 4
"""Windows spread over the entries an estimated ``total_size`` samples."""
SAMPLE_MOST = 500
"""Entries those windows read at most, together (the first of each window)."""
NARROW_STEPS = 16
"""Halvings that bring a window near the entries it needs (see ``LogListing._start``)."""
BATCH = 256
"""Entries one direct get returns at most."""
COUNT_BATCH = 1_000
"""Entries one direct get returns at most when only their headers are read (a count)."""
COUNT_BYTES = 4 << 20
"""Bytes after which one such direct get stops (with the entry that crossed it): entries
copy whole snapshots."""
FOLD_BYTES = 4 << 20
"""Bytes after which the ``multi_last`` of a page's running tasks stops (then each is read)."""
FOLD_CONCURRENCY = 16
"""Running tasks of a page whose changes are read at once."""


class LogListing:
    """Pages and totals of the log's tasks.

    Args:
        requests: Lean requests on the connection (direct gets, stream info).
        log: The task log (a running task's changes after its entry).
        page_tokens: Seals ListTasks page tokens.
        retry: How long a read retries through a NATS outage.
        log_stream: The log's stream.
        index_stream: The index's stream.
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        log: TaskLog,
        page_tokens: PageTokens,
        retry: Retry,
        log_stream: str,
        index_stream: str,
    ) -> None:
        self._requests = requests
        self._log = log
        self._tokens = page_tokens
        self._retry = retry
        self._log_stream = log_stream
        self._index_stream = index_stream

    async def list(self, query: TaskQuery) -> TaskPage:
        """One page of the scope's tasks matching ``query``, most recently written first.

        Raises:
            InvalidPageTokenError: ``query.page_token`` is not one this journal issued.
            StoreUnavailableError: NATS did not answer, or the index lags the log.
        """
        before = (
            self._tokens.decode(query.page_token, MARK, query.scope) if query.page_token else None
        )
        if before is not None and before < 1:
            raise InvalidPageTokenError("the page token does not name a place in the listing")
        subject = _filter(query)
        await self.caught_up()
        scanning = bool(query.state or query.status_after_ns)
        top = before if before is not None else await self._end(subject)
        at_top = None if before is not None else 0  # (none lies past the end)
        want = query.page_size + 1
        found: builtins.list[Logged] = []
        scanned, low = 0, top
        while len(found) < want and low > 1 and (not scanning or scanned < SCAN_MOST):
            need = want - len(found)
            if scanning:  # (windows of a batch: few matches per entry read)
                need = max(need, min(BATCH, SCAN_MOST - scanned))
            lo, between, at_top = await self._start(subject, low, need, at_top)
            window = [m for m in await self._read(subject, lo, between) if _pos(m) < low]
            scanned += len(window)
            for msg in reversed(window):
                if _header_matches(query, msg.headers or {}):  # (decoded only if it matches)
                    found.append(decode(msg))
            low = lo
        page_items = found[: query.page_size]
        tasks = await self._fold_page(page_items)
        if len(found) > query.page_size:
            next_token = self._tokens.encode(page_items[-1].pos, MARK, query.scope)
        elif low > 1 and scanning and scanned >= SCAN_MOST:  # (short: continues below)
            next_token = self._tokens.encode(low, MARK, query.scope)
        else:
            next_token = ""
        first = _Scan(low, scanned, len(found), at_top) if before is None else None
        total = await self._total(query, subject, first)  # (later pages count from the end)
        return TaskPage(
            tasks=tasks,
            next_page_token=next_token,
            total_size=total,
            after=[self._tokens.encode(e.pos, MARK, query.scope) for e in page_items],
        )

    async def caught_up(self) -> None:
        """Return once the index holds every ``s`` and ``f`` the log held when called.

        The log's last position, then, while the index's last entry came from below
        it, the first ``s`` and ``f`` between (near the log's end): none means the
        index has them all. Both last positions come from the streams' states and
        one direct get by position (a last message by a wildcard walks every task's
        subjects, decision 0001), or the slow way when no stream leader answers.

        Raises:
            StoreUnavailableError: Not within ``Retry.timeout`` (the index's source stalls).
        """
        state = await self._log.stream_state()
        target = state[1] if state else await self._last_pos(self._log_stream, f"{LOG_SUBJECT}.>")
        pause = 0.001
        try:
            async with asyncio.timeout(self._retry.timeout):
                while True:
                    reached = await self._reached()
                    if reached >= target:
                        return
                    due = await asyncio.gather(
                        *(
                            self._get(
                                self._log_stream,
                                {
                                    "seq": reached + 1,
                                    "next_by_subj": f"{LOG_SUBJECT}.t.*.*.*.*.{kind}",
                                    "batch": 1,
                                },
                            )
                            for kind in (SNAPSHOT, FINAL)
                        )
                    )
                    if not any(msgs and _pos(msgs[0]) <= target for msgs in due):
                        return
                    await asyncio.sleep(pause)  # (paces polling while the index copies)
                    pause = min(pause * 2, 0.05)
        except TimeoutError:
            raise StoreUnavailableError(
                "the listing index has not caught up with the task log; retry"
            ) from None

    async def holds_any(self) -> bool:
        """Whether the log holds any task.

        Its index holds an entry, or (the index empty, or its leader silent) one
        direct get on the log finds one.
        """
        state = await self._log.stream_state(self._index_stream)
        return bool(state and state[0]) or await self._log.holds_any()

    async def _reached(self) -> int:
        """The log's position of the message the index's last entry copies (0: none).

        The entry at the index's last position; if that is unknown (no leader
        answered) or not there (an R3 replica behind its leader), the last entry by
        subject: a wildcard read, as slow as it is sure.
        """
        state = await self._log.stream_state(self._index_stream)
        if state is not None and not state[1]:
            return 0
        msgs = await self._get(self._index_stream, {"seq": state[1]}) if state else []
        if not msgs:
            return await self._last_pos(self._index_stream, f"{CURRENT_SUBJECT}.>", origin=True)
        return _origin(msgs[0])

    async def _last_pos(self, stream: str, subject: str, *, origin: bool = False) -> int:
        """The position of the last message on ``subject`` (0: none); ``origin``: in the log.

        A wildcard walks every matching subject in nats-server: the slow way, for
        when no stream leader answers (``TaskLog.stream_state``).
        """
        msgs = await self._get(stream, {"last_by_subj": subject})
        if not msgs:
            return 0
        return _origin(msgs[0]) if origin else _pos(msgs[0])

    async def _end(self, subject: str) -> int:
        """One past the index's last entry (1 if none): a page's top.

        From the index's state, or (no leader answered) one past the last entry on
        ``subject``.
        """
        state = await self._log.stream_state(self._index_stream)
        if state is not None:
            return state[1] + 1
        return await self._last_pos(self._index_stream, subject) + 1

    async def _count_from(self, subject: str, start: int) -> int:
        """How many entries on ``subject`` lie at ``start`` or after."""
        msgs = await self._get(
            self._index_stream, {"seq": max(start, 1), "next_by_subj": subject, "batch": 1}
        )
        return 1 + pending(msgs[0]) if msgs else 0

    async def _start(
        self, subject: str, top: int, want: int, at_top: int | None = None, slack: int = 4
    ) -> tuple[int, int, int]:
        """Where ``want`` entries (or all) lie below ``top``: (lo, between, at lo or after).

        Gallops down from ``top`` in steps of x4, counting with ``Nats-Num-Pending``;
        then, while more than ``slack`` times ``want`` lie between (entries unevenly
        spread: a burst, then a quiet scope), halves the last step, up to
        ``NARROW_STEPS`` times, so a window reads about what it needs. Evenly spread
        entries need no halving at the default slack. ``at_top``: how many lie at
        ``top`` or after, when the caller knows (each count is a request). Entries
        written meanwhile only make a window read more than it keeps (a window keeps
        what lies below ``top``).
        """
        if at_top is None:
            at_top = await self._count_from(subject, top)
        span, above = 4 * want, top  # (above: fewer than want lie between it and top)
        while True:
            lo = max(top - span, 1)
            at_lo = await self._count_from(subject, lo)
            if lo == 1 or at_lo - at_top >= want:
                break
            above, span = lo, span * 4
        for _ in range(NARROW_STEPS):
            if at_lo - at_top <= slack * want or above - lo < 2:
                break
            mid = (lo + above) // 2
            at_mid = await self._count_from(subject, mid)
            if at_mid - at_top >= want:
                lo, at_lo = mid, at_mid
            else:
                above = mid
        return lo, at_lo - at_top, at_lo

    async def _read(self, subject: str, lo: int, count: int) -> builtins.list[Msg]:
        """The ``count`` entries on ``subject`` from ``lo``, oldest first."""
        walk = batches(self._index_get, subject, lo, count, BATCH)
        async with contextlib.aclosing(walk) as read:
            return [msg async for msgs in read for msg in msgs]

    async def total(self, query: TaskQuery) -> int:
        """How many of the scope's tasks match ``query`` (its page token aside).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        return await self._total(query, _filter(query))

    async def _total(self, query: TaskQuery, subject: str, scan: _Scan | None = None) -> int:
        """How many of the scope's tasks match (see the module docstring).

        ``scan``: what a first page read down from the index's end (exact there); None:
        nothing. With a state or status time filter, the newest ``COUNT_MOST`` entries
        are counted (the first page's and those below them), and the rest estimated
        from windows spread over it. Entries written while it counts may be counted or
        not: a total as of about its start.
        """
        entries = await self._count_from(subject, 1)
        if not (query.state or query.status_after_ns) or not entries:
            return entries
        if scan is None:
            end = await self._end(subject)
            scan = _Scan(end, 0, 0, 0)
        more = COUNT_MOST - scan.scanned
        if more > 0 and scan.low > 1:  # (the top, where the newest statuses are)
            lo, between, _ = await self._start(subject, scan.low, more, scan.at_low, slack=2)
            read, matched, _ = await self._count_matches(query, subject, lo, scan.low, between)
            scan = replace(scan, low=lo, scanned=scan.scanned + read)
            scan = replace(scan, matched=scan.matched + matched)
        rest = entries - scan.scanned
        if rest <= 0 or scan.low <= 1:
            return scan.matched
        windows = _spread(scan.low, SAMPLE_WINDOWS)
        most = max(SAMPLE_MOST // len(windows), 1)
        counts = await asyncio.gather(
            *(self._count_matches(query, subject, lo, hi, most) for lo, hi in windows)
        )
        read = sum(n for n, _, _ in counts)
        matched = sum(m for _, m, _ in counts)
        sampled = [(n, m) for n, m, whole in counts if not whole and n]
        rate = sum(m for _, m in sampled) / sum(n for n, _ in sampled) if sampled else 0.0
        return scan.matched + matched + round(rate * max(rest - read, 0))

    async def _count_matches(
        self, query: TaskQuery, subject: str, lo: int, hi: int, most: int
    ) -> tuple[int, int, bool]:
        """Of the first ``most`` entries in [lo, hi): how many, how many match, all of them?

        Only their headers are read.
        """
        if most < 1:
            return 0, 0, lo >= hi
        read = matched = 0
        last: Sequence[Msg] = ()
        walk = batches(self._index_get, subject, lo, most, COUNT_BATCH, COUNT_BYTES)
        async with contextlib.aclosing(walk) as batch:
            async for last in batch:
                for msg in last:
                    if _pos(msg) >= hi:
                        return read, matched, True
                    read += 1
                    matched += _header_matches(query, msg.headers or {})
        return read, matched, ended(last) or _pos(last[-1]) + 1 >= hi

    async def _fold_page(self, entries: Sequence[Logged]) -> builtins.list[Task]:
        """The page's tasks, each running one with the ``e`` written after its entry.

        One ``multi_last`` of the running tasks' ``e`` subjects says which have any
        after their entry (a waiting task has none); only those are read. An answer
        cut short (``FOLD_BYTES``: it carries each last ``e`` whole), or one that does
        not name its subjects, says nothing: then each running task is read.
        """
        gate = asyncio.Semaphore(FOLD_CONCURRENCY)
        running = sorted({events_of(e) for e in entries if not e.final})
        newest: dict[str, int] | None = {}
        if running:
            request = {"multi_last": running, "batch": len(running), "max_bytes": FOLD_BYTES}
            msgs = await self._get(self._log_stream, request)
            headers = [m.headers or {} for m in msgs]
            if ended(msgs) and all(SUBJECT in h for h in headers):
                newest = {h[SUBJECT]: int(h[STREAM_SEQ]) for h in headers}
            else:
                newest = None

        async def folded(entry: Logged) -> Task:
            if entry.final:
                return entry.task()
            if newest is not None and newest.get(events_of(entry), 0) <= entry.origin:
                return entry.task()
            async with gate:
                after = await self._log.entries(entry.task_id, entry.origin, events_of(entry))
                if not numbered_on(entry.seq, after):
                    read = await self._log.read(entry.task_id)  # (a snapshot since: read anew)
                    return entry.task() if read is None else fold(read).task
            return fold(LogRead(entry, after, after[-1].pos if after else entry.origin)).task

        return list(await asyncio.gather(*(folded(e) for e in entries)))

    async def _index_get(self, request: dict[str, object]) -> builtins.list[Msg]:
        """A direct get on the index, retried through an outage."""
        return await self._get(self._index_stream, request)

    async def _get(self, stream: str, request: dict[str, object]) -> builtins.list[Msg]:
        """A direct get, retried through an outage."""
        return await self._retry(
            lambda: self._requests.direct_get(stream, request, self._retry.timeout),
            f"read {stream}",
        )


def _filter(query: TaskQuery) -> str:
    """The index's subjects a listing reads: the scope's, or one context's of it."""
    scope = token(query.scope)
    if query.context_id:
        return f"{CURRENT_SUBJECT}.{scope}.{token(query.context_id)}.*"
    return f"{CURRENT_SUBJECT}.{scope}.>"


@dataclass(frozen=True, slots=True)
class _Scan:
    """What a first page read of the index: its entries from ``low`` up, and their counts."""

    low: int
    scanned: int
    matched: int
    at_low: int | None
    """How many entries lie at ``low`` or after (None: not counted)."""


def _spread(below: int, count: int) -> builtins.list[tuple[int, int]]:
    """``count`` windows [lo, hi) of equal spans over the positions [1, ``below``)."""
    step = -(-(below - 1) // count)  # (ceiling)
    return [(at, min(at + step, below)) for at in range(1, below, step)]


def _header_matches(query: TaskQuery, headers: dict[str, str]) -> bool:
    """Whether an index entry passes the query's filters (its headers: nothing decoded).

    Raises:
        UnknownFormatError: It is not in the log's format (as ``decode``).
    """
    given = headers.get(FORMAT)
    if given != str(LOG_FORMAT):
        raise UnknownFormatError("a message of the task log", str(given)[:16])
    state, _, stamp = headers.get(STATUS, "0 0").partition(" ")
    return (
        headers.get(SCOPE, "") == query.scope
        and query.state in (0, int(state))
        and int(stamp or 0) >= query.status_after_ns
    )


def _origin(msg: Msg) -> int:
    """The log's position of the message an index entry copies."""
    text = (msg.headers or {}).get(SOURCE, "")
    fields = text.split(" ")
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0

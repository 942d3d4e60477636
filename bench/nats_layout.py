"""Layout E on JetStream: one message per change, on subjects naming task, owner, scope, context.

    .venv/bin/python -m bench.nats_layout [--sizes 1000,10000,100000] [--reps 2]
                                          [--order id-first] [--changes 1000]
                                          [--writers 1,16] [--seconds 10] [--json PATH]
                                          [--index today|sourced|literal]

Issue 41, step 1 (docs/decisions/0001-cluster-store-layout.md), second spike. One
stream holds every change of every task, one message each, on the subject

    <p>.t.<task id>.<owner>.<scope hash>.<context hash>.<kind>     (--order id-first)
    <p>.t.<scope hash>.<task id>.<owner>.<context hash>.<kind>     (--order scope-first)

``kind`` is ``s`` (a change with the task's snapshot), ``e`` (events only) or ``f``
(the final change and snapshot). Each change is one publish, its compare-and-set
over all of the task's subjects (``Nats-Expected-Last-Subject-Sequence`` and
``...-Subject: <the task's filter>``). The helpers below (``Layout``, ``Reader``)
are what tests/cluster/test_jetstream_layout.py asserts on a real nats-server.

For each size N and repetition, on a nats-server of its own (one node, file
storage), this process fills the stream (not timed) with N tasks, each an ``s``
at creation, one ``e`` and an ``f`` (10 % left unfinished, without the ``f``),
spread over 100 scopes (one, "big", with 10 % of them) and 10 owners; and a
second stream with today's listing index (one entry per task, the current one,
on ``<p>.idx.s.<scope hash>.<state>``). Then it measures, each loop bounded in
count and in ``--seconds``:

* reading a task by id: its newest snapshot, the events after it, its final;
* listing newest first: the first page of 50 of the big scope and of a small one,
  and the big scope's 10th page (from the cursor the 9th left), in layout E and
  on today's index; requests per page;
* a sweep of one owner: its unfinished tasks (its tasks whose last change it
  wrote and is not final);
* a change's cost, one writer and ``--writers``: E's one publish with the
  filtered compare-and-set (to a new task; to an unfinished task written while
  filling, its filter ending in ``*`` tokens or in ``>``), one publish with a
  literal one, and today's three acked in turn (``bench.nats_batches``);
* nats-server's CPU for each (``/proc/<pid>/stat``), the stream's bytes per task.

``--index sourced`` also makes, before filling, the listing index nats-server keeps by
itself: a stream ``CURRENT`` sourcing the ``s`` and ``f`` messages through subject
transforms, one entry per task on ``<p>.cur.<scope>.<context>.<task id>``
(``Layout.sourced``). It then measures as well: how long the index takes to catch up
after the fill; its pages (as above); the check a reader makes to see every ``s`` and
``f`` stored before it (``Reader.catch_up``, at rest); the lag from a change's ack to
the index holding it (p50, p99, each writer polling its last entry); a change that is
an ``s`` (600 bytes, sourced) with the index there, then again once it is deleted;
and the index's bytes per task.

``--index literal`` (spike 4) writes E with a state token (``Layout.states``) and
gives each task 1 to 3 state changes after its creation (``Population.script``:
``s`` submitted, ``e``, then ``s`` working / input-required, the last an ``f``
completed if the task ends): 2 to 4 ``s``/``f`` per task, 3 on average. It makes the
sourced index above and ``LISTING``, the literal index (``Layout.literal``: every
``s`` and ``f`` copied onto ``<p>.ix.s.<scope>.<state>``, ``<p>.ix.c.<scope>.<context>``,
``<p>.ix.o.<owner>``, stale entries kept), and measures beside the rest: its pages
(page 1 of the big and a small scope, page 10 of the big one, page 1 of the big
scope's working and completed tasks, each entry checked against E), today's index
on the same states, today's page 1 with its tasks' snapshots read from E (what a
listing returns), a sweep through the owner's entries, the lag to it, its bytes
per task; then an ``s`` change's cost (nats-server's CPU read once the index holds
it) with each index alone, filled, with none, and with fresh variants made from
E's end, varying one thing at a time (``s_costs``).

Prints a table, median [min-max] over the repetitions, and writes JSON with
every repetition's figures. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import StorageType, StreamConfig, StreamSource

from tests.support import ROOT, natsserver
from tests.support.layout_e import ORDERS, SEQUENCE, TIMEOUT, Layout, Reader, Where, change, digest

from .load import cpu_seconds
from .nats_batches import Failed, alone, in_turn

# -- the benchmark ---------------------------------------------------------------------------

PAGE = 50
SCOPES = 100
OWNERS = 10
WINDOW = 256
"""Tasks whose writes are in flight together while filling."""
PAYLOAD = {"s": b"s" * 600, "e": b"e" * 200, "f": b"f" * 600}
STREAM, INDEX, CURRENT, LISTING = "LAYOUT", "INDEX", "CURRENT", "LISTING"
PREFIX = "l"
SUBMITTED, WORKING, INPUT, COMPLETED = "1", "2", "3", "6"
"""State tokens (``--index literal``): ``TaskState`` numbers."""


@dataclass
class Population:
    """The tasks a repetition writes: who owns them, their scope, whether they end."""

    tasks: list[Where]
    finished: list[bool]
    changes: list[int]
    """``--index literal``: each task's state changes after its creation, 1 to 3."""

    def script(self, i: int, states: bool) -> list[tuple[str, str]]:
        """Task ``i``'s changes in order, each a kind and the state after it.

        Without ``states``: ``s``, ``e``, ``f`` (unfinished: no ``f``). With: ``s``
        submitted, ``e``, then ``changes[i]`` changes of state, each an ``s``
        (working, input-required, working) but the last an ``f`` (completed) if
        the task finishes.
        """
        if not states:
            return [("s", ""), ("e", ""), *([("f", "")] if self.finished[i] else [])]
        steps = [("s", SUBMITTED), ("e", SUBMITTED)]
        for j in range(1, self.changes[i] + 1):
            if j == self.changes[i] and self.finished[i]:
                steps.append(("f", COMPLETED))
            else:
                steps.append(("s", WORKING if j % 2 else INPUT))
        return steps

    def state(self, i: int) -> str:
        """Task ``i``'s state once filled (today's index's token)."""
        if not self.changes[i]:
            return "3" if self.finished[i] else "2"
        return self.script(i, True)[-1][1]

    @classmethod
    def make(cls, n: int, seed: int, states: bool = False) -> Population:
        """``n`` tasks over ``SCOPES`` scopes (scope 0 "big", 10 %) and ``OWNERS`` owners."""
        rng, steps = random.Random(seed), random.Random(seed + 1_000)  # (the same tasks)
        tasks, finished, changes = [], [], []
        for i in range(n):
            scope = 0 if rng.random() < 0.1 else rng.randrange(1, SCOPES)
            tasks.append(
                Where(
                    digest(f"task {i}"),
                    digest(f"owner {rng.randrange(OWNERS)}", 16),
                    digest(f"scope {scope}"),
                    digest(f"context {i // 4}"),
                    "s",
                )
            )
            finished.append(rng.random() >= 0.1)
            changes.append(steps.randint(1, 3) if states else 0)
        return cls(tasks, finished, changes)


def scope_token(n: int) -> str:
    """The token of scope ``n`` (0: the big one)."""
    return digest(f"scope {n}")


def owner_token(n: int) -> str:
    """The token of owner ``n``."""
    return digest(f"owner {n}", 16)


async def _checked(answers: Awaitable[list[dict[str, Any]]]) -> list[int]:
    found = await answers
    for answer in found:
        if "error" in answer:
            raise Failed(str(answer["error"]))
    return [int(a["seq"]) for a in found]


async def fill(nc: NATS, layout: Layout, population: Population, seconds: float) -> float:
    """Write every task's changes (and today's index entries), ``WINDOW`` tasks at a time.

    Returns:
        The seconds it took.

    Raises:
        TimeoutError: It took longer than ``seconds``.
    """
    began = time.perf_counter()
    async with asyncio.timeout(seconds):
        for lo in range(0, len(population.tasks), WINDOW):
            todo = range(lo, min(lo + WINDOW, len(population.tasks)))
            scripts = {i: population.script(i, layout.states) for i in todo}
            versions = dict.fromkeys(todo, 0)
            for step in range(max(len(steps) for steps in scripts.values())):
                now = [(i, steps[step]) for i, steps in scripts.items() if step < len(steps)]
                seqs = await _checked(
                    asyncio.gather(
                        *(
                            change(
                                nc,
                                layout,
                                _kind(population.tasks[i], k, st),
                                versions[i],
                                PAYLOAD[k],
                            )
                            for i, (k, st) in now
                        )
                    )
                )
                versions.update((i, v) for (i, _), v in zip(now, seqs, strict=True))
            await asyncio.gather(
                *(
                    nc.request(
                        _index_subject(population.tasks[i], population.state(i)),
                        population.tasks[i].task.encode() + b"x" * 90,
                        TIMEOUT,
                    )
                    for i in todo
                )
            )
    return time.perf_counter() - began


def _kind(where: Where, kind: str, state: str = WORKING) -> Where:
    return Where(where.task, where.owner, where.scope, where.context, kind, state)


def _index_subject(where: Where, state: str) -> str:
    return f"{PREFIX}.idx.s.{where.scope}.{state}"


def index_filter(scope: str) -> str:
    """Today's index: every entry of one scope, whatever its state."""
    return f"{PREFIX}.idx.s.{scope}.*"


async def _streams(nc: NATS, layout: Layout, index: str) -> None:
    js = nc.jetstream(timeout=TIMEOUT)
    common: dict[str, Any] = {"storage": StorageType.FILE, "allow_direct": True}
    await js.add_stream(
        StreamConfig(
            name=STREAM,
            subjects=[f"{PREFIX}.t.>", "b.task.*.ev", "b.task.*.snap", "b.idx.>"],
            allow_msg_ttl=True,
            allow_rollup_hdrs=True,
            duplicate_window=120.0,
            **common,
        )
    )
    await js.add_stream(StreamConfig(name=INDEX, subjects=[f"{PREFIX}.idx.>"], **common))
    if index in ("sourced", "literal"):
        await js.add_stream(layout.sourced(CURRENT, STREAM, storage=StorageType.FILE))
    if index == "literal":
        await js.add_stream(layout.literal(LISTING, STREAM, storage=StorageType.FILE))


Op = Callable[[int], Awaitable[int]]
"""One measured operation (its number); the requests it made."""


async def timed(op: Op, count: int, seconds: float, pid: int) -> dict[str, float]:
    """Run ``op`` up to ``count`` times (at most ``seconds``); per operation figures."""
    server0, client0 = cpu_seconds(pid), time.process_time()
    began, requests, done = time.perf_counter(), 0, 0
    deadline = time.monotonic() + seconds
    for i in range(count):
        if time.monotonic() > deadline:
            break
        requests += await op(i)
        done += 1
    wall = time.perf_counter() - began
    return {
        "n": done,
        "wall_us": wall / done * 1e6,
        "server_cpu_us": (cpu_seconds(pid) - server0) / done * 1e6,
        "client_cpu_us": (time.process_time() - client0) / done * 1e6,
        "requests": requests / done,
    }


def reads(reader: Reader, population: Population) -> Op:
    """Read a random task by id (its snapshot and the events after it)."""
    rng = random.Random(7)

    async def op(_: int) -> int:
        before = reader.requests
        t = rng.choice(population.tasks)
        snap, _events, _final = await reader.task(t.task, t.scope)
        if snap is None:
            raise Failed(f"task {t.task} not found")
        return reader.requests - before

    return op


def pages(reader: Reader, subject: str, before: int | None, expected: int) -> Op:
    """Read one page of ``PAGE`` tasks on ``subject`` below ``before`` (``expected`` found)."""

    async def op(_: int) -> int:
        start = reader.requests
        found = await reader.page(subject, before, PAGE)
        if len(found) != expected:
            raise Failed(f"a page of {len(found)} on {subject}, not {expected}")
        return reader.requests - start

    return op


async def cursor(reader: Reader, subject: str, pages_before: int) -> int:
    """The cursor after ``pages_before`` pages on ``subject`` (read, not timed)."""
    before: int | None = None
    for _ in range(pages_before):
        if reader.stream == INDEX:
            before = (await index_page(reader, subject, before))[-1]
        elif reader.stream == CURRENT:
            before = (await reader.latest(subject, before, PAGE))[-1].seq
        elif reader.stream == LISTING:
            origin = Reader(reader.nc, STREAM, reader.layout)
            before = (await reader.listing(subject, before, PAGE, origin))[-1].seq
        else:
            before = (await reader.page(subject, before, PAGE))[-1].seq
    assert before is not None
    return before


def sweeps(reader: Reader, owner: str, expected: int) -> Op:
    """Find one owner's unfinished tasks."""

    async def op(_: int) -> int:
        start = reader.requests
        found = await reader.sweep(owner)
        if len(found) != expected:
            raise Failed(f"a sweep found {len(found)} of {expected}")
        return reader.requests - start

    return op


Writer = Callable[[NATS, str, int], Awaitable[int]]


def e_writer(layout: Layout, kind: str = "e") -> Writer:
    """E's change: one publish, its compare-and-set over the task's subjects."""

    async def write(nc: NATS, task: str, version: int) -> int:
        where = Where(
            digest(f"w {task}"), owner_token(0), scope_token(1), digest("c"), kind, WORKING
        )
        answer = await change(nc, layout, where, version, PAYLOAD[kind])
        if "error" in answer:
            raise Failed(str(answer["error"]))
        return int(answer["seq"])

    return write


async def old_writer(reader: Reader, population: Population, layout: Layout) -> Writer:
    """E's change to an unfinished task written while filling (its messages far from the end).

    The ``task`` argument names one of 100 such tasks; each writer keeps its versions.
    """
    names = [f"{i}" for i in range(100)]
    olds = [t for t, end in zip(population.tasks, population.finished, strict=True) if not end]
    chosen = dict(zip(names, random.Random(3).sample(olds, 100), strict=True))
    last = await reader.last_of([(t.task, t.scope) for t in chosen.values()])
    versions = {name: last[t.task].seq for name, t in chosen.items()}

    async def write(nc: NATS, task: str, _version: int) -> int:
        name = task.rsplit("-", 1)[1]
        answer = await change(nc, layout, _kind(chosen[name], "e"), versions[name])
        if "error" in answer:
            raise Failed(str(answer["error"]))
        versions[name] = int(answer["seq"])
        return versions[name]

    return write


async def writes(
    clients: list[NATS],
    write: Writer,
    args: argparse.Namespace,
    pid: int,
    tag: str,
    settle: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, float]:
    """``args.changes`` changes of 100 tasks shared by the writers; per change figures.

    ``settle``: awaited after the last ack, before nats-server's CPU is read (an
    index catching up: its copies are part of a change's cost; not of its wall time).
    """
    writers = len(clients)
    todo = iter(range(args.changes))
    deadline = time.monotonic() + args.seconds
    done = 0

    async def writer(k: int) -> None:
        nonlocal done
        versions = {f"{tag}{t}": 0 for t in range(k, 100, writers)}
        names = list(versions)
        for i in todo:
            if time.monotonic() > deadline:
                return
            task = names[i % len(names)]
            versions[task] = await write(clients[k], task, versions[task])
            done += 1

    server0, client0 = cpu_seconds(pid), time.process_time()
    began = time.perf_counter()
    await asyncio.gather(*(writer(k) for k in range(writers)))
    wall = time.perf_counter() - began
    if settle is not None:
        await settle()
    return {
        "n": done,
        "wall_us": wall / done * 1e6,
        "server_cpu_us": (cpu_seconds(pid) - server0) / done * 1e6,
        "client_cpu_us": (time.process_time() - client0) / done * 1e6,
    }


async def lags(
    clients: list[NATS],
    layout: Layout,
    args: argparse.Namespace,
    tag: str,
    stream: str = CURRENT,
    subject: str = ">",
) -> dict[str, float]:
    """``args.changes`` ``s`` changes; each writer then polls the index until it holds its own.

    Per change: the lag from the ack to the index holding it (``Reader.wait_for``).
    """
    write = e_writer(layout, "s")
    writers = len(clients)
    todo = iter(range(args.changes))
    deadline = time.monotonic() + args.seconds
    found: list[float] = []
    polls = 0

    async def writer(k: int) -> None:
        nonlocal polls
        index = Reader(clients[k], stream, layout)
        versions = {f"{tag}{t}": 0 for t in range(k, 100, writers)}
        names = list(versions)
        for i in todo:
            if time.monotonic() > deadline:
                return
            task = names[i % len(names)]
            versions[task] = await write(clients[k], task, versions[task])
            acked = time.perf_counter()
            made = await index.wait_for(versions[task], subject)
            found.append(time.perf_counter() - acked)
            polls += made

    async with asyncio.timeout(args.seconds + TIMEOUT):
        await asyncio.gather(*(writer(k) for k in range(writers)))
    found.sort()
    return {
        "n": len(found),
        "lag_p50_us": found[len(found) // 2] * 1e6,
        "lag_p99_us": found[min(len(found) - 1, len(found) * 99 // 100)] * 1e6,
        "requests": polls / len(found),
    }


def catch_ups(index: Reader, origin: Reader) -> Op:
    """A reader's check that the index holds every ``s`` and ``f`` stored before it."""

    async def op(_: int) -> int:
        start = index.requests + origin.requests
        await index.catch_up(origin)
        return index.requests + origin.requests - start

    return op


def _sourced_pages(reader: Reader, subject: str, before: int | None, expected: int) -> Op:
    async def op(_: int) -> int:
        start = reader.requests
        found = await reader.latest(subject, before, PAGE)
        if len(found) != expected:
            raise Failed(f"a page of {len(found)} in the sourced index")
        return reader.requests - start

    return op


def _literal_pages(
    reader: Reader, origin: Reader, subject: str, before: int | None, expected: int
) -> Op:
    async def op(_: int) -> int:
        start = reader.requests + origin.requests
        found = await reader.listing(subject, before, PAGE, origin)
        if len(found) != expected:
            raise Failed(f"a page of {len(found)} in the literal index, not {expected}")
        return reader.requests + origin.requests - start

    return op


def _literal_sweeps(reader: Reader, origin: Reader, owner: str, expected: int) -> Op:
    async def op(_: int) -> int:
        start = reader.requests + origin.requests
        found = await reader.owner_sweep(owner, origin)
        if len(found) != expected:
            raise Failed(f"a sweep of the literal index found {len(found)} of {expected}")
        return reader.requests + origin.requests - start

    return op


async def literal_caught_up(listing: Reader, origin: Reader, parts: str = "sco") -> None:
    """Return once each part of the literal index holds the origin's last ``s`` and ``f``."""
    ends = [await origin.end(origin.layout.kinds(k)) - 1 for k in "sf"]
    for part in parts:
        await listing.wait_for(max(ends), f"{listing.layout.prefix}.ix.{part}.>")


async def s_costs(
    url: str,
    nc: NATS,
    layout: Layout,
    reader: Reader,
    args: argparse.Namespace,
    pid: int,
    rep: int,
    figures: dict[str, dict[str, float]],
) -> None:
    """An ``s`` change's cost with each index alone, filled and fresh, and with none.

    Filled: the literal index (``CURRENT`` deleted), then ``CURRENT`` made again
    from E's start (spike 3's, caught up untimed). Fresh: each variant made from
    E's end, so it holds only the changes measured; one thing varied at a time.
    nats-server's CPU is read once the index holds the last change.
    """
    js = nc.jetstream(timeout=TIMEOUT)
    common: dict[str, Any] = {"storage": StorageType.FILE, "allow_direct": True}

    async def measure(label: str, stream: str | None, parts: str = "") -> None:
        index = Reader(nc, stream or STREAM, layout)

        async def settle() -> None:
            last = await reader.end(">") - 1
            async with asyncio.timeout(args.fill_seconds):
                if parts:
                    for part in parts:
                        await index.wait_for(last, f"{PREFIX}.ix.{part}.>")
                elif stream is not None:
                    await index.wait_for(last)

        await e_writer(layout, "s")(nc, f"r{rep}{label}", 0)  # (the sourcing set up, untimed)
        await settle()
        for writers in args.writers:
            clients = [await nats.connect(url) for _ in range(writers)]
            try:
                tag = f"r{rep}w{writers}{len(figures)}-"
                found = await writes(clients, e_writer(layout, "s"), args, pid, tag, settle)
                figures[f"s: {label} x{writers}"] = {**found, "requests": 1}
            finally:
                for client in clients:
                    await client.close()

    await js.delete_stream(CURRENT)
    await measure("literal index (filled)", LISTING, "sco")
    await js.delete_stream(LISTING)
    await js.add_stream(layout.sourced(CURRENT, STREAM, **common))
    async with asyncio.timeout(args.fill_seconds):
        await Reader(nc, CURRENT, layout).catch_up(reader)
    await measure("sourced index (filled)", CURRENT)
    await js.delete_stream(CURRENT)
    await measure("no index", None)
    one = [layout.transforms()[0]]
    variants: dict[str, Callable[[int], tuple[StreamConfig, str]]] = {
        "sourced, fresh": lambda start: (
            layout.sourced(CURRENT, STREAM, start, **common),
            "",
        ),
        "sourced, fresh, no per-subject limit": lambda start: (
            layout.sourced(CURRENT, STREAM, start, per_subject=-1, **common),
            "",
        ),
        "sourced, fresh, one transform": lambda start: (
            StreamConfig(
                name=CURRENT,
                sources=[StreamSource(name=STREAM, subject_transforms=one, opt_start_seq=start)],
                max_msgs_per_subject=1,
                **common,
            ),
            "",
        ),
        "source, fresh, no transform": lambda start: (
            StreamConfig(
                name=CURRENT,
                sources=[
                    StreamSource(name=STREAM, filter_subject=layout.kinds("s"), opt_start_seq=start)
                ],
                **common,
            ),
            "",
        ),
        "literal, fresh": lambda start: (
            layout.literal(LISTING, STREAM, start=start, **common),
            "sco",
        ),
        "literal, fresh, scope part only": lambda start: (
            layout.literal(LISTING, STREAM, "s", start, **common),
            "s",
        ),
    }
    for label, make in variants.items():
        config, parts = make(await reader.end(">"))
        await js.add_stream(config)
        await measure(label, config.name, parts)
        assert config.name is not None
        await js.delete_stream(config.name)


def _disk(node: natsserver.Node, stream: str) -> int:
    root = node.store_dir / "jetstream" / "$G" / "streams" / stream
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


async def repetition(n: int, rep: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One repetition at ``n`` tasks, on a nats-server of its own."""
    literal = args.index == "literal"
    layout = Layout(PREFIX, args.order, states=literal)
    fwc = Layout(PREFIX, args.order, fwc=True, states=literal)
    population = Population.make(n, seed=rep, states=literal)
    figures: dict[str, dict[str, float]] = {}
    with natsserver.running(1) as cluster:
        node = cluster.nodes[0]
        assert node.proc is not None
        pid = node.proc.pid
        nc = await nats.connect(cluster.urls[0])
        try:
            sourced = args.index in ("sourced", "literal")
            await _streams(nc, layout, args.index)
            fill_s = await fill(nc, layout, population, args.fill_seconds)
            reader = Reader(nc, STREAM, layout)
            index = Reader(nc, INDEX, layout)
            current = Reader(nc, CURRENT, layout)
            if sourced:
                began = time.perf_counter()
                async with asyncio.timeout(args.fill_seconds):
                    await current.catch_up(reader)
                behind = time.perf_counter() - began
                figures["index behind the fill"] = {"wall_us": behind * 1e6, "n": 1}
                print(f"  the sourced index caught up {behind:.2f} s after the fill")
            listing = Reader(nc, LISTING, layout)
            if literal:
                began = time.perf_counter()
                async with asyncio.timeout(args.fill_seconds):
                    await literal_caught_up(listing, reader)
                behind = time.perf_counter() - began
                figures["literal index behind the fill"] = {"wall_us": behind * 1e6, "n": 1}
                print(f"  the literal index caught up {behind:.2f} s after the fill")
            info = await nc.jetstream(timeout=TIMEOUT).stream_info(STREAM)
            index_info = await nc.jetstream(timeout=TIMEOUT).stream_info(INDEX)
            figures["fill"] = {"wall_us": fill_s / n * 1e6, "n": n}
            figures["bytes per task"] = {
                "stored": info.state.bytes / n,
                "on disk": _disk(node, STREAM) / n,
                "index stored": index_info.state.bytes / n,
            }
            if sourced:
                current_info = await nc.jetstream(timeout=TIMEOUT).stream_info(CURRENT)
                figures["bytes per task"]["sourced stored"] = current_info.state.bytes / n
                figures["bytes per task"]["sourced on disk"] = _disk(node, CURRENT) / n
                if current_info.state.messages != n:
                    raise Failed(f"the sourced index holds {current_info.state.messages} of {n}")
            if literal:
                listing_info = await nc.jetstream(timeout=TIMEOUT).stream_info(LISTING)
                figures["bytes per task"]["literal stored"] = listing_info.state.bytes / n
                figures["bytes per task"]["literal on disk"] = _disk(node, LISTING) / n
                entries = sum(len(population.script(i, True)) - 1 for i in range(n))
                figures["bytes per task"]["literal entries"] = listing_info.state.messages / n
                if listing_info.state.messages != 3 * entries:
                    raise Failed(f"the literal index holds {listing_info.state.messages}")
            print(f"  filled {n} tasks in {fill_s:.1f} s ({info.state.messages} messages)")
            count, secs = args.ops, args.seconds
            figures["read by id"] = await timed(reads(reader, population), count, secs, pid)
            big, small = scope_token(0), scope_token(1)
            in_scope = {s: sum(1 for t in population.tasks if t.scope == s) for s in (big, small)}
            cases: dict[str, tuple[Reader, str, str | int, int]] = {
                "E page 1, big scope": (reader, layout.scope(big), big, 0),
                "E page 1, small scope": (reader, layout.scope(small), small, 0),
                "E page 10, big scope": (reader, layout.scope(big), big, 9),
                "index page 1, big scope": (index, index_filter(big), big, 0),
                "index page 1, small scope": (index, index_filter(small), small, 0),
                "index page 10, big scope": (index, index_filter(big), big, 9),
            }
            if sourced:
                cases["sourced page 1, big scope"] = (current, layout.current_scope(big), big, 0)
                cases["sourced page 1, small scope"] = (
                    current,
                    layout.current_scope(small),
                    small,
                    0,
                )
                cases["sourced page 10, big scope"] = (current, layout.current_scope(big), big, 9)
            if literal:
                cases["literal page 1, big scope"] = (listing, layout.listing(big), big, 0)
                cases["literal page 1, small scope"] = (listing, layout.listing(small), small, 0)
                cases["literal page 10, big scope"] = (listing, layout.listing(big), big, 9)
                cases["index page 1 + snapshots, big scope"] = (index, index_filter(big), big, 0)
                for state, label in ((WORKING, "working"), (COMPLETED, "completed")):
                    in_state = sum(
                        1
                        for i, t in enumerate(population.tasks)
                        if t.scope == big and population.state(i) == state
                    )
                    page = min(PAGE, in_state)
                    cases[f"index page 1, big scope, {label}"] = (
                        index,
                        _index_subject(Where("", "", big, "", ""), state),
                        page,
                        0,
                    )
                    cases[f"literal page 1, big scope, {label}"] = (
                        listing,
                        layout.listing(big, state),
                        page,
                        0,
                    )
            for name, (r, subject, scope, skip) in cases.items():
                if isinstance(scope, int):  # (a state's page: how many it finds)
                    expected = scope
                else:
                    expected = min(PAGE, in_scope[scope] - skip * PAGE)
                if expected < PAGE and skip:
                    continue  # (no 10th page at this size)
                before = await cursor(r, subject, skip) if skip else None
                if name.startswith("index page 1 + snapshots"):
                    op = _index_pages_with_snapshots(r, reader, subject, expected)
                elif r is index:
                    # (entries, not tasks: a page below a cursor needs no check of its own)
                    op = _index_pages(r, subject, before, expected)
                elif r is current:
                    op = _sourced_pages(r, subject, before, expected)
                elif r is listing:
                    op = _literal_pages(r, reader, subject, before, expected)
                else:
                    op = pages(r, subject, before, expected)
                figures[name] = await timed(op, count, secs, pid)
            if sourced:  # (an ``e`` last in E, as while tasks run: the check looks past it)
                probe = Where(
                    digest("probe"), owner_token(OWNERS), digest("probe"), digest("c"), "e", "2"
                )
                if "error" in await change(nc, layout, probe, 0, PAYLOAD["e"]):
                    raise Failed("the probe's event was refused")
                figures["read-your-writes check"] = await timed(
                    catch_ups(current, reader), count, secs, pid
                )
            owner = owner_token(0)
            unfinished = sum(
                1
                for t, end in zip(population.tasks, population.finished, strict=True)
                if t.owner == owner and not end
            )
            figures["sweep one owner"] = await timed(
                sweeps(reader, owner, unfinished), max(count // 10, 3), secs, pid
            )
            figures["sweep one owner"]["tasks found"] = unfinished
            if literal:
                figures["literal sweep one owner"] = await timed(
                    _literal_sweeps(listing, reader, owner, unfinished),
                    max(count // 10, 3),
                    secs,
                    pid,
                )
            for writers in args.writers:
                clients = [await nats.connect(cluster.urls[0]) for _ in range(writers)]
                try:
                    modes: dict[str, tuple[Layout | None, Writer, int]] = {
                        "write: E, 1 acked, filtered CAS": (None, e_writer(layout), 1),
                        "write: E, an s (sourced)": (None, e_writer(layout, "s"), 1),
                        "write: E, to an old task": (layout, alone, 1),
                        "write: E, to an old task, CAS on >": (fwc, alone, 1),
                        "write: 1 acked, literal CAS": (None, alone, 1),
                        "write: today, 3 acked in turn": (None, in_turn, 3),
                    }
                    for name, (old, write, acks) in modes.items():
                        if old is not None:  # (versions read now: the mode before wrote)
                            write = await old_writer(reader, population, old)
                        tag = f"r{rep}w{writers}{len(figures)}-"
                        found = await writes(clients, write, args, pid, tag)
                        figures[f"{name} x{writers}"] = {**found, "requests": acks}
                    if sourced:
                        tag = f"r{rep}w{writers}{len(figures)}-"
                        figures[f"lag: ack to index x{writers}"] = await lags(
                            clients, layout, args, tag
                        )
                    if literal:
                        tag = f"r{rep}w{writers}{len(figures)}-"
                        figures[f"lag: ack to literal index x{writers}"] = await lags(
                            clients, layout, args, tag, LISTING, f"{PREFIX}.ix.s.>"
                        )
                finally:
                    for client in clients:
                        await client.close()
            if literal:
                await s_costs(cluster.urls[0], nc, layout, reader, args, pid, rep, figures)
            elif sourced:  # the same ``s`` changes, paired, once the index is gone
                await nc.jetstream(timeout=TIMEOUT).delete_stream(CURRENT)
                for writers in args.writers:
                    clients = [await nats.connect(cluster.urls[0]) for _ in range(writers)]
                    try:
                        tag = f"r{rep}w{writers}{len(figures)}-"
                        found = await writes(clients, e_writer(layout, "s"), args, pid, tag)
                        name = f"write: E, an s, index deleted x{writers}"
                        figures[name] = {**found, "requests": 1}
                    finally:
                        for client in clients:
                            await client.close()
        finally:
            await nc.close()
    return figures


async def index_page(reader: Reader, subject: str, before: int | None) -> list[int]:
    """Today's listing: the ``PAGE`` index entries below ``before``, newest first (sequences)."""
    top = before if before is not None else await reader.end(subject)
    lo, between = await reader.start(subject, top, PAGE)
    found = (await reader.read(subject, lo, between))[-PAGE:]
    return [int((m.headers or {})[SEQUENCE]) for m in reversed(found)]


def _index_pages_with_snapshots(reader: Reader, origin: Reader, subject: str, expected: int) -> Op:
    """Today's page 1 and what a listing then reads: its tasks' last ``s`` and ``f`` in E."""

    async def op(_: int) -> int:
        start = reader.requests + origin.requests
        top = await reader.end(subject)
        lo, between = await reader.start(subject, top, PAGE)
        found = (await reader.read(subject, lo, between))[-PAGE:]
        scope = subject.split(".")[-2]
        tasks = [(m.data[:32].decode(), scope) for m in found]
        last = await origin.last_changes(tasks)
        if len(last) != expected:
            raise Failed(f"{len(last)} snapshots for an index page, not {expected}")
        return reader.requests + origin.requests - start

    return op


def _index_pages(reader: Reader, subject: str, before: int | None, expected: int) -> Op:
    async def op(_: int) -> int:
        start = reader.requests
        found = await index_page(reader, subject, before)
        if len(found) != expected:
            raise Failed(f"an index page of {len(found)}")
        return reader.requests - start

    return op


def _cell(values: Iterable[float]) -> str:
    v = list(values)
    if not v:
        return "-"
    fmt = ".1f" if statistics.median(v) < 10 else ".0f"
    return f"{statistics.median(v):{fmt}} [{min(v):{fmt}}-{max(v):{fmt}}]"


def report(results: dict[int, list[dict[str, dict[str, float]]]], args: argparse.Namespace) -> None:
    """Print one table per figure: a row per measure, a column per size."""
    sizes = list(results)
    print(
        f"\nlayout E ({args.order}, index {args.index}), one nats-server, file storage,"
        f" {args.reps} repetitions"
    )
    print("median [min-max]; per operation (a change, a read, a page, a sweep)")
    names: list[str] = []
    for reps in results.values():
        for figures in reps:
            names.extend(k for k in figures if k not in names)
    for key, title in (
        ("wall_us", "wall time, us"),
        ("server_cpu_us", "nats-server CPU, us"),
        ("requests", "requests"),
    ):
        print(f"\n{title:40} " + " ".join(f"{'N=' + format(n, ','):>24}" for n in sizes))
        for name in names:
            if name == "bytes per task" or (name == "fill" and key != "wall_us"):
                continue
            if name.startswith("lag") and key != "requests":
                continue
            cells = [
                _cell(f[name][key] for f in results[n] if key in f.get(name, {})) for n in sizes
            ]
            print(f"{name:40} " + " ".join(f"{c:>24}" for c in cells))
    print(f"\n{'bytes per task':40} " + " ".join(f"{'N=' + format(n, ','):>24}" for n in sizes))
    for key in (
        "stored",
        "on disk",
        "index stored",
        "sourced stored",
        "sourced on disk",
        "literal stored",
        "literal on disk",
        "literal entries",
    ):
        cells = [
            _cell(f["bytes per task"][key] for f in results[n] if key in f["bytes per task"])
            for n in sizes
        ]
        print(f"{key:40} " + " ".join(f"{c:>24}" for c in cells))
    lagged = [name for name in names if name.startswith("lag")]
    if lagged:
        print(f"\n{'lag, us':40} " + " ".join(f"{'N=' + format(n, ','):>24}" for n in sizes))
        for name in lagged:
            for key in ("lag_p50_us", "lag_p99_us"):
                cells = [_cell(f[name][key] for f in results[n] if name in f) for n in sizes]
                label = f"{name}, {key[4:7]}"
                print(f"{label:40} " + " ".join(f"{c:>24}" for c in cells))


async def main(args: argparse.Namespace) -> dict[int, list[dict[str, dict[str, float]]]]:
    """Every size, ``--reps`` times, each on a nats-server of its own."""
    results: dict[int, list[dict[str, dict[str, float]]]] = {n: [] for n in args.sizes}
    for rep in range(args.reps):
        for n in args.sizes:
            print(f"rep {rep + 1}, N={n}")
            results[n].append(await repetition(n, rep, args))
    return results


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_ints, default=[1000, 10000, 100000])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--order", choices=ORDERS, default="id-first")
    parser.add_argument("--changes", type=int, default=1000, help="per write mode")
    parser.add_argument("--writers", type=_ints, default=[1, 16])
    parser.add_argument("--ops", type=int, default=200, help="reads and pages per case")
    parser.add_argument("--seconds", type=float, default=10.0, help="per case, at most")
    parser.add_argument("--fill-seconds", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--index",
        choices=("today", "sourced", "literal"),
        default="today",
        help="sourced: also the index nats-server keeps by sourcing; literal: that and the"
        " literal one (see the module)",
    )
    arguments = parser.parse_args()
    if arguments.json is None:
        tail = "" if arguments.index == "today" else f"_{arguments.index}"
        name = f"nats_layout_{arguments.order}{tail}.json"
        arguments.json = ROOT / "bench" / "results" / name
    found = asyncio.run(main(arguments))
    report(found, arguments)
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    arguments.json.write_text(
        json.dumps(
            {
                "args": {**vars(arguments), "json": str(arguments.json)},
                "machine": platform.platform(),
                "results": {str(n): reps for n, reps in found.items()},
            },
            indent=1,
        )
    )
    print(f"\nwrote {arguments.json}")

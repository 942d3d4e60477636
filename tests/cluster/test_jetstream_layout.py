"""Spike for issue 41, layout E: one publish per change, on subjects that say who, where and what.

Nothing here uses the server's code: nats-py and raw JetStream requests, with the
layout's helpers from ``bench.nats_layout`` (so the benchmark's reader is the one
asserted here), on one node and on a 3-node cluster with the stream at R3. Each
test makes its own stream and prefix ``<p>``; a task's subjects are

    <p>.t.<task id>.<owner>.<scope>.<context>.<kind>      kind: s (snapshot), e (events), f (final)

and each change is one publish with a compare-and-set over all of them:
``Nats-Expected-Last-Subject-Sequence: <version>`` and
``Nats-Expected-Last-Subject-Sequence-Subject: <p>.t.<task id>.*.*.*.*`` (or ``>``,
the same subjects). What the tests
assert (nats-server 2.15.1):

* the check counts the task's last message of any kind, owner or scope; a stale
  version is refused (10071, nothing stored); of two racing writers one lands;
* a retry key (``Nats-Msg-Id``) on another task's subject is a duplicate acked
  with the first message's sequence; a refused publish does not register it;
  which of the duplicate and the compare-and-set is checked first differs with
  replication (see the test); after the duplicate window it is stored again;
* a task read by id is two round trips of direct gets (wildcards are allowed in
  ``last_by_subj``): its newest ``s`` and its ``f``, then the events after the ``s``;
* listing a scope or a context newest first gallops on ``Nats-Num-Pending`` and
  checks what lies below a cursor with ``multi_last``; a sweep finds a dead
  owner's unfinished tasks from its subjects and their tasks' last messages;
* per-message TTLs expire events before snapshots, and the stream's max age
  wins over a longer TTL but not over ``never``;
* a second stream sourcing the ``s`` and ``f`` through subject transforms, one
  message per subject (``Layout.sourced``), keeps one entry per task, its newest
  ``s`` or ``f`` whoever wrote it, with ``Nats-Stream-Source`` naming the message
  it copies; it lists newest first; a reader waits, bounded, until it holds its
  own write or all written before; it keeps its copies when E's expire (a copied
  ``Nats-TTL`` holds where it allows TTLs; a duplicate window of its own drops a
  reused retry key); it resumes after a node is killed, no entry lost or copied twice;
* the literal index (``Layout.literal``, E with a state token): each ``s`` and ``f``
  lands on ``<p>.ix.s.<scope>.<state>``, ``<p>.ix.c.<scope>.<context>`` and
  ``<p>.ix.o.<owner>``; a page lists each task once, at its latest change, skipping
  stale entries (checked against E); a state's page follows a state change; a sweep
  of the owner's entries finds exactly its unfinished tasks, before and after a claim.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig

from tests.support import natsserver
from tests.support.layout_e import (
    SOURCE,
    Entry,
    Layout,
    Reader,
    Source,
    Where,
    change,
    source,
)
from tests.support.spikes import add_stream

TIMEOUT = 10.0
_streams = itertools.count()


async def make_stream(
    nc: NATS, cluster: natsserver.Cluster, order: str = "id-first", **options: Any
) -> tuple[str, Layout]:
    """A stream of its own (per-message TTLs and direct gets allowed), at as many replicas as nodes.

    Waits while a new cluster elects its JetStream leader, and until the stream
    answers on the node of ``nc``. Returns its name and layout.
    """
    n = next(_streams)
    name, layout = f"LAYOUT_{n}", Layout(f"layout{n}", order)
    config = StreamConfig(
        name=name,
        subjects=[f"{layout.prefix}.t.>"],
        num_replicas=len(cluster.nodes),
        **{"allow_msg_ttl": True, "allow_direct": True, "duplicate_window": 60.0, **options},
    )
    async with asyncio.timeout(30):
        await add_stream(nc.jetstream(timeout=2.0), config)
        probe = Where("probe", "o", "s", "c", "s")
        while True:
            try:  # expects a version the probe's task does not have: stores nothing
                answer = await change(nc, layout, probe, 1)
                assert answer["error"]["err_code"] == 10071
                if not await Reader(nc, name, layout).get({"last_by_subj": f"{layout.prefix}.t.>"}):
                    return name, layout
            except nats.errors.NoRespondersError:
                pass
            await asyncio.sleep(0.01)  # sync-ok: paces polling while the stream's interest spreads


def task(name: str, owner: str = "o1", scope: str = "s1", context: str = "c1") -> Where:
    """A task's creating change (kind ``s``)."""
    return Where(name, owner, scope, context, "s")


def as_(where: Where, kind: str | None = None, owner: str | None = None) -> Where:
    """The same task, another kind or owner."""
    return Where(where.task, owner or where.owner, where.scope, where.context, kind or where.kind)


async def stored(nc: NATS, stream: str, layout: Layout) -> dict[str, int]:
    """How many messages the stream holds on each of its subjects."""
    info = await nc.jetstream(timeout=TIMEOUT).stream_info(
        stream, subjects_filter=f"{layout.prefix}.t.>"
    )
    return dict(info.state.subjects or {})


async def gone(reader: Reader, subject: str) -> None:
    """Return once no message is left on ``subject`` (the caller bounds the wait)."""
    while True:
        if not await reader.get({"last_by_subj": subject}):
            return
        await asyncio.sleep(0.05)  # sync-ok: polls the server's expiry


def wrong_last(seq: int) -> dict[str, Any]:
    """JetStream's refusal of a compare-and-set, the task's last sequence being ``seq``."""
    return {"code": 400, "err_code": 10071, "description": f"wrong last sequence: {seq}"}


async def test_a_change_is_stored_only_at_the_tasks_version_whatever_its_kind_owner_or_scope(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster)
        t1 = task("t1")
        assert await change(nc, e, t1, 0) == {"stream": stream, "seq": 1}
        # an ``e`` after the ``s``: checked against the ``s`` (another subject)
        assert (await change(nc, e, as_(t1, "e"), 1))["seq"] == 2
        before = await stored(nc, stream, e)
        # stale: a snapshot at the version before the ``e``, refused, nothing stored
        stale = await change(nc, e, t1, 1)
        assert stale == {"error": wrong_last(2), "stream": stream, "seq": 0}
        assert await stored(nc, stream, e) == before
        # another owner (a claim) at the right version, then its final change
        assert (await change(nc, e, as_(t1, owner="o2"), 2))["seq"] == 3
        assert (await change(nc, e, as_(t1, "f", "o2"), 3))["seq"] == 4
        # the old owner, at its old version: refused by the claim's messages
        assert (await change(nc, e, as_(t1, "e"), 2))["error"] == wrong_last(4)
        # creation (version 0) of an id that exists under any other tokens: refused
        for other in (task("t1", "o3"), task("t1", scope="s9", context="c9")):
            assert (await change(nc, e, other, 0))["error"] == wrong_last(4)
        # the filter may end in ``>`` (the same subjects)
        fwc = Layout(e.prefix, fwc=True)
        assert fwc.task("t1", "s1") == f"{e.prefix}.t.t1.>"
        assert (await change(nc, fwc, as_(t1, "f", "o2"), 3))["error"] == wrong_last(4)
        # ids are whole tokens: ``t10`` is not under ``t1.*.*.*.*``, nor ``t1`` under it
        assert (await change(nc, e, task("t10"), 0))["seq"] == 5
        assert (await change(nc, e, as_(t1, "e"), 4))["seq"] == 6
        assert await stored(nc, stream, e) == {
            f"{e.prefix}.t.t1.o1.s1.c1.s": 1,
            f"{e.prefix}.t.t1.o1.s1.c1.e": 2,
            f"{e.prefix}.t.t1.o2.s1.c1.s": 1,
            f"{e.prefix}.t.t1.o2.s1.c1.f": 1,
            f"{e.prefix}.t.t10.o1.s1.c1.s": 1,
        }


async def test_of_two_writers_racing_at_one_version_exactly_one_is_stored(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    other = await nats.connect(cluster.urls[-1])  # on R3 another node than ``nc``'s
    try:
        async with asyncio.timeout(40):
            stream, e = await make_stream(nc, cluster)
            t1 = task("t1")
            version = 0
            codes: set[int] = set()
            for i in range(20):  # (each round a new version both try to extend)
                answers = await asyncio.gather(
                    change(nc, e, as_(t1, "e" if i else "s"), version),
                    change(other, e, as_(t1, "e" if i else "s", "o2"), version),
                )
                assert sorted("error" in a for a in answers) == [False, True]
                version = next(a["seq"] for a in answers if "error" not in a)
                codes.add(next(a["error"]["err_code"] for a in answers if "error" in a))
            # 10071 once the winner is stored; on R3 10164 while it is still in flight
            assert codes <= {10071, 10164}
            assert sum((await stored(nc, stream, e)).values()) == 20
    finally:
        await other.close()


async def test_a_retry_key_on_another_tasks_subject_is_a_duplicate_of_the_first_message(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster)
        t1 = task("t1")
        assert (await change(nc, e, t1, 0, msg_id="k1"))["seq"] == 1
        assert (await change(nc, e, as_(t1, "e"), 1))["seq"] == 2
        # a retry through another instance: a new task id, the same key
        retry = await change(nc, e, task("t2", "o2"), 0, msg_id="k1")
        assert retry == {"stream": stream, "seq": 1, "duplicate": True}
        # the same key where the compare-and-set fails (t1 is at 2, not 0): on one
        # node the check comes first (10071), on R3 the duplicate (checked before
        # the proposal, server/jetstream_batching.go checkMsgHeadersPreClusteredProposal)
        both = await change(nc, e, t1, 0, msg_id="k1")
        if len(cluster.nodes) == 1:
            assert both == {"error": wrong_last(2), "stream": stream, "seq": 0}
        else:
            assert both == {"stream": stream, "seq": 1, "duplicate": True}
        # a refused publish does not register its key: a good one with it is stored
        assert (await change(nc, e, as_(t1, "e"), 1, msg_id="k2"))["error"] == wrong_last(2)
        assert await change(nc, e, as_(t1, "e"), 2, msg_id="k2") == {"stream": stream, "seq": 3}
        assert await stored(nc, stream, e) == {
            f"{e.prefix}.t.t1.o1.s1.c1.s": 1,
            f"{e.prefix}.t.t1.o1.s1.c1.e": 2,
        }


async def test_a_retry_key_is_stored_again_after_the_duplicate_window(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, duplicate_window=1.0)
        assert (await change(nc, e, task("t1"), 0, msg_id="k1"))["seq"] == 1
        assert (await change(nc, e, task("t2"), 0, msg_id="k1"))["duplicate"] is True
        began = asyncio.get_running_loop().time()
        while True:
            answer = await change(nc, e, task("t3"), 0, msg_id="k1")
            if not answer.get("duplicate"):
                break
            await asyncio.sleep(0.05)  # sync-ok: polls the server's window closing, bounded
        assert answer == {"stream": stream, "seq": 2}
        assert asyncio.get_running_loop().time() - began < 5.0


async def test_a_task_is_read_by_id_its_newest_snapshot_the_events_after_it_its_final(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster)
        reader = Reader(nc, stream, e)
        t1, t2 = task("t1"), task("t2", "o2", "s2", "c2")
        versions = {"t1": 0, "t2": 0}

        async def put(where: Where, data: bytes) -> int:
            ack = await change(nc, e, where, versions[where.task], data)
            versions[where.task] = ack["seq"]
            return int(ack["seq"])

        await put(t1, b"snap 1")
        await put(t2, b"other snap")
        for i in range(3):
            await put(as_(t1, "e"), f"event {i}".encode())
            await put(as_(t2, "e"), b"other event")
        # a snapshot again (every 32nd change, or a claim: another owner's token)
        snap = await put(as_(t1, owner="o9"), b"snap 2")
        event = await put(as_(t1, "e", "o9"), b"event 3")
        await put(as_(t2, "e"), b"other event")

        newest, events, final = await reader.task("t1", "s1")
        assert newest is not None and newest.data == b"snap 2"
        assert reader.entry(newest).seq == snap
        assert [(reader.entry(m).seq, m.data) for m in events] == [(event, b"event 3")]
        assert final is None
        # a wildcard is allowed in ``last_by_subj``: the task's last message of any kind
        (last,) = await reader.get({"last_by_subj": e.task("t1", "s1")})
        assert last.data == b"event 3"
        # ended (here by a survivor's sweep: another owner, no ``s`` of its own first)
        assert (await change(nc, e, as_(t1, "f", "o5"), event, b"final"))["seq"] == event + 2
        newest, events, final = await reader.task("t1", "s1")
        assert newest is not None and newest.data == b"snap 2"
        assert (events, final is not None and final.data) == ([], b"final")
        assert await reader.task("t3", "s1") == (None, [], None)


@pytest.mark.parametrize("order", ["id-first", "scope-first"])
async def test_a_scope_and_a_context_are_listed_newest_first_page_by_page(
    nc: NATS, cluster: natsserver.Cluster, order: str
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, order)
        reader = Reader(nc, stream, e)
        last: dict[str, int] = {}
        tasks = {f"t{i}": task(f"t{i}", f"o{i % 2}", f"s{i % 3}", f"c{i % 2}") for i in range(12)}

        async def put(name: str, kind: str) -> None:
            ack = await change(nc, e, as_(tasks[name], kind), last.get(name, 0))
            last[name] = ack["seq"]

        for name in tasks:  # scopes interleaved: s0 holds t0, t3, t6, t9
            await put(name, "s")
        for name, kind in (("t0", "e"), ("t1", "e"), ("t6", "e"), ("t3", "f"), ("t4", "e")):
            await put(name, kind)

        def newest(scope: str, context: str | None = None) -> list[str]:
            names = [
                n for n, t in tasks.items() if t.scope == scope and context in (None, t.context)
            ]
            return sorted(names, key=lambda n: -last[n])

        def names(page: list[Entry]) -> list[str]:
            return [entry.where.task for entry in page]

        scope = e.scope("s0")
        assert newest("s0") == ["t3", "t6", "t0", "t9"]
        assert names(await reader.page(scope, None, 10)) == newest("s0")
        first = await reader.page(scope, None, 2)
        assert names(first) == ["t3", "t6"]
        # a change to a task of the next page meanwhile moves it above the cursor:
        # the next page skips it (its older messages below are not its current one)
        await put("t0", "e")
        assert names(await reader.page(scope, first[-1].seq, 2)) == ["t9"]
        assert names(await reader.page(scope, None, 10)) == ["t0", "t3", "t6", "t9"]
        # by context, within the scope
        assert newest("s1", "c1") == ["t1", "t7"]
        assert names(await reader.page(e.context("s1", "c1"), None, 10)) == ["t1", "t7"]
        # the entries are each task's last message
        page = await reader.page(e.scope("s1"), None, 10)
        assert [(x.where.task, x.seq, x.where.kind) for x in page] == [
            (n, last[n], "e" if n in ("t1", "t4") else "s") for n in newest("s1")
        ]


@pytest.mark.parametrize("order", ["id-first", "scope-first"])
async def test_a_sweep_finds_a_dead_owners_unfinished_tasks_and_not_those_claimed_since(
    nc: NATS, cluster: natsserver.Cluster, order: str
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, order)
        reader = Reader(nc, stream, e)
        last: dict[str, int] = {}

        async def put(name: str, owner: str, kind: str) -> None:
            where = Where(name, owner, f"scope-of-{name}", "c", kind)
            ack = await change(nc, e, where, last.get(name, 0))
            last[name] = ack["seq"]

        writes = [
            ("t1", "o1", "s"), ("t1", "o1", "e"),                    # o1's, unfinished
            ("t2", "o1", "s"), ("t2", "o1", "e"), ("t2", "o1", "f"),  # ended
            ("t3", "o1", "s"), ("t3", "o2", "s"),                    # claimed by o2
            ("t4", "o1", "s"), ("t4", "o2", "s"), ("t4", "o2", "f"),  # claimed, ended
            ("t5", "o2", "s"),                                       # o2's
            ("t6", "o1", "s"), ("t6", "o2", "s"), ("t6", "o1", "e"),  # claimed back by o1
        ]  # fmt: skip
        for name, owner, kind in writes:
            await put(name, owner, kind)

        swept = await reader.sweep("o1")
        assert [(x.where.task, x.seq) for x in swept] == [("t1", last["t1"]), ("t6", last["t6"])]
        assert [x.where.task for x in await reader.sweep("o2")] == ["t3", "t5"]
        assert await reader.sweep("o3") == []
        # the sweep's claim of t1 by o3, then the sweep again
        await put("t1", "o3", "s")
        assert [x.where.task for x in await reader.sweep("o1")] == ["t6"]
        assert [x.where.task for x in await reader.sweep("o3")] == ["t1"]


async def test_events_expire_before_snapshots_and_max_age_wins_over_a_longer_ttl(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, max_age=3.0, duplicate_window=1.0)
        reader = Reader(nc, stream, e)
        t1, t2 = task("t1"), task("t2")
        assert (await change(nc, e, t1, 0, ttl="1h"))["seq"] == 1
        assert (await change(nc, e, as_(t1, "e"), 1, ttl="1s"))["seq"] == 2
        assert (await change(nc, e, t2, 0, ttl="never"))["seq"] == 3
        assert (await change(nc, e, as_(t2, "f"), 3, ttl="never"))["seq"] == 4
        began = asyncio.get_running_loop().time()
        await gone(reader, e.snapshots("t1", "s1", "e"))
        expired = asyncio.get_running_loop().time() - began
        # the event is gone, the snapshot stays: the task's version went back to 1, so
        # a writer holding the event's sequence is refused (and an unsnapshotted event lost)
        assert (await change(nc, e, as_(t1, "e"), 2))["error"] == wrong_last(1)
        newest, events, _ = await reader.task("t1", "s1")
        assert newest is not None and events == []
        # the stream's max age (3 s) removes the snapshot with its longer TTL, not ``never``
        await gone(reader, e.snapshots("t1", "s1"))
        aged = asyncio.get_running_loop().time() - began
        assert [
            reader.entry(m).seq for m in await reader.get({"multi_last": [e.task("t2", "s1")]})
        ] == [3, 4]
        assert expired < 3.0 and 2.0 < aged < 6.0, (expired, aged)


# -- the listing index nats-server keeps by itself: a stream sourcing E's s and f ------------


async def make_index(
    nc: NATS,
    cluster: natsserver.Cluster,
    origin: str,
    layout: Layout,
    suffix: str = "CURRENT",
    **options: Any,
) -> tuple[str, Reader]:
    """A stream sourcing ``origin``'s ``s`` and ``f``, one entry per task, at as many replicas.

    Waits until it answers direct gets on the node of ``nc``. Returns its name and reader.
    """
    name = f"{origin}_{suffix}"
    config = layout.sourced(name, origin, num_replicas=len(cluster.nodes), **options)
    js = nc.jetstream(timeout=2.0)
    reader = Reader(nc, name, layout)
    async with asyncio.timeout(30):
        await add_stream(js, config, reader.reached, pause=0.05)
    return name, reader


async def test_the_sourced_index_keeps_each_tasks_newest_snapshot_on_one_subject(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, "scope-first")
        name, index = await make_index(nc, cluster, stream, e)
        origin = Reader(nc, stream, e)
        t1, t2 = task("t1"), task("t2", "o1", "s2", "c2")
        v1 = (await change(nc, e, t1, 0, b"snap 1", msg_id="k1"))["seq"]
        v1 = (await change(nc, e, as_(t1, "e"), v1, b"event"))["seq"]
        v2 = (await change(nc, e, t2, 0, b"other snap"))["seq"]
        v2 = (await change(nc, e, as_(t2, "e"), v2, b"other event"))["seq"]
        await index.catch_up(origin)
        (entry,) = await index.get({"last_by_subj": e.current("s1", "c1", "t1")})
        assert entry.data == b"snap 1"
        # a claim by another owner: the same index subject, its ``s`` in place of the first
        claim = (await change(nc, e, as_(t1, owner="o2"), v1, b"snap 2"))["seq"]
        assert await index.wait_for(claim) >= 1
        (entry,) = await index.get({"last_by_subj": e.current("s1", "c1", "t1")})
        assert (entry.data, index.entry(entry)) == (
            b"snap 2",
            Entry(as_(t1, owner="o2"), index.entry(entry).seq, claim),
        )
        v1 = (await change(nc, e, as_(t1, "e", "o2"), claim, b"event 2"))["seq"]
        final = (await change(nc, e, as_(t1, "f", "o2"), v1, b"final"))["seq"]
        await index.catch_up(origin)
        # one entry per task, its newest ``s`` or ``f``; no ``e`` ever
        info = await nc.jetstream(timeout=TIMEOUT).stream_info(name, subjects_filter=">")
        assert info.state.subjects == {
            e.current("s1", "c1", "t1"): 1,
            e.current("s2", "c2", "t2"): 1,
        }
        assert (info.state.messages, info.state.last_seq) == (2, 4)  # 3 of t1's, 1 of t2's
        (entry,) = await index.get({"last_by_subj": e.current("s1", "c1", "t1")})
        assert entry.data == b"final"
        # the payload as in E; the headers less the compare-and-set; where it came from
        headers = dict(entry.headers or {})
        assert source(entry) == Source(stream, final, e.subject(as_(t1, "f", "o2")))
        assert not any(h.startswith("Nats-Expected") for h in headers)
        filters = "\x0c".join(t.src for t in e.transforms())
        dests = "\x0c".join(t.dest for t in e.transforms())
        assert headers[SOURCE].startswith(f"{stream} {final} {filters} {dests} ")
        (first,) = await index.get({"last_by_subj": e.current("s2", "c2", "t2")})
        assert index.entry(first) == Entry(t2, 2, 3)


async def test_the_sourced_index_lists_a_scope_and_a_context_newest_first_page_by_page(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, "scope-first")
        _, index = await make_index(nc, cluster, stream, e)
        origin = Reader(nc, stream, e)
        last: dict[str, int] = {}
        tasks = {f"t{i}": task(f"t{i}", f"o{i % 2}", f"s{i % 3}", f"c{i % 2}") for i in range(12)}

        async def put(name: str, kind: str) -> None:
            ack = await change(nc, e, as_(tasks[name], kind), last.get(name, 0))
            last[name] = ack["seq"]

        for name in tasks:  # scopes interleaved: s0 holds t0, t3, t6, t9
            await put(name, "s")
        for name, kind in (("t0", "e"), ("t6", "s"), ("t3", "f"), ("t9", "e")):
            await put(name, kind)
        await index.catch_up(origin)

        def names(page: list[Entry]) -> list[str]:
            return [entry.where.task for entry in page]

        # newest ``s`` or ``f`` first: an ``e`` (t0's, t9's) moves nothing
        scope = e.current_scope("s0")
        assert names(await index.latest(scope, None, 10)) == ["t3", "t6", "t9", "t0"]
        first = await index.latest(scope, None, 2)
        assert [(x.where.kind, x.origin) for x in first] == [("f", last["t3"]), ("s", last["t6"])]
        # a snapshot of a task of the next page moves it above the cursor: gone from below
        await put("t0", "s")
        await index.wait_for(last["t0"])
        assert names(await index.latest(scope, first[-1].seq, 2)) == ["t9"]
        assert names(await index.latest(scope, None, 10)) == ["t0", "t3", "t6", "t9"]
        # by context, within the scope
        assert names(await index.latest(e.current_context("s1", "c1"), None, 10)) == ["t7", "t1"]


async def test_the_sourced_index_is_read_after_a_write_within_a_bounded_wait(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, "scope-first")
        _, index = await make_index(nc, cluster, stream, e)
        origin = Reader(nc, stream, e)
        assert await index.catch_up(origin) == 1  # (both empty)
        loop = asyncio.get_running_loop()
        version, lags, polls = 0, [], []
        for i in range(40):
            ack = await change(nc, e, as_(task("t1"), "e" if i % 2 else "s"), version, b"x")
            version = ack["seq"]
            began = loop.time()
            if i % 2 == 0:  # the writer's own ``s``: waits for its sequence
                polls.append(await index.wait_for(version))
            else:  # any reader: waits for every ``s`` and ``f`` before E's end (an ``e`` here)
                polls.append(await index.catch_up(origin))
            lags.append(loop.time() - began)
            (entry,) = await index.get({"last_by_subj": e.current("s1", "c1", "t1")})
            assert index.entry(entry).origin == (version if i % 2 == 0 else version - 1)
        # not at once, every time: the index is a hop behind the ack
        assert max(lags) < 1.0 and max(polls) >= 1, (lags, polls)


async def test_the_sourced_index_keeps_its_copy_when_e_expires_and_honours_copied_ttls(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, "scope-first", max_age=2.0, duplicate_window=1.0)
        _, index = await make_index(nc, cluster, stream, e)
        _, ttls = await make_index(nc, cluster, stream, e, "TTL", allow_msg_ttl=True)
        _, dedup = await make_index(nc, cluster, stream, e, "DEDUP", duplicate_window=60.0)
        origin = Reader(nc, stream, e)
        a = (await change(nc, e, task("t1"), 0, b"one", ttl="1s", msg_id="k1"))["seq"]
        b = (await change(nc, e, task("t2"), 0, b"two"))["seq"]
        while True:  # the key again, on another task: stored once E's window (1 s) is over
            answer = await change(nc, e, task("t3"), 0, b"three", msg_id="k1")
            if not answer.get("duplicate"):
                break
            await asyncio.sleep(0.05)  # sync-ok: polls the server's window closing, bounded
        c = answer["seq"]
        for reader in (index, ttls, dedup):
            await reader.catch_up(origin)
        await gone(origin, e.scope("s1"))  # t1 by its TTL (1 s), the others by E's max age (2 s)
        # the index without TTLs keeps all (its own limits); with TTLs, those without
        assert [index.entry(m).origin for m in await index.get({"multi_last": [">"]})] == [a, b, c]
        assert [ttls.entry(m).origin for m in await ttls.get({"multi_last": [">"]})] == [b, c]
        # the key is copied (t1's entry has it): an index with a duplicate window (a sourcing
        # stream has none unless set) drops t3 as a duplicate of t1, silently
        (entry,) = await index.get({"last_by_subj": e.current("s1", "c1", "t1")})
        assert (entry.headers or {}).get("Nats-Msg-Id") == "k1"
        assert [dedup.entry(m).origin for m in await dedup.get({"multi_last": [">"]})] == [a, b]
        info = await nc.jetstream(timeout=TIMEOUT).stream_info(index.stream)
        assert info.config.duplicate_window in (None, 0)


async def put_retrying(client: NATS, layout: Layout, where: Where, version: int, key: str) -> int:
    """A change with a retry key, tried again while the stream has no leader; its sequence."""
    headers = layout.headers(where, version, msg_id=key)
    while True:
        try:
            reply = await client.request(layout.subject(where), b"x", 1.0, headers=headers)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            continue
        answer = json.loads(reply.data)
        if "error" not in answer:
            return int(answer["seq"])
        assert answer["error"]["code"] == 503, answer
        await asyncio.sleep(0.05)  # sync-ok: paces retries while the stream elects a leader


async def test_the_sourced_index_resumes_after_a_node_is_killed_without_gaps_or_copies(
    nc: NATS, cluster: natsserver.Cluster, request: pytest.FixtureRequest
) -> None:
    if len(cluster.nodes) == 3:  # (a finding, in docs/decisions/0001; not a defence of ours)
        request.applymarker(
            pytest.mark.xfail(
                reason="on R3, with the index's leader killed, the sourced index had not "
                "caught up within the test's 40 s in 2-3 runs of 8",
                strict=False,
            )
        )
    async with asyncio.timeout(40):
        stream, e = await make_stream(nc, cluster, "scope-first")
        name, _ = await make_index(nc, cluster, stream, e)
        js = nc.jetstream(timeout=TIMEOUT)
        # the node to kill: the index's leader (on one node, the only one)
        leader = (await js.stream_info(name)).cluster
        killed = next(n for n in cluster.nodes if leader is None or leader.leader in (None, n.name))
        alive = next((n for n in cluster.nodes if n is not killed), killed)
        versions: dict[str, int] = {}

        async def burst(client: NATS, round_: int) -> None:  # an ``s`` and an ``e`` per task
            async def one(name: str) -> None:
                for kind in "se":
                    where = as_(task(name), kind)
                    key = f"{name}-{round_}-{kind}"
                    versions[name] = await put_retrying(
                        client, e, where, versions.get(name, 0), key
                    )

            await asyncio.gather(*(one(f"t{i}") for i in range(50)))

        await burst(nc, 0)  # acked; the index may still be behind when the node dies
        killed.kill()
        other = await nats.connect(alive.url) if alive is not killed else None
        try:
            if other is not None:  # R3: writes go on while a node is down
                await burst(other, 1)
            await asyncio.to_thread(killed.start)
            client = other or await nats.connect(killed.url)
            try:
                await burst(client, 2)
                index = Reader(client, name, e)
                origin = Reader(client, stream, e)
                while True:  # until caught up at once (on R3 another replica may answer next)
                    try:
                        if await index.catch_up(origin) == 1:
                            break
                    except nats.errors.NoRespondersError:  # (a node's interest spreading)
                        await asyncio.sleep(0.05)  # sync-ok: paces polling, bounded
                info = await client.jetstream(timeout=TIMEOUT).stream_info(name, ">")
                # one entry per task, its last ``s``, and each ``s`` sourced once: no copies
                assert len(info.state.subjects or {}) == 50
                snapshots = sum(
                    count
                    for subject, count in (await stored(client, stream, e)).items()
                    if subject.endswith(".s")
                )
                assert (info.state.messages, info.state.last_seq) == (50, snapshots)
                last = await index.get({"multi_last": [e.current_scope("s1")]})
                snaps = [e.snapshots(f"t{i}", "s1") for i in range(50)]
                e_last = await origin.get({"multi_last": snaps})
                assert sorted(index.entry(m).origin for m in last) == sorted(
                    origin.entry(m).seq for m in e_last
                )
            finally:
                if client is not other:
                    await client.close()
        finally:
            if other is not None:
                await other.close()


# -- the literal index: E's s and f copied to few literal subjects, verified on read ---------


async def make_literal(
    nc: NATS, cluster: natsserver.Cluster, origin: str, layout: Layout
) -> tuple[str, Reader]:
    """A stream sourcing ``origin``'s ``s`` and ``f`` into the literal index, at as many replicas.

    Waits until it answers direct gets on the node of ``nc``. Returns its name and reader.
    """
    name = f"{origin}_LISTING"
    config = layout.literal(name, origin, num_replicas=len(cluster.nodes))
    js = nc.jetstream(timeout=2.0)
    reader = Reader(nc, name, layout)
    async with asyncio.timeout(30):
        await add_stream(js, config, reader.reached, pause=0.05)
    return name, reader


async def literal_setup(
    nc: NATS, cluster: natsserver.Cluster
) -> tuple[str, Layout, Reader, Reader, str]:
    """A scope-first stream with the state token and its literal index: name, layout, readers."""
    n = next(_streams)
    layout = Layout(f"layout{n}", "scope-first", states=True)
    name = f"LAYOUT_{n}"
    config = StreamConfig(
        name=name,
        subjects=[f"{layout.prefix}.t.>"],
        num_replicas=len(cluster.nodes),
        allow_direct=True,
    )
    js = nc.jetstream(timeout=2.0)
    origin = Reader(nc, name, layout)
    async with asyncio.timeout(30):
        await add_stream(
            js, config, lambda: origin.get({"last_by_subj": f"{layout.prefix}.t.>"}), pause=0.05
        )
    index_name, index = await make_literal(nc, cluster, name, layout)
    return name, layout, origin, index, index_name


class Tasks:
    """Tasks written one change at a time, each change waited for in every part of the index."""

    def __init__(self, nc: NATS, layout: Layout, index: Reader) -> None:
        self.nc, self.layout, self.index = nc, layout, index
        self.last: dict[str, int] = {}
        self.where: dict[str, Where] = {}

    async def put(self, where: Where) -> int:
        """Write one change at the task's version; return once the index holds it (if s or f)."""
        ack = await change(self.nc, self.layout, where, self.last.get(where.task, 0))
        assert "error" not in ack, ack
        self.last[where.task], self.where[where.task] = ack["seq"], where
        if where.kind != "e":
            p = self.layout.prefix
            for part in "sco":
                await self.index.wait_for(ack["seq"], f"{p}.ix.{part}.>")
        return int(ack["seq"])


async def test_the_literal_index_lists_each_task_once_at_its_latest_change_skipping_stale_entries(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        _, e, origin, index, name = await literal_setup(nc, cluster)
        w = Tasks(nc, e, index)
        for i in range(6):  # scope s0: t0, t2, t4 (context c0: t0, t4); s1: the others
            await w.put(Where(f"t{i}", "o1", f"s{i % 2}", f"c{i % 4 // 2 * 2 + i % 2}", "s", "1"))
        await w.put(Where("t0", "o1", "s0", "c0", "s", "2"))  # working
        await w.put(Where("t0", "o1", "s0", "c0", "e", "2"))  # an event: no entry
        await w.put(Where("t2", "o1", "s0", "c2", "f", "6"))  # completed
        await w.put(Where("t4", "o1", "s0", "c0", "s", "2"))  # working
        # every s and f is an entry on each of three literal subjects, stale ones included
        info = await nc.jetstream(timeout=TIMEOUT).stream_info(name, subjects_filter=">")
        p = e.prefix
        assert info.state.subjects == {
            f"{p}.ix.s.s0.1": 3,
            f"{p}.ix.s.s0.2": 2,
            f"{p}.ix.s.s0.6": 1,
            f"{p}.ix.s.s1.1": 3,
            f"{p}.ix.c.s0.c0": 4,
            f"{p}.ix.c.s0.c2": 2,
            f"{p}.ix.c.s1.c1": 2,
            f"{p}.ix.c.s1.c3": 1,
            f"{p}.ix.o.o1": 9,
        }

        def names(page: list[Entry]) -> list[str]:
            return [x.where.task for x in page]

        # each task once, at its latest change; its stale entries skipped
        page = await index.listing(e.listing("s0"), None, 10, origin)
        assert [(x.where.task, x.where.state, x.origin) for x in page] == [
            ("t4", "2", w.last["t4"]),
            ("t2", "6", w.last["t2"]),
            ("t0", "2", w.last["t0"] - 1),  # (its ``s``, not the ``e`` after it)
        ]
        first = await index.listing(e.listing("s0"), None, 2, origin)
        assert names(first) == ["t4", "t2"]
        assert names(await index.listing(e.listing("s0"), first[-1].seq, 2, origin)) == ["t0"]
        # a change of a task of the next page moves it above the cursor: gone from below
        await w.put(Where("t0", "o1", "s0", "c0", "s", "3"))  # input-required
        assert names(await index.listing(e.listing("s0"), first[-1].seq, 2, origin)) == []
        assert names(await index.listing(e.listing("s0"), None, 10, origin)) == ["t0", "t4", "t2"]
        # by state, through the state change: t0 left ``working``, its entry there is stale
        assert names(await index.listing(e.listing("s0", "2"), None, 10, origin)) == ["t4"]
        assert names(await index.listing(e.listing("s0", "3"), None, 10, origin)) == ["t0"]
        assert names(await index.listing(e.listing("s0", "1"), None, 10, origin)) == []
        assert names(await index.listing(e.listing("s1", "1"), None, 10, origin)) == [
            "t5",
            "t3",
            "t1",
        ]
        # by context
        assert names(await index.listing(e.listing_context("s0", "c0"), None, 10, origin)) == [
            "t0",
            "t4",
        ]


async def test_a_sweep_through_the_owner_index_finds_exactly_its_unfinished_tasks_after_a_claim(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        _, e, origin, index, _ = await literal_setup(nc, cluster)
        w = Tasks(nc, e, index)

        def at(name: str, owner: str, kind: str, state: str) -> Where:
            return Where(name, owner, f"scope-of-{name}", "c", kind, state)

        writes = [
            ("t1", "o1", "s", "1"), ("t1", "o1", "e", "1"),                          # o1's
            ("t2", "o1", "s", "1"), ("t2", "o1", "s", "2"), ("t2", "o1", "f", "6"),  # ended
            ("t3", "o1", "s", "1"), ("t3", "o2", "s", "2"),                          # claimed
            ("t4", "o1", "s", "1"), ("t4", "o2", "s", "1"), ("t4", "o2", "f", "6"),  # claimed, done
            ("t5", "o2", "s", "2"),                                                  # o2's
            ("t6", "o1", "s", "1"), ("t6", "o2", "s", "1"), ("t6", "o1", "s", "2"),  # back to o1
        ]  # fmt: skip
        for name, owner, kind, state in writes:
            await w.put(at(name, owner, kind, state))

        def swept(entries: list[Entry]) -> list[tuple[str, int]]:
            return [(x.where.task, x.seq) for x in entries]

        assert swept(await index.owner_sweep("o1", origin)) == [
            ("t1", w.last["t1"]),
            ("t6", w.last["t6"]),
        ]
        assert swept(await index.owner_sweep("o1", origin)) == swept(await origin.sweep("o1"))
        assert [x.where.task for x in await index.owner_sweep("o2", origin)] == ["t3", "t5"]
        assert await index.owner_sweep("o3", origin) == []
        # the sweep's claim of t1 by o3 (an ``s`` of its own), then the sweeps again
        await w.put(at("t1", "o3", "s", "1"))
        assert [x.where.task for x in await index.owner_sweep("o1", origin)] == ["t6"]
        assert [x.where.task for x in await index.owner_sweep("o3", origin)] == ["t1"]
        assert [x.where.task for x in await index.owner_sweep("o2", origin)] == ["t3", "t5"]

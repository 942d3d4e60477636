"""The listing index on JetStream (``jetstream.index``), on a real nats-server: deep pages
found by galloping agree with a model, a status filter finds a task whose status is later
than its write, stale entries are skipped, and the index is used only while the whole
cluster keeps it (an older version's heartbeat turns it off; its snapshots are indexed
when it leaves)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace

import pytest
from a2a.types.a2a_pb2 import StreamResponse, Task, TaskState

from a2a_grpc_server._internal.jetstream.conn import (
    EVENTS_STREAM,
    INDEX_STREAM,
    TASKS_BUCKET,
    NatsConfig,
    connect,
)
from a2a_grpc_server._internal.jetstream.formats import Formats
from a2a_grpc_server._internal.jetstream.index import MARKER, IndexEntry
from a2a_grpc_server._internal.jetstream.journal import (
    SWEEP_BATCH,
    JetStreamJournal,
    Snapshot,
    encode,
)
from a2a_grpc_server._internal.jetstream.lease import Lease
from a2a_grpc_server._internal.jetstream.logjournal import LogJournal
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.store import ClusterJournal
from a2a_grpc_server._internal.journal import Change, InvalidPageTokenError, PageTokens, TaskQuery
from a2a_grpc_server._internal.model import taskops
from a2a_grpc_server._internal.model.scope import scope_key
from a2a_grpc_server._internal.obs.metrics import Metrics
from tests.support import formatfixtures as fx
from tests.support import natsserver

S = TaskState
ALICE, BOB = scope_key("", "alice"), scope_key("", "bob")


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]


class Cluster:
    """One journal on a fresh set of assets, its formats settled (a cluster of one)."""

    def __init__(self, journal: JetStreamJournal, formats: Formats) -> None:
        self.journal, self.formats = journal, formats


@pytest.fixture
async def cluster(nats_url: str) -> AsyncIterator[Cluster]:
    conn = await connect(NatsConfig(servers=[nats_url]))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    formats = Formats()
    formats.settle()
    journal = JetStreamJournal(requests, conn.js, "i-1", formats=formats)
    try:
        yield Cluster(journal, formats)
    finally:
        await journal.close()
        await requests.close()
        await conn.js.delete_key_value(TASKS_BUCKET)
        await conn.js.delete_stream(EVENTS_STREAM)
        await conn.js.delete_stream(INDEX_STREAM)
        await conn.close()


def task(task_id: str, context: str, state: TaskState) -> Task:
    t = taskops.new_task(task_id, context, None)
    t.status.state = state
    return t


def change(seq: int, to: Task) -> Change:
    return Change(seq, StreamResponse(task=to).SerializeToString(), to.status.state)


async def walk(journal: JetStreamJournal, query: TaskQuery) -> list[str]:
    ids: list[str] = []
    page = await journal.list(query)
    for _ in range(1000):
        ids += [t.id for t in page.tasks]
        if not page.next_page_token:
            return ids
        page = await journal.list(replace(query, page_token=page.next_page_token))
    raise AssertionError("more than 1000 pages")


async def test_deep_pages_through_the_index_agree_with_a_model(cluster: Cluster) -> None:
    """600 tasks (two scopes, three contexts, three states; a third written again later):
    every filter's pages, small and large, in last-write order, and each page's count."""
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    assert journal.listing.indexed
    rng = random.Random(600)
    states = [S.TASK_STATE_SUBMITTED, S.TASK_STATE_WORKING, S.TASK_STATE_COMPLETED]
    model: dict[str, tuple[str, str, int]] = {}
    order: list[str] = []
    live: dict[str, tuple[Task, int]] = {}
    for n in range(600):
        scope = ALICE if n % 5 else BOB
        t = task(f"t{n:04}", f"c{rng.randrange(3)}", rng.choice(states))
        version = await journal.create(t, [change(1, t)], scope=scope)
        model[t.id] = (scope, t.context_id, t.status.state)
        order.append(t.id)
        if t.status.state != S.TASK_STATE_COMPLETED:
            live[t.id] = (t, version)
    for task_id in sorted(live)[::3]:  # written again: to the front, in a new state
        t, version = live[task_id]
        t.status.state = S.TASK_STATE_INPUT_REQUIRED
        await journal.update(t, version, [change(2, t)])
        model[task_id] = (model[task_id][0], t.context_id, t.status.state)
        order = [i for i in order if i != task_id] + [task_id]
    await journal.close()  # (the entries replaced are deleted in the background: let them)
    for context, state, size in [
        ("", S.TASK_STATE_UNSPECIFIED, 20),
        ("c1", S.TASK_STATE_UNSPECIFIED, 13),
        ("", S.TASK_STATE_INPUT_REQUIRED, 11),
        ("c2", S.TASK_STATE_COMPLETED, 9),
        ("c1", S.TASK_STATE_WORKING, 50),
    ]:
        want = [
            i
            for i in reversed(order)
            if model[i][0] == ALICE
            and context in ("", model[i][1])
            and state in (S.TASK_STATE_UNSPECIFIED, model[i][2])
        ]
        query = TaskQuery(context, state, page_size=size, scope=ALICE)
        assert await walk(journal, query) == want, (context, state, size)
        assert (await journal.list(query)).total_size == len(want)
    bobs = [i for i in reversed(order) if model[i][0] == BOB]
    assert await walk(journal, TaskQuery(page_size=100, scope=BOB)) == bobs


async def test_a_status_filter_finds_a_task_whose_status_is_later_than_its_write(
    cluster: Cluster,
) -> None:
    """An agent that stamps its own status far ahead: the task is written first, 300 after
    it; a listing from a time past all the others' finds it (and counts it) however deep."""
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    ahead = task("ahead", "c", S.TASK_STATE_WORKING)
    ahead.status.timestamp.FromSeconds(int(time.time()) + 86_400)
    await journal.create(ahead, [change(1, ahead)], scope=ALICE)
    for n in range(300):
        t = task(f"t{n:03}", "c", S.TASK_STATE_WORKING)
        await journal.create(t, [change(1, t)], scope=ALICE)
    later = (int(time.time()) + 3600) * 1_000_000_000
    for query in (
        TaskQuery(status_after_ns=later, scope=ALICE),
        TaskQuery("c", S.TASK_STATE_WORKING, status_after_ns=later, scope=ALICE),
    ):
        page = await journal.list(query)
        assert ([t.id for t in page.tasks], page.total_size) == (["ahead"], 1)
    assert (await journal.list(TaskQuery(status_after_ns=later, scope=BOB))).tasks == []
    recent = TaskQuery(page_size=400, status_after_ns=(int(time.time()) - 600) * 10**9, scope=ALICE)
    listed = await journal.list(recent)
    assert len(listed.tasks) == 301 and listed.total_size == 301
    assert listed.tasks[-1].id == "ahead", "still in write order"


async def test_an_entry_its_snapshot_does_not_name_is_skipped(cluster: Cluster) -> None:
    """An instance that died between indexing a write and writing its snapshot leaves
    entries its task's snapshot does not name: listings skip them (no task twice, none in
    a state it is not in)."""
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    for n in range(5):
        t = task(f"t{n}", "c", S.TASK_STATE_WORKING)
        await journal.create(t, [change(1, t)], scope=ALICE)
    index = journal._index  # (the crash, played: entries published, no snapshot written)
    await index.add(ALICE, "c", S.TASK_STATE_COMPLETED, "t1", 0)
    await index.add(ALICE, "c", S.TASK_STATE_WORKING, "t3", 0)
    assert await walk(journal, TaskQuery(page_size=2, scope=ALICE)) == [
        "t4",
        "t3",
        "t2",
        "t1",
        "t0",
    ]
    done = await journal.list(TaskQuery(state=S.TASK_STATE_COMPLETED, scope=ALICE))
    assert done.tasks == []


async def test_the_index_is_used_only_while_every_instance_keeps_it(cluster: Cluster) -> None:
    """An instance of the version before the index joins: the marker goes, listings read
    every snapshot, and what that instance writes (no entries) is listed; once it leaves,
    its snapshots are indexed, the marker is back, and listings use the index again."""
    journal, formats = cluster.journal, cluster.formats
    await journal.listing.keep_index({"i-1"})
    assert journal.listing.indexed
    first = task("first", "c", S.TASK_STATE_COMPLETED)
    await journal.create(first, [change(1, first)], scope=ALICE)
    formats.heard("old-1", fx.load("heartbeat-2")[1])  # (formats 1 and 2, no features)
    assert journal.listing.index_due()
    await journal.listing.keep_index({"i-1", "old-1"})
    assert not journal.listing.indexed and not await journal._index.built()
    # The old instance writes a task: a snapshot without entries, as that version does.
    old = task("olds", "c", S.TASK_STATE_COMPLETED)
    value = encode("old-1", old, 1, 0, ALICE, 2)
    await journal.snapshots.write("olds", value, 0)
    scanning = await journal.list(TaskQuery(scope=ALICE))
    assert [t.id for t in scanning.tasks] == ["olds", "first"]
    formats.gone("old-1")
    await journal.listing.keep_index({"i-1"})
    assert journal.listing.indexed and await journal._index.built()
    indexed = await journal.list(TaskQuery(scope=ALICE, page_size=1))
    assert ([t.id for t in indexed.tasks], indexed.total_size) == (["olds"], 2)
    rest = await journal.list(TaskQuery(scope=ALICE, page_token=indexed.next_page_token))
    assert [t.id for t in rest.tasks] == ["first"]


async def test_each_instances_unfinished_tasks_are_read_from_its_own_entries(
    cluster: Cluster, nats_url: str
) -> None:
    """Random creates, ends, releases and claims on two instances: what the index says each
    instance runs is what reading every snapshot says, task for task, after every round."""
    a = cluster.journal
    conn = await connect(NatsConfig(servers=[nats_url], instance_id="i-2"))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    b = JetStreamJournal(requests, conn.js, "i-2", formats=cluster.formats)
    rng = random.Random(77)
    live: dict[str, tuple[JetStreamJournal, Task, int]] = {}
    try:
        for round_ in range(5):
            for n in range(30):
                op = rng.random()
                if not live or op < 0.4:
                    writer = rng.choice([a, b])
                    state = rng.choice([S.TASK_STATE_WORKING, S.TASK_STATE_COMPLETED])
                    t = task(f"t{round_}-{n}", "c", state)
                    version = await writer.create(t, [change(1, t)], scope=ALICE)
                    if state == S.TASK_STATE_WORKING:
                        live[t.id] = (writer, t, version)
                    continue
                task_id = rng.choice(sorted(live))
                writer, t, version = live.pop(task_id)
                if op < 0.6:  # it ends
                    t.status.state = S.TASK_STATE_COMPLETED
                    await writer.update(t, version, [change(version + 1, t)])
                elif op < 0.8:  # it asks for input; its owner releases it; the other claims it
                    t.status.state = S.TASK_STATE_INPUT_REQUIRED
                    version = await writer.update(t, version, [change(2, t)])
                    assert await writer.ownership.release(t.id, writer.owner)
                    claimer = b if writer is a else a
                    claimed = await claimer.ownership.claim(t.id)
                    assert claimed is not None
                    live[t.id] = (claimer, claimed.task, claimed.version)
                else:  # it goes on (a snapshot every few changes keeps its entry)
                    t.status.state = S.TASK_STATE_WORKING
                    seq = len(t.history) + version  # (any number past the last)
                    version = await writer.update(t, version, [change(seq, t)])
                    live[task_id] = (writer, t, version)
            scanned = {(s.owner, s.task().id) for s in await a.ownership.unfinished()}
            for owner in ("i-1", "i-2"):
                indexed = await a.ownership.owned_unfinished(lambda o, owner=owner: o == owner)  # type: ignore[misc]
                want = {i for o, i in scanned if o == owner}
                assert {s.task().id for s in indexed} == want, (round_, owner)
                assert {i for i, (w, _, _) in live.items() if w.owner == owner} == want
            await a.close()  # (the entries replaced are deleted in the background: let them)
            await b.close()
            owners = await a._index.owners()
            held = sorted(
                [e.task_id for subject in owners.values() for e in await a._index.all_of(subject)]
            )
            assert held == sorted(live), "one entry per unfinished task: none left behind"
    finally:
        await b.close()
        await requests.close()
        await conn.close()


async def test_a_marker_not_renewed_for_ten_minutes_is_rebuilt(cluster: Cluster) -> None:
    """A cluster that was down (or ran an older version alone) past the marker's freshness:
    an instance starting does not trust it; the smallest live instance indexes what has no
    entries and renews it."""
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    assert await journal.listing.index_fresh()
    old = task("old", "c", S.TASK_STATE_WORKING)  # written with no entries, as 0.1.0 does
    await journal.snapshots.write("old", encode("gone", old, 1, 0, ALICE, 2), 0)
    stale = json.dumps({"format": 1, "by": "i-1", "at": time.time_ns() - 601 * 10**9, "kv_seq": 0})
    await journal._requests.publish(MARKER, stale.encode(), {"Nats-Rollup": "sub"}, 5.0)
    restarted = JetStreamJournal(journal._requests, journal._js, "i-1", formats=cluster.formats)
    assert not await restarted.listing.index_fresh()
    await restarted.listing.keep_index({"i-1", "i-9"})
    assert await restarted.listing.index_fresh() and restarted.listing.indexed
    lost = await restarted.ownership.owned_unfinished(lambda owner: owner == "gone")
    assert [s.task().id for s in lost] == ["old"]
    await restarted.close()


async def test_a_sweep_reads_only_the_lost_owners_tasks(cluster: Cluster, nats_url: str) -> None:
    """A lost instance ran 10 tasks and a live one 200: finding the lost one's unfinished
    tasks reads 10 snapshots (counted), not the bucket."""
    conn = await connect(NatsConfig(servers=[nats_url], instance_id="lost"))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    lost = JetStreamJournal(requests, conn.js, "lost", formats=cluster.formats)
    live = cluster.journal
    try:
        for n in range(200):
            t = task(f"live-{n}", "c", S.TASK_STATE_WORKING)
            await live.create(t, [change(1, t)], scope=ALICE)
        for n in range(10):
            t = task(f"lost-{n}", "c", S.TASK_STATE_WORKING)
            await lost.create(t, [change(1, t)], scope=BOB)
        await live.listing.keep_index({"i-1"})
        reads: list[str] = []
        read = live.snapshot

        async def counted(task_id: str) -> object:
            reads.append(task_id)
            return await read(task_id)

        live.snapshot = counted  # type: ignore[method-assign, assignment]
        found = await live.ownership.owned_unfinished(lambda owner: owner not in {"i-1"})
        assert sorted(s.task().id for s in found) == sorted(f"lost-{n}" for n in range(10))
        assert sorted(reads) == sorted(f"lost-{n}" for n in range(10)), "only the lost one's"
    finally:
        await lost.close()
        await requests.close()
        await conn.close()


async def test_an_entry_naming_another_scopes_task_is_never_listed(cluster: Cluster) -> None:
    """An entry on alice's subjects that names bob's task (a writer that died mid-write,
    or anyone who can publish on the bus): alice's listings never return bob's task."""
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    bobs = task("bobs", "c", S.TASK_STATE_WORKING)
    await journal.create(bobs, [change(1, bobs)], scope=BOB)
    alices = task("alices", "c", S.TASK_STATE_WORKING)
    await journal.create(alices, [change(1, alices)], scope=ALICE)
    await journal._index.add(ALICE, "c", S.TASK_STATE_WORKING, "bobs", 0)
    for query in (
        TaskQuery(scope=ALICE),
        TaskQuery("c", scope=ALICE),
        TaskQuery(state=S.TASK_STATE_WORKING, scope=ALICE),
        TaskQuery(status_after_ns=1, scope=ALICE),
    ):
        assert [t.id for t in (await journal.list(query)).tasks] == ["alices"], query
    assert [t.id for t in (await journal.list(TaskQuery(scope=BOB))).tasks] == ["bobs"]


async def test_a_fresh_marker_after_an_older_version_ran_alone_is_rebuilt(
    cluster: Cluster,
) -> None:
    """Every instance rolled back to a version before the index and forward again within
    the marker's ten minutes: nobody heard the older one, but what it wrote since the
    marker's last renewal has no entries, so an instance that starts does not trust it."""
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    before = task("before", "c", S.TASK_STATE_COMPLETED)
    await journal.create(before, [change(1, before)], scope=ALICE)
    assert await journal.listing.index_fresh()
    old = task("olds", "c", S.TASK_STATE_WORKING)  # written with no entries, as 0.1.0 does
    await journal.snapshots.write("olds", encode("old-1", old, 1, 0, ALICE, 2), 0)
    restarted = JetStreamJournal(journal._requests, journal._js, "i-1", formats=cluster.formats)
    assert not await restarted.listing.index_fresh()
    await restarted.listing.keep_index({"i-1"})
    assert restarted.listing.indexed and await restarted.listing.index_fresh()
    listed = await restarted.list(TaskQuery(scope=ALICE))
    assert [t.id for t in listed.tasks] == ["olds", "before"]
    lost = await restarted.ownership.owned_unfinished(lambda owner: owner == "old-1")
    assert [s.task().id for s in lost] == ["olds"]
    await restarted.close()


async def test_a_task_running_past_the_index_ttl_keeps_an_owner_entry(nats_url: str) -> None:
    """Entries expire with the index's max age (task_ttl); a task running longer keeps its
    snapshot alive by writing it, and its owner entry is published again before it can
    expire, so a sweep still finds it."""
    conn = await connect(NatsConfig(servers=[nats_url], task_ttl=2.0))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    formats = Formats()
    formats.settle()
    journal = JetStreamJournal(
        requests, conn.js, "i-1", snapshot_every=1, formats=formats, task_ttl=2.0
    )
    try:
        await journal.listing.keep_index({"i-1"})
        t = task("long", "c", S.TASK_STATE_WORKING)
        version = await journal.create(t, [change(1, t)], scope=ALICE)
        first = await journal.snapshot("long")
        assert first is not None and first.index is not None and first.index.o
        seq = 1
        async with asyncio.timeout(30):
            while True:  # (writes, every change a snapshot, until its owner entry expired)
                seq += 1
                version = await journal.update(t, version, [change(seq, t)])
                if not await journal._index._get({"seq": first.index.o}):
                    break
                await asyncio.sleep(0.2)  # sync-ok: the index's max age passing
        for _ in range(2):
            seq += 1
            version = await journal.update(t, version, [change(seq, t)])
        found = await journal.ownership.owned_unfinished(lambda owner: owner == "i-1")
        assert [s.task().id for s in found] == ["long"]
    finally:
        await journal.close()
        await requests.close()
        await conn.js.delete_key_value(TASKS_BUCKET)
        for name in (EVENTS_STREAM, INDEX_STREAM):
            await conn.js.delete_stream(name)
        await conn.close()


async def test_a_task_written_while_a_listing_reads_it_is_listed(cluster: Cluster) -> None:
    """A write of t2 publishes its new entries, then its snapshot: a listing that reads t2's
    new entry before that snapshot lands, and its old one after, still lists t2 (at its new
    place)."""
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    versions = {}
    tasks = {}
    for n in range(5):
        t = task(f"t{n}", "c", S.TASK_STATE_WORKING)
        versions[t.id] = await journal.create(t, [change(1, t)], scope=ALICE)
        tasks[t.id] = t
    held, go = asyncio.Event(), asyncio.Event()
    write = journal.snapshots.write

    async def held_back(key: str, *args: object) -> int:
        if key == "t2":
            held.set()  # (its entries are published)
            await go.wait()
        return await write(key, *args)  # type: ignore[arg-type]

    journal.snapshots.write = held_back  # type: ignore[method-assign, assignment]
    t2 = tasks["t2"]
    t2.status.state = S.TASK_STATE_INPUT_REQUIRED
    update = asyncio.create_task(journal.update(t2, versions["t2"], [change(2, t2)]))
    await held.wait()
    read = journal.snapshot
    reads = 0

    async def landing(task_id: str) -> object:
        nonlocal reads
        if task_id == "t2":
            reads += 1
            if reads == 2:  # the write lands between the listing's two reads of t2
                go.set()
                await update
        return await read(task_id)

    journal.snapshot = landing  # type: ignore[method-assign, assignment]
    try:
        listed = [t.id for t in (await journal.list(TaskQuery(scope=ALICE))).tasks]
    finally:
        journal.snapshot = read  # type: ignore[method-assign]
        journal.snapshots.write = write  # type: ignore[method-assign]
        go.set()
        await update
    assert reads == 2, "both of t2's entries were read"
    assert listed == ["t2", "t4", "t3", "t1", "t0"]


async def test_a_page_is_found_while_entries_are_written_above_its_token(
    cluster: Cluster, nats_url: str
) -> None:
    """Alice's tasks created through another instance while her second page is sought
    (each count of the index sees more entries than the one before): the page is the
    next two tasks, and the pages after it go on to the last."""
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    for n in range(10):
        t = task(f"a{n}", "c", S.TASK_STATE_COMPLETED)
        await journal.create(t, [change(1, t)], scope=ALICE)
        other = task(f"b{n}", "c", S.TASK_STATE_COMPLETED)
        await journal.create(other, [change(1, other)], scope=BOB)
    first = await journal.list(TaskQuery(scope=ALICE, page_size=2))
    assert [t.id for t in first.tasks] == ["a9", "a8"]
    conn = await connect(NatsConfig(servers=[nats_url], instance_id="i-2"))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    writer = JetStreamJournal(requests, conn.js, "i-2", formats=cluster.formats)
    count_from = journal._index.count_from
    created = 0

    async def moving(subject: str, start: int) -> int:
        nonlocal created
        if created < 6:
            created += 1
            t = task(f"new{created}", "c", S.TASK_STATE_COMPLETED)
            await writer.create(t, [change(1, t)], scope=ALICE)
        return await count_from(subject, start)

    journal._index.count_from = moving  # type: ignore[method-assign]
    try:
        page = await journal.list(
            TaskQuery(scope=ALICE, page_size=2, page_token=first.next_page_token)
        )
    finally:
        journal._index.count_from = count_from  # type: ignore[method-assign]
        await writer.close()
        await requests.close()
        await conn.close()
    assert created == 6
    assert [t.id for t in page.tasks] == ["a7", "a6"]
    rest = await walk(journal, TaskQuery(scope=ALICE, page_size=2, page_token=page.next_page_token))
    assert rest == ["a5", "a4", "a3", "a2", "a1", "a0"]


async def test_a_page_token_never_issued_is_refused_without_reading_the_bucket(
    cluster: Cluster,
) -> None:
    journal = cluster.journal
    await journal.listing.keep_index({"i-1"})
    for n in range(3):
        t = task(f"t{n}", "c", S.TASK_STATE_COMPLETED)
        await journal.create(t, [change(1, t)], scope=ALICE)
    scans = 0
    scan = journal.snapshots.scan

    async def counted() -> object:
        nonlocal scans
        scans += 1
        return await scan()

    journal.snapshots.scan = counted  # type: ignore[method-assign, assignment]
    for token in ("garbage", "AAAA", "x" * 40):
        with pytest.raises(InvalidPageTokenError):
            await journal.list(TaskQuery(scope=ALICE, page_token=token))
    assert scans == 0


async def test_a_sweep_ends_every_task_of_a_lost_owner_a_batch_at_a_time(
    cluster: Cluster, nats_url: str
) -> None:
    """A lost instance ran 590 tasks and left 10 waiting: the survivor's first sweep ends
    each FAILED and releases each waiting one, exactly once, reading its snapshots
    ``SWEEP_BATCH`` at a time and ending a batch's before it reads the next (one batch in
    memory however many a lost owner held)."""
    conn = await connect(NatsConfig(servers=[nats_url], instance_id="lost"))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    lost = JetStreamJournal(requests, conn.js, "lost", formats=cluster.formats)
    survivor_conn = await connect(NatsConfig(servers=[nats_url], instance_id="i-1", lease=1.0))
    survivor = cluster.journal
    metrics = Metrics()
    swept = asyncio.Event()

    async def on_swept(live: set[str]) -> None:
        swept.set()

    tokens = PageTokens()  # (the lease sweeps through the cluster's façade: the log is empty)
    log = LogJournal(requests, survivor_conn.js, "i-1", page_tokens=tokens)
    both = ClusterJournal(survivor, log, cluster.formats, tokens)
    lease = Lease(survivor_conn, both, metrics, on_swept=on_swept, formats=cluster.formats)
    batches: list[tuple[int, int]] = []
    read_batch = survivor.ownership._owned_snapshots

    async def counted(entries: Sequence[IndexEntry]) -> list[Snapshot]:
        batches.append((len(entries), metrics.tasks_reaped + metrics.tasks_released))
        return await read_batch(entries)

    survivor.ownership._owned_snapshots = counted  # type: ignore[method-assign]
    try:
        states = [S.TASK_STATE_WORKING] * 590 + [S.TASK_STATE_INPUT_REQUIRED] * 10
        for at in range(0, len(states), 50):
            await asyncio.gather(
                *(
                    lost.create(t, [change(1, t)], scope=BOB)
                    for n, state in enumerate(states[at : at + 50], start=at)
                    for t in [task(f"lost-{n}", "c", state)]
                )
            )
        await survivor.listing.keep_index({"i-1"})
        async with asyncio.timeout(60):
            await lease.start()
            await swept.wait()  # (its first sweep, a lease after start)
        assert (metrics.tasks_reaped, metrics.tasks_released) == (590, 10)
        assert batches == [(SWEEP_BATCH, 0), (600 - SWEEP_BATCH, SWEEP_BATCH)]
        for n, state in enumerate(states):
            recorded = await survivor.get(f"lost-{n}")
            assert recorded is not None
            if state == S.TASK_STATE_WORKING:
                assert recorded.task.status.state == S.TASK_STATE_FAILED
            else:
                assert recorded.owner == "" and recorded.task.status.state == state
    finally:
        await lease.stop(release=True)
        await lost.close()
        await requests.close()
        await conn.close()
        await survivor_conn.close()

"""The journal of format 3 (``jetstream.logjournal``) on a real nats-server: what the journal
contract suite (tests/contracts/test_journal_contract.py, ``nats-log``) does not reach.

Issue 41, step 2 of docs/decisions/0001-cluster-store-layout.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

import nats
import pytest
from a2a.types.a2a_pb2 import (
    Artifact,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
)
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig, StreamSource

from a2a_grpc_server._internal.errors import UnknownFormatError
from a2a_grpc_server._internal.jetstream import logjournal, loglisting, tasklog
from a2a_grpc_server._internal.jetstream.conn import (
    INDEX_STREAM,
    TASKS_BUCKET,
    NatsConfig,
    connect,
    events_stream,
)
from a2a_grpc_server._internal.jetstream.formats import Formats
from a2a_grpc_server._internal.jetstream.journal import JetStreamJournal
from a2a_grpc_server._internal.jetstream.logjournal import LogJournal
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.retry import Retry
from a2a_grpc_server._internal.jetstream.store import ClusterJournal
from a2a_grpc_server._internal.journal import (
    Change,
    PageTokens,
    Released,
    StoreUnavailableError,
    TaskQuery,
)
from a2a_grpc_server._internal.model import taskops
from tests.support import natsserver

pytestmark = pytest.mark.timeout(120)

S = TaskState


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A client with the log and its index made; both deleted after."""
    client = await nats.connect(nats_url)
    js = client.jetstream(timeout=10.0)
    await js.add_stream(tasklog.log_config())
    await js.add_stream(tasklog.current_config())
    try:
        yield client
    finally:
        for name in (tasklog.CURRENT_STREAM, tasklog.LOG_STREAM):
            await js.delete_stream(name)
        await client.close()


@pytest.fixture
async def requests(nc: NATS) -> AsyncIterator[JetStreamRequests]:
    found = JetStreamRequests(nc)
    await found.start()
    try:
        yield found
    finally:
        await found.close()


@pytest.fixture
def make(nc: NATS, requests: JetStreamRequests) -> Callable[..., LogJournal]:
    """A journal of format 3 on ``nc`` as instance ``owner``."""

    def journal(owner: str, **options: Any) -> LogJournal:
        return LogJournal(requests, nc.jetstream(), owner, **options)

    return journal


def task(task_id: str, state: int = S.TASK_STATE_SUBMITTED, context: str = "c") -> Task:
    t = taskops.new_task(task_id, context, None)
    t.status.state = state  # type: ignore[assignment]
    return t


def change(seq: int, to: Task) -> Change:
    return Change(seq, StreamResponse(task=to).SerializeToString(), to.status.state)


async def last_seq(nc: NATS) -> int:
    return (await nc.jetstream().stream_info(tasklog.LOG_STREAM)).state.last_seq


async def test_a_unary_task_costs_two_acknowledged_writes_or_one_if_it_ends_at_once(
    nc: NATS, make: Callable[..., LogJournal]
) -> None:
    """Issue 41's count, on format 3: the log is the only stream a task writes (the index
    is nats-server's copy). Today's journal: 9 and 3 (tests/cluster/test_write_count.py)."""
    journal = make("i1")
    warm = task("warm", S.TASK_STATE_COMPLETED)  # (its first task registers the instance)
    await journal.create(warm, [change(1, warm)], keep_frames=False)
    before = await last_seq(nc)
    t = task("runs", S.TASK_STATE_WORKING)
    v = await journal.create(t, [change(1, t)])
    t.status.state = S.TASK_STATE_COMPLETED
    await journal.update(t, v, [change(2, t)])
    assert await last_seq(nc) - before == 2
    ends = task("ends", S.TASK_STATE_COMPLETED)
    await journal.create(ends, [change(1, ends)], keep_frames=False)
    assert await last_seq(nc) - before == 3
    got = await journal.get("ends")
    assert got is not None and got.task.status.state == S.TASK_STATE_COMPLETED


async def test_a_survivors_first_write_snapshots_so_reads_follow_its_events(
    nc: NATS, make: Callable[..., LogJournal]
) -> None:
    mine, theirs = make("i1", snapshot_every=100), make("i2")
    t = task("a", S.TASK_STATE_WORKING)
    v = await mine.create(t, [change(1, t)])
    t.artifacts.add(artifact_id="x2")
    v = await mine.update(t, v, [change(2, t)])  # (an e: nothing due)
    last = await mine.log.last("a")
    assert last is not None and last.kind == tasklog.EVENTS
    t.artifacts.add(artifact_id="x3")
    v = await theirs.update(t, v, [change(3, t)])  # (same state: due for its new writer)
    last = await mine.log.last("a")
    assert last is not None and (last.kind, last.owner) == (tasklog.SNAPSHOT, "i2")
    t.artifacts.add(artifact_id="x4")
    v = await theirs.update(t, v, [change(4, t)])
    got = await mine.get("a")
    assert got is not None
    assert (got.owner, got.seq, got.version) == ("i2", 4, v)
    assert [a.artifact_id for a in got.task.artifacts] == ["x2", "x3", "x4"]


async def test_a_page_shows_each_running_task_with_the_changes_after_its_entry(
    make: Callable[..., LogJournal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page's one multi_last once kept only the first message of its answer (hostile
    review of cb702b3): every other running task was listed without its latest changes."""
    journal = make("i1", snapshot_every=100)
    for n in range(4):
        t = task(f"r{n}", S.TASK_STATE_WORKING)
        v = await journal.create(t, [change(1, t)])
        for k in range(n + 1):
            t.artifacts.add(artifact_id=f"a{k}")
            v = await journal.update(t, v, [change(k + 2, t)])  # (e: nothing due)
    waiting = task("w", S.TASK_STATE_INPUT_REQUIRED)
    await journal.create(waiting, [change(1, waiting)])

    async def artifacts() -> dict[str, int]:
        page = await journal.list(TaskQuery(page_size=10))
        return {t.id: len(t.artifacts) for t in page.tasks}

    expected = {"r0": 1, "r1": 2, "r2": 3, "r3": 4, "w": 0}
    assert await artifacts() == expected
    monkeypatch.setattr(loglisting, "FOLD_BYTES", 1)  # (its answer cut: each one read)
    assert await artifacts() == expected


async def test_a_multi_last_answer_is_read_to_its_end(
    requests: JetStreamRequests, make: Callable[..., LogJournal]
) -> None:
    """direct_get once returned a multi_last answer after its first message; a page's fold
    then fell back to reading each running task (the test above cannot tell)."""
    journal = make("i1", snapshot_every=100)
    subjects = []
    for n in range(3):
        t = task(f"m{n}", S.TASK_STATE_WORKING)
        v = await journal.create(t, [change(1, t)])
        t.artifacts.add(artifact_id="a")
        await journal.update(t, v, [change(2, t)])  # (an e)
        subjects.append(tasklog.Where(t.id, "i1", "", t.context_id).subject(tasklog.EVENTS))
    msgs = await requests.direct_get(tasklog.LOG_STREAM, {"multi_last": subjects}, 5.0)
    assert sorted(m.headers["Nats-Subject"] for m in msgs if m.headers) == sorted(subjects)


async def test_reads_go_on_past_an_answer_cut_at_its_byte_limit(
    requests: JetStreamRequests,
    make: Callable[..., LogJournal],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nats-server cuts a batch's answer at its max_bytes (64 MiB unless asked) and says
    how many more follow: a read that took a short answer for the end lost the tail of a
    task's changes (hostile review of 37ca0ee). Here every answer is cut at 2 KiB."""
    original = requests.direct_get

    async def cut(stream: str, request: dict[str, object], timeout: float) -> list[Any]:  # noqa: ASYNC109 (passed on)
        if "batch" in request:
            request = {**request, "max_bytes": 2048}
        return await original(stream, request, timeout)

    journal = make("i1", snapshot_every=100)
    t = task("long", S.TASK_STATE_WORKING)
    v = await journal.create(t, [change(1, t)])
    for k in range(12):
        t.artifacts.add(artifact_id=f"a{k}").parts.add(text="x" * 300)
        v = await journal.update(t, v, [change(k + 2, t)])  # (an e each: nothing due)
    for n in range(12):
        other = task(f"o{n:02}", S.TASK_STATE_COMPLETED)
        await journal.create(other, [change(1, other)])
    monkeypatch.setattr(requests, "direct_get", cut)
    got = await journal.get("long")
    assert got is not None and len(got.task.artifacts) == 12
    page = await journal.list(TaskQuery(page_size=20))
    assert [len(t.artifacts) for t in page.tasks if t.id == "long"] == [12]
    assert len(page.tasks) == 13 and page.total_size == 13


async def test_a_page_of_a_quiet_scope_reads_about_what_it_shows(
    requests: JetStreamRequests,
    make: Callable[..., LogJournal],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scope written in a burst, then quiet while others write: the gallop's last step
    lands far below what a page needs, and the page once read all of it (hostile review
    of 37ca0ee: tens of thousands of entries for a page). It now halves that step."""
    original, read = requests.direct_get, [0]

    async def counting(stream: str, request: dict[str, object], timeout: float) -> list[Any]:  # noqa: ASYNC109 (passed on)
        found = await original(stream, request, timeout)
        if stream == tasklog.CURRENT_STREAM and int(str(request.get("batch", 1))) > 1:
            read[0] += len(found)
        return found

    journal = make("i1")
    for n, scope in enumerate(["a"] * 600 + ["b"] * 2000 + ["a"] * 10):
        t = task(f"t{n:04}", S.TASK_STATE_COMPLETED)
        await journal.create(t, [change(1, t)], scope=scope)
    monkeypatch.setattr(requests, "direct_get", counting)
    page = await journal.list(TaskQuery(scope="a", page_size=50))
    assert len(page.tasks) == 50 and page.total_size == 610
    assert [t.id for t in page.tasks[:10]] == [f"t{n:04}" for n in range(2609, 2599, -1)]
    assert read[0] <= 4 * 51, f"a page of 50 read {read[0]} entries"


async def test_a_listing_refuses_an_entry_in_another_format_even_unshown(
    nc: NATS, make: Callable[..., LogJournal]
) -> None:
    """Entries are matched on their headers and decoded only when shown: one of a format
    this version does not know is still refused, not skipped or counted as ours."""
    journal = make("i1")
    ours = task("ours", S.TASK_STATE_COMPLETED)
    await journal.create(ours, [change(1, ours)], scope="s")
    where = tasklog.Where("theirs", "i9", "s", "c")
    theirs = task("theirs", S.TASK_STATE_WORKING)
    kind, payload, headers = tasklog.encode([change(1, theirs)], theirs, where, "i9")
    headers["A2a-Format"] = "4"
    await nc.jetstream().publish(where.subject(kind), payload, headers=headers)
    for query in (
        TaskQuery(scope="s", page_size=10),
        TaskQuery(scope="s", state=S.TASK_STATE_COMPLETED, page_size=10),  # (not shown)
    ):
        with pytest.raises(UnknownFormatError, match="4"):
            await journal.list(query)


async def test_a_page_by_a_rare_state_comes_short_and_its_tokens_reach_every_match(
    make: Callable[..., LogJournal], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loglisting, "SCAN_MOST", 8)  # (a window reads up to 4 times that)
    journal = make("i1")
    rare: list[str] = []
    for n in range(120):
        state = S.TASK_STATE_INPUT_REQUIRED if n % 10 == 3 else S.TASK_STATE_WORKING
        t = task(f"t{n:03}", state)
        await journal.create(t, [change(1, t)])
        if state == S.TASK_STATE_INPUT_REQUIRED:
            rare.insert(0, t.id)
    query = TaskQuery(state=S.TASK_STATE_INPUT_REQUIRED, page_size=5)
    page = await journal.list(query)
    assert len(page.tasks) < 5 and page.next_page_token, "short: its read was bounded"
    assert page.total_size == 12, "counted exactly: fewer entries than one batch"
    pages, seen = 1, [t.id for t in page.tasks]
    while page.next_page_token and pages < 40:
        page = await journal.list(replace(query, page_token=page.next_page_token))
        seen += [t.id for t in page.tasks]
        pages += 1
    assert seen == rare
    everything = await journal.list(TaskQuery(page_size=200))
    assert (len(everything.tasks), everything.total_size) == (120, 120)


async def test_a_filtered_total_counts_the_newest_entries_and_estimates_the_rest(
    make: Callable[..., LogJournal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status time filter's matches are the newest entries: counted, not estimated (the
    total was once estimated from the oldest entries: 0 beside a full page); the rest is
    sampled, and every page of a listing says about the same total."""
    monkeypatch.setattr(loglisting, "COUNT_MOST", 300)  # (a first page reads 1,024 here)
    monkeypatch.setattr(loglisting, "SAMPLE_MOST", 40)  # (4 windows of 10)
    monkeypatch.setattr(loglisting, "COUNT_BYTES", 4096)  # (a count's batches cut short)
    journal = make("i1")

    async def made(n: int) -> None:
        waits = n % 5 == 0
        t = task(f"t{n:04}", S.TASK_STATE_INPUT_REQUIRED if waits else S.TASK_STATE_COMPLETED)
        t.status.timestamp.FromNanoseconds(time.time_ns())
        await journal.create(t, [change(1, t)])

    for n in range(1720):
        await made(n)
    after = time.time_ns()
    for n in range(1720, 2000):
        await made(n)
    recent = TaskQuery(status_after_ns=after, page_size=10)
    page = await journal.list(recent)
    assert (len(page.tasks), page.total_size) == (10, 280), "counted, none estimated"
    assert await journal.total(recent) == 280, "the newest 300, then none in the samples"
    waiting = TaskQuery(state=S.TASK_STATE_INPUT_REQUIRED, page_size=10)
    page = await journal.list(waiting)
    assert len(page.tasks) == 10 and abs(page.total_size - 400) <= 40
    later = await journal.list(replace(waiting, page_token=page.next_page_token))
    assert abs(later.total_size - 400) <= 40, "a later page counts from the end too"
    assert abs(await journal.total(waiting) - 400) <= 40


async def test_a_listing_fails_unavailable_when_the_index_does_not_catch_up(
    nc: NATS, make: Callable[..., LogJournal]
) -> None:
    """An index whose source stalls (here: it sources another stream) is not read as if
    current: the listing says UNAVAILABLE within the journal's timeout."""
    js = nc.jetstream(timeout=10.0)
    stalled = StreamConfig(
        name="STALLED",
        sources=[StreamSource(name="NOTHING")],
        max_msgs_per_subject=1,
        allow_direct=True,
    )
    await js.add_stream(stalled)
    try:
        journal = make("i1", retry=Retry(1.0), index_stream="STALLED")
        t = task("a")
        await journal.create(t, [change(1, t)])
        async with asyncio.timeout(10):
            with pytest.raises(StoreUnavailableError, match="not caught up"):
                await journal.list(TaskQuery())
    finally:
        await js.delete_stream("STALLED")


async def test_a_lost_owner_with_nothing_left_is_swept_once_then_deregistered(
    make: Callable[..., LogJournal],
) -> None:
    mine, theirs = make("i1"), make("i2")
    waiting = task("w", S.TASK_STATE_INPUT_REQUIRED)
    await mine.create(waiting, [change(1, waiting)])
    running = task("r", S.TASK_STATE_WORKING)
    v = await mine.create(running, [change(1, running)])
    running.status.state = S.TASK_STATE_COMPLETED
    await mine.update(running, v, [change(2, running)])  # (ended: not the sweep's)
    claimed = task("c", S.TASK_STATE_INPUT_REQUIRED)
    await mine.create(claimed, [change(1, claimed)])
    assert await theirs.owners.release("c", "i1") is Released.RELEASED
    assert await theirs.owners.claim("c") is not None  # (now i2's)
    assert set(await theirs.owners.owners()) == {"i1"}

    async def swept() -> list[tuple[str, str]]:
        found = theirs.owners.unfinished_batches(lambda owner: owner == "i1", 100)
        return [pair async for batch in found for pair in batch]

    assert await swept() == [("i1", "w")]
    assert await theirs.owners.release("w", "i1") is Released.RELEASED
    assert await swept() == [], "released: nobody's"
    assert await theirs.owners.owners() == {}, "deregistered once nothing was left"
    assert await theirs.owners.claim("w") is not None
    again = task("n", S.TASK_STATE_WORKING)
    await mine.create(again, [change(1, again)])
    assert await theirs.owners.owners() == {}, "registered once per process"
    await mine.owners.renew()  # (what its lease does after a gap in its heartbeats)
    assert set(await theirs.owners.owners()) == {"i1"}
    assert await theirs.owners.owners() == await make("i3").owners.owners()


async def test_a_sweep_leaves_the_tasks_of_nobody_unread(
    nc: NATS, make: Callable[..., LogJournal]
) -> None:
    """A journal writing as nobody (a filler, as bench.scale's) does not register, and a
    registration of nobody's is passed over: its waiting tasks were once all read at each
    sweep (bench.scale's sweep at 100,000 tasks)."""
    filler, survivor = make(""), make("i2")
    for n in range(3):
        waiting = task(f"nobody-{n}", S.TASK_STATE_INPUT_REQUIRED)
        await filler.create(waiting, [change(1, waiting)])
    assert await survivor.owners.owners() == {}
    # (as the filler of an older version registered)
    subject = f"{tasklog.LOG_SUBJECT}.o.{tasklog.token('')}"
    await nc.jetstream().publish(subject, b"", headers={"Nats-TTL": "never"})
    assert set(await survivor.owners.owners()) == {""}
    found = survivor.owners.unfinished_batches(lambda owner: True, 10)
    assert [pair async for batch in found for pair in batch] == []
    assert await survivor.owners.claim("nobody-1") is not None, "still waits for a claim"


async def test_the_facade_lists_the_logs_tasks_then_the_buckets_through_one_token_chain(
    nats_url: str, nc: NATS
) -> None:
    conn = await connect(NatsConfig(servers=[nats_url]))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    tokens, formats = PageTokens(), Formats()
    formats.settle()  # (a cluster of one: every instance reads the log)
    legacy = JetStreamJournal(requests, conn.js, "i1", formats=formats, page_tokens=tokens)
    log = LogJournal(requests, conn.js, "i1", page_tokens=tokens)
    journal = ClusterJournal(legacy, log, formats, tokens)
    try:
        created: dict[bool, list[str]] = {False: [], True: []}
        for n in range(9):
            formats.log_wanted = n % 3 != 0  # (6 in the log: pages of it past the first)
            t = task(f"t{n}", S.TASK_STATE_WORKING)
            await journal.create(t, [change(1, t)])
            created[formats.writes_log].append(t.id)
        assert len(created[True]) == 6
        want = [*reversed(created[True]), *reversed(created[False])]
        seen, pages = [], 0
        page = await journal.list(TaskQuery(page_size=2))
        while True:
            assert page.total_size == 9
            seen += [t.id for t in page.tasks]
            pages += 1
            if not page.next_page_token:
                break
            page = await journal.list(TaskQuery(page_size=2, page_token=page.next_page_token))
        assert (seen, pages) == (want, 5)
        for task_id in ("t0", "t1"):  # (one of each layout, through the façade)
            got = await journal.get(task_id)
            assert got is not None
            got.task.status.state = S.TASK_STATE_COMPLETED
            await journal.update(got.task, got.version, [change(2, got.task)])
        assert await log.get("t1") is not None and await legacy.get("t1") is None
        assert await legacy.get("t0") is not None and await log.get("t0") is None
    finally:
        await journal.close()
        await requests.close()
        await conn.js.delete_key_value(TASKS_BUCKET)
        await conn.js.delete_stream(events_stream(0))
        await conn.js.delete_stream(INDEX_STREAM)
        await conn.close()


async def test_the_facade_reads_the_buckets_tasks_while_the_log_does_not_answer(
    nats_url: str, nc: NATS
) -> None:
    """Reads try the log first now it is the default; a log that does not answer must not
    hide the bucket's tasks (hostile review of c9d28bf). Here the log is a stream nobody
    serves."""
    conn = await connect(NatsConfig(servers=[nats_url]))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    tokens, formats = PageTokens(), Formats()
    formats.settle()
    legacy = JetStreamJournal(requests, conn.js, "i1", formats=formats, page_tokens=tokens)
    mute = LogJournal(requests, conn.js, "i1", retry=Retry(0.3), log_stream="A2A_NOBODY")
    try:
        formats.log_wanted = False
        t = task("b0", S.TASK_STATE_WORKING)
        await ClusterJournal(legacy, mute, formats, tokens).create(t, [change(1, t)])
        for wanted in (True, False):
            formats.log_wanted = wanted
            journal = ClusterJournal(legacy, mute, formats, tokens)  # (remembers nothing)
            got = await journal.get("b0")
            assert got is not None and got.task.id == "b0"
            assert await ClusterJournal(legacy, mute, formats, tokens).logged("b0") is False
            if wanted:  # (in neither layout: the log's silence is the answer)
                with pytest.raises(StoreUnavailableError):
                    await journal.get("nowhere")
    finally:
        await requests.close()
        await conn.js.delete_key_value(TASKS_BUCKET)
        await conn.js.delete_stream(events_stream(0))
        await conn.js.delete_stream(INDEX_STREAM)
        await conn.close()


async def test_a_sweep_finds_a_running_task_among_many_that_moved_on(
    make: Callable[..., LogJournal],
) -> None:
    """Tasks released, claimed and ended elsewhere keep subjects under their first owner
    (hostile review of issue 41: a multi_last cut at its batch lost the running one)."""
    a, c = make("A", snapshot_every=100), make("C", snapshot_every=100)
    for n in range(60):  # (six subjects each: A's s and e, nobody's s, C's s, e and f)
        t = task(f"t{n:03}", S.TASK_STATE_WORKING)
        v = await a.create(t, [change(1, t)])
        t.artifacts.add(artifact_id="x")
        v = await a.update(t, v, [change(2, t)])
        t.status.state = S.TASK_STATE_INPUT_REQUIRED
        await a.update(t, v, [change(3, t)])
        assert await c.owners.release(t.id, "A") is Released.RELEASED
        got = await c.owners.claim(t.id)
        assert got is not None
        t.status.state = S.TASK_STATE_WORKING
        v = await c.update(t, got.version, [change(4, t)])
        t.artifacts.add(artifact_id="y")
        v = await c.update(t, v, [change(5, t)])
        t.status.state = S.TASK_STATE_COMPLETED
        await c.update(t, v, [change(6, t)])
    live = task("a-live", S.TASK_STATE_WORKING)
    await a.create(live, [change(1, live)])
    found = c.owners.unfinished_batches(lambda owner: owner == "A", 20)
    assert [pair async for batch in found for pair in batch] == [("A", "a-live")]


async def test_a_read_that_races_a_snapshot_reads_again_and_skips_no_change(
    make: Callable[..., LogJournal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest ``s`` and the ``e`` after it are two requests: a snapshot written between
    them leaves a gap in the ``e`` (its changes are in the ``s``), and the read starts over."""
    journal = make("i1", snapshot_every=2)
    t = task("a", S.TASK_STATE_WORKING)
    v = await journal.create(t, [change(1, t)])
    stale = await journal.log.read("a")  # (its newest s: change 1)
    assert stale is not None
    for seq in (2, 3, 4):  # e (2), s (3: two changes since), e (4)
        t.artifacts.add(artifact_id=f"x{seq}")
        added = TaskArtifactUpdateEvent(task_id="a", artifact=Artifact(artifact_id=f"x{seq}"))
        frame = StreamResponse(artifact_update=added).SerializeToString()
        v = await journal.update(t, v, [Change(seq, frame)])
    kinds = [m.kind for m in [await journal.log.last("a")] if m is not None]
    assert kinds == [tasklog.EVENTS]
    real = journal.log._get
    first, always = True, False

    async def served(request: dict[str, object], what: str) -> list[Any]:
        nonlocal first
        if (always or first) and request.get("last_by_subj") == tasklog.kind_filter(
            "a", tasklog.SNAPSHOT
        ):
            first = False  # (as if read before the s of change 3 was written)
            return await real({"seq": stale.snapshot.pos, "next_by_subj": ">"}, what)
        return await real(request, what)

    monkeypatch.setattr(journal.log, "_get", served)
    for always in (False, True):  # (once, then at every attempt: a writer that never rests)
        first = True
        read = await journal.log.read("a")
        assert not first, "the stale snapshot was served"
        assert read is not None and (read.seq, read.version) == (4, v)
        folded = tasklog.fold(read).task
        assert [x.artifact_id for x in folded.artifacts] == ["x2", "x3", "x4"], always


async def test_a_running_task_is_snapshotted_again_before_its_snapshot_could_age_out(
    make: Callable[..., LogJournal],
) -> None:
    """The log's age limit counts per message: a task whose last ``s`` is half ``task_ttl``
    old writes its next change as an ``s``, so it is never left with ``e`` alone (0: no
    age limit, nothing due)."""
    cases = ((86_400.0, tasklog.EVENTS), (0.0, tasklog.EVENTS), (1e-9, tasklog.SNAPSHOT))
    for n, (ttl, kind) in enumerate(cases):
        journal = make("i1", task_ttl=ttl)
        t = task(f"t{n}", S.TASK_STATE_WORKING)
        v = await journal.create(t, [change(1, t)])
        t.artifacts.add(artifact_id="x")  # (same state, one change: nothing else is due)
        await journal.update(t, v, [change(2, t)])
        last = await journal.log.last(t.id)
        assert last is not None and last.kind == kind, ttl


async def test_what_a_journal_remembers_of_its_tasks_is_bounded_and_a_forgotten_one_is_read(
    make: Callable[..., LogJournal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KNOWN`` bounds the tasks a journal remembers (memory follows what is kept): the
    oldest is forgotten first, and its next write reads it back from the log, numbering on
    from what the log holds, as for a task another instance wrote."""
    monkeypatch.setattr(logjournal, "KNOWN", 2)
    journal = make("i1", snapshot_every=100)
    versions = {}
    for n in range(3):
        t = task(f"k{n}", S.TASK_STATE_WORKING)
        versions[t.id] = await journal.create(t, [change(1, t)])
    assert list(journal._known) == ["k1", "k2"]  # (k0, the oldest, forgotten)
    t = task("k0", S.TASK_STATE_WORKING)
    t.artifacts.add(artifact_id="x2")
    v = await journal.update(t, versions["k0"], [change(2, t)])  # (read back, then written)
    assert list(journal._known) == ["k2", "k0"]
    t.artifacts.add(artifact_id="x3")
    await journal.update(t, v, [change(3, t)])
    got = await journal.get("k0")
    assert got is not None and got.seq == 3
    assert [a.artifact_id for a in got.task.artifacts] == ["x2", "x3"]


async def test_the_log_holds_no_task_while_it_holds_only_owner_registrations(
    make: Callable[..., LogJournal],
) -> None:
    """A registration (never deleted while its owner lives) is not a task: the facade's
    listing keeps to the bucket alone until the log holds one (``holds_any``)."""
    journal = make("i1")
    await journal.owners.register()
    assert not await journal.holds_any()
    t = task("h1", S.TASK_STATE_COMPLETED)
    await journal.create(t, [change(1, t)], keep_frames=False)
    assert await journal.holds_any()


async def test_a_listing_reads_the_slow_way_when_no_stream_leader_answers(
    make: Callable[..., LogJournal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a stream's leader answers stream info: in a failover nobody does for a while,
    and a listing then takes its positions from wildcard reads that any replica answers
    (a silent leader is simulated: one node cannot lose its leader and keep serving)."""
    journal = make("i1")
    for n in range(3):
        t = task(f"l{n}", S.TASK_STATE_WORKING)
        await journal.create(t, [change(1, t)])
    fast = await journal.list(TaskQuery(page_size=2))

    async def silent(self: tasklog.TaskLog, stream: str | None = None) -> None:
        return None

    monkeypatch.setattr(tasklog.TaskLog, "stream_state", silent)
    slow = await journal.list(TaskQuery(page_size=2))
    assert [t.id for t in slow.tasks] == [t.id for t in fast.tasks] == ["l2", "l1"]
    assert slow.total_size == fast.total_size == 3
    rest = await journal.list(TaskQuery(page_size=2, page_token=slow.next_page_token))
    assert [t.id for t in rest.tasks] == ["l0"]
    assert await journal.holds_any()

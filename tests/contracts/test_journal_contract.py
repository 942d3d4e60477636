"""The TaskJournal contract, run against every implementation."""

from __future__ import annotations

import base64
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import nats
import pytest
from a2a.types.a2a_pb2 import Part, Role, StreamResponse, Task, TaskState

from a2a_grpc_server._internal.jetstream import tasklog
from a2a_grpc_server._internal.jetstream.conn import (
    INDEX_STREAM,
    TASKS_BUCKET,
    NatsConfig,
    connect,
    events_stream,
)
from a2a_grpc_server._internal.jetstream.formats import Formats
from a2a_grpc_server._internal.jetstream.journal import JetStreamJournal, Snapshot, encode
from a2a_grpc_server._internal.jetstream.logjournal import LogJournal
from a2a_grpc_server._internal.jetstream.records import messages as _messages
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.journal import (
    Change,
    FinalTaskError,
    InvalidPageTokenError,
    TaskExistsError,
    TaskJournal,
    TaskQuery,
    UnknownTaskError,
    VersionConflictError,
)
from a2a_grpc_server._internal.journal.memory import MemoryJournal
from a2a_grpc_server._internal.model import taskops
from a2a_grpc_server._internal.model.scope import scope_key
from tests.support import natsserver

S = TaskState


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]


@pytest.fixture(params=["memory", "nats", "nats-indexed", "nats-sharded", "nats-log"])
async def journal(request: pytest.FixtureRequest) -> AsyncIterator[TaskJournal]:
    """Every implementation, empty: in memory, and JetStream on a real nats-server
    (snapshots every 4 changes, so reads fold changes after a snapshot), listing by
    reading every snapshot (an instance that has not heard everyone keep the index)
    and through the index (a settled cluster of one, its index built); and format 3,
    the task log and the index nats-server keeps (``logjournal``)."""
    if request.param == "memory":
        yield MemoryJournal()
        return
    if request.param == "nats-log":
        async with log_journal(request.getfixturevalue("nats_url")) as journal:
            yield journal
        return
    streams = 3 if request.param == "nats-sharded" else 1
    formats = Formats()
    url = request.getfixturevalue("nats_url")
    async with jetstream_journal(url, formats, event_streams=streams, snapshot_every=4) as journal:
        if request.param in ("nats-indexed", "nats-sharded"):
            formats.settle()  # (a cluster of one: every instance keeps the index, reads shards)
            await journal.listing.keep_index({"instance-1"})
            assert journal.listing.indexed
        yield journal


@contextlib.asynccontextmanager
async def jetstream_journal(
    url: str, formats: Formats, *, event_streams: int = 1, snapshot_every: int = 32
) -> AsyncIterator[JetStreamJournal]:
    """A JetStream journal of instance-1 on a real nats-server; its streams deleted after."""
    conn = await connect(NatsConfig(servers=[url], event_streams=event_streams))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    journal = JetStreamJournal(
        requests,
        conn.js,
        "instance-1",
        snapshot_every=snapshot_every,
        formats=formats,
        event_streams=event_streams,
    )
    try:
        yield journal
    finally:
        await journal.close()
        await requests.close()
        await conn.js.delete_key_value(TASKS_BUCKET)
        for shard in range(event_streams):
            await conn.js.delete_stream(events_stream(shard))
        await conn.js.delete_stream(INDEX_STREAM)
        for name in (tasklog.CURRENT_STREAM, tasklog.LOG_STREAM):  # (made by connect)
            await conn.js.delete_stream(name)
        await conn.close()


@contextlib.asynccontextmanager
async def log_journal(url: str) -> AsyncIterator[LogJournal]:
    """A format-3 journal of instance-1 on a real nats-server; its streams deleted after."""
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=10.0)
    await js.add_stream(tasklog.log_config())
    await js.add_stream(tasklog.current_config())
    requests = JetStreamRequests(nc)
    await requests.start()
    try:
        yield LogJournal(requests, js, "instance-1", snapshot_every=4)
    finally:
        await requests.close()
        await js.delete_stream(tasklog.CURRENT_STREAM)
        await js.delete_stream(tasklog.LOG_STREAM)
        await nc.close()


def task(task_id: str, context: str = "c", state: TaskState = S.TASK_STATE_SUBMITTED) -> Task:
    t = taskops.new_task(task_id, context, None)
    t.status.state = state
    return t


def change(seq: int, to: Task) -> Change:
    """Change number ``seq``, a frame carrying the whole task it leads to."""
    return Change(seq, StreamResponse(task=to).SerializeToString(), to.status.state)


async def quiesce(journal: TaskJournal) -> None:
    """Let a journal finish what it does in the background (the JetStream one deletes the
    index entries of the snapshots its writes replaced: until then a count holds them)."""
    if isinstance(journal, JetStreamJournal):
        await journal.close()


async def create(journal: TaskJournal, t: Task) -> int:
    return await journal.create(t, [change(1, t)])


async def test_create_then_get_returns_a_copy_at_the_created_version(
    journal: TaskJournal,
) -> None:
    version = await create(journal, task("a"))
    got = await journal.get("a")
    assert got is not None
    assert (got.version, got.seq) == (version, 1)
    got.task.status.state = S.TASK_STATE_FAILED
    again = await journal.get("a")
    assert again is not None
    assert again.task.status.state == S.TASK_STATE_SUBMITTED
    assert await journal.get("missing") is None


async def test_create_refuses_an_existing_id(journal: TaskJournal) -> None:
    await create(journal, task("a"))
    with pytest.raises(TaskExistsError):
        await create(journal, task("a"))


async def test_update_is_a_compare_and_set_on_the_version(journal: TaskJournal) -> None:
    v1 = await create(journal, task("a"))
    working = task("a", state=S.TASK_STATE_WORKING)
    v2 = await journal.update(working, v1, [change(2, working)])
    assert v2 > v1
    with pytest.raises(VersionConflictError):
        await journal.update(working, v1, [change(2, working)])
    with pytest.raises(UnknownTaskError):
        await journal.update(task("zzz"), v2, [change(2, task("zzz"))])


async def test_a_final_task_is_never_overwritten(journal: TaskJournal) -> None:
    v1 = await create(journal, task("a"))
    canceled = task("a", state=S.TASK_STATE_CANCELED)
    v2 = await journal.update(canceled, v1, [change(2, canceled)])
    working = task("a", state=S.TASK_STATE_WORKING)
    with pytest.raises(FinalTaskError):
        await journal.update(working, v2, [change(3, working)])
    with pytest.raises(FinalTaskError):
        await journal.update(working, v1, [change(2, working)])
    got = await journal.get("a")
    assert got is not None
    assert (got.task.status.state, got.seq) == (S.TASK_STATE_CANCELED, 2)


async def test_get_returns_every_change_in_order_with_the_seq_of_the_last(
    journal: TaskJournal,
) -> None:
    live = task("a", state=S.TASK_STATE_WORKING)
    version = await create(journal, live)
    for seq in range(2, 12):  # more changes than between two snapshots
        live.artifacts.add(artifact_id=f"x{seq}").parts.add(text=str(seq))
        version = await journal.update(live, version, [change(seq, live)])
    got = await journal.get("a")
    assert got is not None
    assert (got.version, got.seq) == (version, 11)
    assert [a.artifact_id for a in got.task.artifacts] == [f"x{seq}" for seq in range(2, 12)]


async def test_a_change_without_a_frame_records_a_follow_up_message(
    journal: TaskJournal,
) -> None:
    live = task("a", state=S.TASK_STATE_INPUT_REQUIRED)
    version = await create(journal, live)
    message = taskops.agent_message(live, "Ada")
    message.role = Role.ROLE_USER
    taskops.add_user_message(live, message)
    version = await journal.update(live, version, [Change(2, message=message)])
    live.artifacts.add(artifact_id="after").parts.append(Part(text="x"))
    await journal.update(live, version, [change(3, live)])
    got = await journal.get("a")
    assert got is not None
    assert [m.parts[0].text for m in got.task.history] == ["Ada"]
    assert [a.artifact_id for a in got.task.artifacts] == ["after"]
    assert got.seq == 3


async def test_list_filters_pages_and_counts_most_recent_update_first(
    journal: TaskJournal,
) -> None:
    for i in range(7):
        await create(journal, task(f"t{i}", context="even" if i % 2 == 0 else "odd"))
    first = await journal.get("t0")
    assert first is not None
    working = task("t0", context="even", state=S.TASK_STATE_WORKING)
    await journal.update(working, first.version, [change(2, working)])
    await quiesce(journal)
    page = await journal.list(TaskQuery(page_size=3))
    assert [t.id for t in page.tasks] == ["t0", "t6", "t5"]
    assert page.total_size == 7
    rest = await journal.list(TaskQuery(page_size=10, page_token=page.next_page_token))
    assert [t.id for t in rest.tasks] == ["t4", "t3", "t2", "t1"]
    assert rest.next_page_token == ""
    odd = await journal.list(TaskQuery(context_id="odd"))
    assert {t.id for t in odd.tasks} == {"t1", "t3", "t5"}
    working_page = await journal.list(TaskQuery(state=S.TASK_STATE_WORKING))
    assert [t.id for t in working_page.tasks] == ["t0"]
    with pytest.raises(InvalidPageTokenError):
        await journal.list(TaskQuery(page_token="not-a-token"))


async def test_page_tokens_are_opaque_and_good_for_their_scope_only(
    journal: TaskJournal,
) -> None:
    for i in range(4):
        mine = task(f"s{i}")
        await journal.create(mine, [change(1, mine)], scope="alice")
    page = await journal.list(TaskQuery(page_size=2, scope="alice"))
    token = page.next_page_token
    assert token
    again = await journal.list(TaskQuery(page_size=2, scope="alice"))
    assert again.next_page_token != token, "sealed: the same place reads differently each time"
    rest = await journal.list(TaskQuery(page_size=2, page_token=token, scope="alice"))
    assert [t.id for t in rest.tasks] == ["s1", "s0"]
    with pytest.raises(InvalidPageTokenError):  # another caller's token
        await journal.list(TaskQuery(page_size=2, page_token=token, scope="bob"))
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[12] ^= 1  # one bit of the revision changed
    forged = base64.urlsafe_b64encode(bytes(raw)).decode()
    with pytest.raises(InvalidPageTokenError):
        await journal.list(TaskQuery(page_size=2, page_token=forged, scope="alice"))


async def test_list_shows_a_running_task_with_every_change_recorded(
    journal: TaskJournal,
) -> None:
    live = task("a", state=S.TASK_STATE_WORKING)
    version = await create(journal, live)
    for seq in range(2, 5):  # fewer changes than between two snapshots
        live.artifacts.add(artifact_id=f"x{seq}")
        version = await journal.update(live, version, [change(seq, live)])
    listed = await journal.list(TaskQuery())
    assert [a.artifact_id for a in listed.tasks[0].artifacts] == ["x2", "x3", "x4"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_journal_keeps_at_most_max_final_tasks_oldest_evicted_first() -> None:
    journal = MemoryJournal(max_final_tasks=3, final_task_ttl=3600)
    for i in range(5):
        await create(journal, task(f"t{i}", state=S.TASK_STATE_COMPLETED))
    assert [await journal.get(f"t{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    await create(journal, task("live"))
    assert len(journal) == 4, "non-final tasks are never evicted"


async def test_memory_journal_evicts_the_results_of_the_caller_keeping_the_most() -> None:
    # One caller completing many tasks evicts its own oldest results, never another's
    # (issue 22: one principal's 60 tasks evicted another's result under 40).
    journal = MemoryJournal(max_final_tasks=40, final_task_ttl=3600)
    done = task("bobs", state=S.TASK_STATE_COMPLETED)
    await journal.create(done, [change(1, done)], scope=scope_key("", "bob"))
    for i in range(60):  # (alice spreads them over tenants: the principal counts)
        mine = task(f"alice-{i}", state=S.TASK_STATE_COMPLETED)
        await journal.create(mine, [change(1, mine)], scope=scope_key(f"t{i}", "alice"))
    assert await journal.get("bobs") is not None, "bob's result stays"
    assert await journal.get("alice-20") is None and await journal.get("alice-21") is not None
    assert len(journal) == 40


async def test_memory_journal_bounds_final_tasks_in_bytes_per_caller() -> None:
    journal = MemoryJournal(max_final_tasks=1000, final_task_ttl=3600, max_final_bytes=64 * 1024)
    small = task("bobs", state=S.TASK_STATE_COMPLETED)
    await journal.create(small, [change(1, small)], scope=scope_key("", "bob"))
    for i in range(10):  # ten results of ~10 KiB: past 64 KiB, alice's oldest go
        big = task(f"big-{i}", state=S.TASK_STATE_COMPLETED)
        big.metadata.update({"blob": "x" * 10_000})
        await journal.create(big, [change(1, big)], scope=scope_key("", "alice"))
    assert await journal.get("bobs") is not None
    kept = [i for i in range(10) if await journal.get(f"big-{i}") is not None]
    assert kept == list(range(10 - len(kept), 10)) and 4 <= len(kept) <= 6, kept


async def test_memory_journal_drops_final_tasks_after_their_ttl() -> None:
    clock = FakeClock()
    journal = MemoryJournal(max_final_tasks=100, final_task_ttl=60, clock=clock)
    await create(journal, task("old", state=S.TASK_STATE_FAILED))
    await create(journal, task("running"))
    clock.now += 61
    await create(journal, task("new", state=S.TASK_STATE_COMPLETED))
    assert await journal.get("old") is None
    assert await journal.get("running") is not None
    assert await journal.get("new") is not None


async def test_memory_journal_size_stays_flat_under_sustained_load() -> None:
    journal = MemoryJournal(max_final_tasks=500, final_task_ttl=3600)
    for i in range(20_000):
        await create(journal, task(f"t{i}"))
        done = task(f"t{i}", state=S.TASK_STATE_COMPLETED)
        await journal.update(done, 1, [change(2, done)])
        assert len(journal) <= 501
    assert len(journal) == 500


async def test_a_handed_over_task_changed_and_updated_again_reads_back_each_version(
    journal: TaskJournal,
) -> None:
    live = task("a")
    v1 = await create(journal, live)
    live.status.state = S.TASK_STATE_WORKING
    v2 = await journal.update(live, v1, [change(2, live)])
    got = await journal.get("a")
    assert got is not None
    assert (got.version, got.task.status.state) == (v2, S.TASK_STATE_WORKING)
    live.status.state = S.TASK_STATE_COMPLETED
    v3 = await journal.update(live, v2, [change(3, live)])
    live.status.state = S.TASK_STATE_FAILED  # after a final write: must not show
    final = await journal.get("a")
    assert final is not None
    assert (final.version, final.task.status.state) == (v3, S.TASK_STATE_COMPLETED)


async def test_a_task_updated_in_place_lists_by_its_new_state_time_and_recency(
    journal: TaskJournal,
) -> None:
    live = task("a")
    version = await create(journal, live)
    await create(journal, task("b"))
    live.status.state = S.TASK_STATE_WORKING
    live.status.timestamp.FromSeconds(4_000_000_000)  # later than any other task's
    await journal.update(live, version, [change(2, live)])
    everything = await journal.list(TaskQuery())
    assert [t.id for t in everything.tasks] == ["a", "b"], "most recently updated first"
    working = await journal.list(TaskQuery(state=S.TASK_STATE_WORKING))
    assert [t.id for t in working.tasks] == ["a"]
    later = await journal.list(TaskQuery(status_after_ns=4_000_000_000 * 10**9))
    assert [t.id for t in later.tasks] == ["a"]
    submitted = await journal.list(TaskQuery(state=S.TASK_STATE_SUBMITTED))
    assert [t.id for t in submitted.tasks] == ["b"]


async def test_the_scope_a_task_was_created_with_stays_through_every_write(
    journal: TaskJournal,
) -> None:
    mine = task("a")
    version = await journal.create(mine, [change(1, mine)], scope='["t","alice"]')
    await journal.create(task("b"), [change(1, task("b"))])
    for seq in range(2, 7):  # past a snapshot (every 4 changes on NATS)
        mine.status.state = S.TASK_STATE_WORKING
        version = await journal.update(mine, version, [change(seq, mine)])
    mine.status.state = S.TASK_STATE_COMPLETED
    await journal.update(mine, version, [change(7, mine)])
    got = await journal.get("a")
    assert got is not None and got.scope == '["t","alice"]'
    other = await journal.get("b")
    assert other is not None and other.scope == ""
    listed = await journal.list(TaskQuery(scope='["t","alice"]'))
    assert ([t.id for t in listed.tasks], listed.total_size) == (["a"], 1)
    anonymous = await journal.list(TaskQuery())
    assert ([t.id for t in anonymous.tasks], anonymous.total_size) == (["b"], 1)


def test_a_snapshot_written_before_scopes_existed_reads_as_the_anonymous_scope() -> None:
    old = b"instance-1\n2\n5\n17\n" + task("a").SerializeToString()
    snap = Snapshot.decode(old, 3)
    assert (snap.owner, snap.seq, snap.pos, snap.scope) == ("instance-1", 5, 17, "")
    assert snap.task().id == "a"
    scope = scope_key("", "a name\nwith a newline")  # a scope is always one line
    new = Snapshot.decode(encode("i", task("b"), 1, 0, scope), 4)
    assert (new.scope, new.task().id) == (scope, "b")


ALICE, BOB = scope_key("", "alice"), scope_key("", "bob")


async def _listed(journal: TaskJournal, query: TaskQuery) -> list[str]:
    """Every id a walk of ``query``'s pages returns, in order."""
    ids: list[str] = []
    page = await journal.list(query)
    for _ in range(100):
        ids += [t.id for t in page.tasks]
        if not page.next_page_token:
            return ids
        page = await journal.list(replace(query, page_token=page.next_page_token))
    raise AssertionError("more than 100 pages")


async def test_a_listing_agrees_with_every_task_filtered_by_hand_through_random_writes(
    journal: TaskJournal,
) -> None:
    """A model of the journal (last write order, scope, context, state) against its listing,
    for every filter and page size, after each of a few rounds of random writes."""
    rng = random.Random(23)
    states = [S.TASK_STATE_SUBMITTED, S.TASK_STATE_WORKING, S.TASK_STATE_INPUT_REQUIRED]
    kept: dict[str, tuple[Task, int, str]] = {}
    order: list[str] = []  # last written last
    for round_ in range(4):
        for n in range(12):
            if kept and rng.random() < 0.5:
                task_id = rng.choice(sorted(kept))
                t, version, scope = kept[task_id]
                t.status.state = rng.choice([*states, S.TASK_STATE_COMPLETED])
                version = await journal.update(t, version, [change(version + 1, t)])
                if t.status.state == S.TASK_STATE_COMPLETED:
                    version = -1  # final: never written again
            else:
                task_id, scope = f"t{round_}-{n}", rng.choice([ALICE, BOB])
                t = task(task_id, rng.choice(["c1", "c2"]), rng.choice(states))
                version = await journal.create(t, [change(1, t)], scope=scope)
            if version < 0:
                kept.pop(task_id)
            else:
                kept[task_id] = (t, version, scope)
            order = [i for i in order if i != task_id] + [task_id]
        model = {i: (s, t.context_id, t.status.state) for i, (t, _, s) in kept.items()}
        await quiesce(journal)
        for task_id in order:
            if task_id not in model:  # ended: its last state is what it lists as
                got = await journal.get(task_id)
                assert got is not None
                model[task_id] = (got.scope, got.task.context_id, got.task.status.state)
        for scope, context, state in itertools.product(
            [ALICE, BOB, scope_key("", "carol")], ["", "c1"], [S.TASK_STATE_UNSPECIFIED, *states]
        ):
            want = [
                i
                for i in reversed(order)
                if model[i][0] == scope
                and context in ("", model[i][1])
                and state in (S.TASK_STATE_UNSPECIFIED, model[i][2])
            ]
            query = TaskQuery(context, state, page_size=rng.randint(1, 5), scope=scope)
            assert await _listed(journal, query) == want, (round_, scope, context, state)
            assert (await journal.list(query)).total_size == len(want)


async def test_pages_return_each_task_once_while_tasks_are_written_between_them(
    journal: TaskJournal,
) -> None:
    """Tasks written after the first page moved up: later pages skip them, never repeat one,
    and every task not written meanwhile is returned once, in order."""
    versions = {}
    for n in range(20):
        t = task(f"t{n:02}")
        versions[t.id] = (t, await journal.create(t, [change(1, t)], scope=ALICE))
    await journal.create(task("bobs"), [change(1, task("bobs"))], scope=BOB)
    query = TaskQuery(page_size=6, scope=ALICE)
    page = await journal.list(query)
    seen = [t.id for t in page.tasks]
    touched = set()
    while page.next_page_token:
        for task_id in ("t00", "t15", "t03"):  # above and below the pages' cursor
            t, version = versions[task_id]
            t.status.state = S.TASK_STATE_WORKING
            versions[task_id] = (t, await journal.update(t, version, [change(version + 1, t)]))
            touched.add(task_id)
        late = task(f"late{len(seen)}")
        await journal.create(late, [change(1, late)], scope=ALICE)
        page = await journal.list(replace(query, page_token=page.next_page_token))
        seen += [t.id for t in page.tasks]
    assert len(seen) == len(set(seen)), "a task listed twice"
    assert "bobs" not in seen and not any(i.startswith("late") for i in seen)
    untouched = [f"t{n:02}" for n in reversed(range(20)) if f"t{n:02}" not in touched]
    assert [i for i in seen if i in untouched] == untouched


@pytest.fixture
async def nats_journal(nats_url: str) -> AsyncIterator[JetStreamJournal]:
    """A JetStream journal alone (for what only it does: its messages' ids)."""
    async with jetstream_journal(nats_url, Formats()) as journal:
        yield journal


async def test_another_write_of_the_same_change_number_is_not_taken_for_the_first(
    nats_journal: JetStreamJournal,
) -> None:
    """A retried write recognises its own earlier attempt by its message id; another write
    numbered the same by the same writer (the final state written after a change whose
    outcome was not known yet) must not pass for it: it would be taken as recorded while
    the record holds the other change (fault seed 401577 on 3 nodes)."""
    v1 = await create(nats_journal, task("a"))
    working = task("a", state=S.TASK_STATE_WORKING)
    await nats_journal.update(working, v1, [change(2, working)])
    failed = task("a", state=S.TASK_STATE_FAILED)
    [(_, _, other)] = _messages("a", [change(2, failed)], 1 << 20, "instance-1")
    assert await nats_journal._landed("a", v1, other) == 0
    [(_, _, same)] = _messages("a", [change(2, working)], 1 << 20, "instance-1")
    assert same["Nats-Msg-Id"] != other["Nats-Msg-Id"], "one id per write, not per number"

"""The task log of format 3 (``jetstream.tasklog``) on a real nats-server: one node, and R3.

Issue 41, step 1 of docs/decisions/0001-cluster-store-layout.md: one message per
change, a compare-and-set over the task's subjects, reads by id, and the listing
index nats-server keeps by itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from a2a.types.a2a_pb2 import (
    Artifact,
    Part,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from nats.aio.client import Client as NATS
from nats.js.api import StreamInfo

from a2a_grpc_server._internal.errors import UnknownFormatError
from a2a_grpc_server._internal.jetstream import tasklog
from a2a_grpc_server._internal.jetstream.formats import HEADER as FORMAT
from a2a_grpc_server._internal.jetstream.records import MSG_ID, STREAM_SEQ
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.retry import Retry
from a2a_grpc_server._internal.jetstream.tasklog import LogRead, TaskLog, Where
from a2a_grpc_server._internal.journal import (
    Change,
    FinalTaskError,
    StoreError,
    TaskExistsError,
    UnknownTaskError,
    VersionConflictError,
)
from tests.support import natsserver
from tests.support.spikes import add_stream

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 30.0
WORKING = TaskState.TASK_STATE_WORKING
COMPLETED = TaskState.TASK_STATE_COMPLETED


@pytest.fixture
async def streams(nc: NATS, cluster: natsserver.Cluster) -> AsyncIterator[None]:
    """The log and its index, at as many replicas as nodes; deleted after the test."""
    js = nc.jetstream(timeout=2.0)
    replicas = len(cluster.nodes)
    requests = JetStreamRequests(nc)
    await requests.start()

    async def answers() -> None:  # (on R3: until the streams answer on this node)
        await requests.direct_get(tasklog.LOG_STREAM, {"last_by_subj": "a2a.log.>"}, 2.0)
        await requests.direct_get(tasklog.CURRENT_STREAM, {"last_by_subj": "a2a.cur.>"}, 2.0)

    async with asyncio.timeout(TIMEOUT):
        await add_stream(js, tasklog.log_config(replicas))
        await add_stream(js, tasklog.current_config(replicas), answers)
    await requests.close()
    try:
        yield
    finally:
        for name in (tasklog.CURRENT_STREAM, tasklog.LOG_STREAM):
            await js.delete_stream(name)


@pytest.fixture
async def log(nc: NATS, streams: None) -> AsyncIterator[TaskLog]:
    """A log on ``nc``, writing as instance ``i1``."""
    requests = JetStreamRequests(nc)
    await requests.start()
    try:
        yield TaskLog(requests, "i1", Retry(10.0))
    finally:
        await requests.close()


def frame(task_id: str, state: int) -> bytes:
    """A status frame of ``task_id``."""
    status = TaskStatusUpdateEvent(task_id=task_id, status=TaskStatus(state=state))  # type: ignore[arg-type]
    return StreamResponse(status_update=status).SerializeToString()


def artifact(task_id: str, size: int) -> bytes:
    """An artifact frame of ``task_id`` with ``size`` bytes of text."""
    part = Part(text="x" * size)
    event = TaskArtifactUpdateEvent(task_id=task_id, artifact=Artifact(parts=[part]))
    return StreamResponse(artifact_update=event).SerializeToString()


def snapshot(task_id: str, state: int, context: str = "c1") -> Task:
    """The task ``task_id`` in ``state``."""
    return Task(id=task_id, context_id=context, status=TaskStatus(state=state))  # type: ignore[arg-type]


def status(seq: int, task_id: str, state: int) -> Change:
    """Change ``seq``: a status frame."""
    return Change(seq, frame(task_id, state), state)


async def stored(nc: NATS, stream: str, subjects: str) -> dict[str, int]:
    """How many messages ``stream`` holds on each subject matching ``subjects``."""
    info: StreamInfo = await nc.jetstream(timeout=TIMEOUT).stream_info(
        stream, subjects_filter=subjects
    )
    return dict(info.state.subjects or {})


async def index_entry(nc: NATS, where: Where) -> tasklog.Logged:
    """The task's one entry in the index, once the index has copied its newest ``s`` or ``f``."""
    requests = JetStreamRequests(nc)
    await requests.start()
    subject = tasklog.current_subject(where.scope, where.context_id, where.task_id)
    try:
        async with asyncio.timeout(TIMEOUT):
            last = await TaskLog(requests, "reader").last(where.task_id)
            assert last is not None
            while True:
                msgs = await requests.direct_get(
                    tasklog.CURRENT_STREAM, {"last_by_subj": subject}, 2.0
                )
                origin = (msgs[0].headers or {}).get(tasklog.SOURCE, "") if msgs else ""
                if origin and int(origin.split(" ")[1]) >= last.pos:
                    return tasklog.decode(msgs[0])
                await asyncio.sleep(0.01)  # sync-ok: polls until the copy lands (bounded above)
    finally:
        await requests.close()


async def test_a_task_is_written_one_message_per_change_and_read_by_id(
    log: TaskLog, nc: NATS
) -> None:
    where = Where("t1", "i1", "scope-a", "c1")
    v1 = await log.append(where, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    v2 = await log.append(where, [Change(2, artifact("t1", 10))], None, v1)
    v3 = await log.append(where, [Change(3, artifact("t1", 20))], None, v2)

    read = await log.read("t1")
    assert isinstance(read, LogRead)
    assert (read.snapshot.kind, read.snapshot.pos, read.version, read.seq) == ("s", v1, v3, 3)
    assert read.snapshot.task().status.state == WORKING
    assert read.snapshot.scope == "scope-a"
    assert [(e.seq, e.pos) for e in read.after] == [(2, v2), (3, v3)]
    assert await log.entries("t1", v1) == read.after

    final = snapshot("t1", COMPLETED)
    v4 = await log.append(where, [status(4, "t1", COMPLETED)], final, v3)
    read = await log.read("t1")
    assert read is not None and read.final
    assert (read.snapshot.kind, read.version, read.seq, read.after) == ("f", v4, 4, [])
    assert read.snapshot.task() == final
    assert await log.read("t2") is None
    kinds = sorted(s.rsplit(".", 1)[1] for s in await stored(nc, tasklog.LOG_STREAM, "a2a.log.>"))
    assert kinds == ["e", "f", "s"]  # (one subject per kind and owner: e holds two)


async def test_each_refused_write_names_its_cause_and_stores_nothing(
    log: TaskLog, nc: NATS
) -> None:
    where = Where("t1", "i1", "s", "c1")
    v1 = await log.append(where, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    v2 = await log.append(where, [Change(2, artifact("t1", 1))], None, v1)
    with pytest.raises(TaskExistsError):
        await log.append(where, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    with pytest.raises(VersionConflictError):
        await log.append(where, [Change(3, artifact("t1", 1))], None, v1)
    with pytest.raises(UnknownTaskError):
        await log.append(Where("t9", "i1", "s", "c1"), [Change(2, artifact("t9", 1))], None, 7)
    await log.append(where, [status(3, "t1", COMPLETED)], snapshot("t1", COMPLETED), v2)
    with pytest.raises(FinalTaskError):
        await log.append(where, [Change(4, artifact("t1", 1))], None, v2 + 1)
    with pytest.raises(ValueError, match="subject token"):
        Where("a.b", "i1", "s", "c1").subject("s")
    with pytest.raises(ValueError, match="final change"):
        tasklog.encode([status(2, "t1", COMPLETED)], None, where, "i1")
    assert sum((await stored(nc, tasklog.LOG_STREAM, "a2a.log.>")).values()) == 3


async def test_of_two_writers_at_one_version_exactly_one_is_stored(
    log: TaskLog, nc: NATS, cluster: natsserver.Cluster
) -> None:
    where = Where("t1", "i1", "s", "c1")
    v1 = await log.append(where, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    other = await nats.connect(cluster.urls[-1])  # (on R3 another node than ``nc``'s)
    requests = JetStreamRequests(other)
    await requests.start()
    try:
        theirs = TaskLog(requests, "i2", Retry(10.0))
        claim = Where("t1", "i2", "s", "c1")
        results = await asyncio.gather(
            log.append(where, [Change(2, artifact("t1", 1))], None, v1),
            theirs.append(claim, [status(2, "t1", WORKING)], snapshot("t1", WORKING), v1),
            return_exceptions=True,
        )
    finally:
        await requests.close()
        await other.close()
    won = [r for r in results if isinstance(r, int)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], VersionConflictError)
    read = await log.read("t1")
    assert read is not None and read.version == won[0] and read.seq == 2


async def test_after_a_claim_a_read_takes_the_new_owners_snapshot_and_events(
    log: TaskLog, nc: NATS
) -> None:
    mine = Where("t1", "i1", "s", "c1")
    v1 = await log.append(mine, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    v2 = await log.append(mine, [Change(2, artifact("t1", 1))], None, v1)
    theirs = Where("t1", "i2", "s", "c1")
    v3 = await log.append(theirs, [status(3, "t1", WORKING)], snapshot("t1", WORKING), v2)
    v4 = await log.append(theirs, [Change(4, artifact("t1", 2))], None, v3)

    read = await log.read("t1")
    assert read is not None
    assert (read.snapshot.pos, read.snapshot.owner) == (v3, "i2")
    assert [(e.seq, e.pos) for e in read.after] == [(4, v4)]
    assert [e.seq for e in await log.entries("t1", 0)] == [1, 2, 3, 4]


async def test_a_retry_recognises_its_own_landed_write_and_nobody_elses(
    log: TaskLog, nc: NATS
) -> None:
    where = Where("t1", "i1", "s", "c1")
    v1 = await log.append(where, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    v2 = await log.append(where, [Change(2, artifact("t1", 1))], None, v1)
    last = await log.last("t1")
    assert last is not None and last.pos == v2
    requests = JetStreamRequests(nc)
    await requests.start()
    try:
        msgs = await requests.direct_get(tasklog.LOG_STREAM, {"seq": v2}, 2.0)
    finally:
        await requests.close()
    own = (msgs[0].headers or {})[MSG_ID]
    assert int((msgs[0].headers or {})[STREAM_SEQ]) == v2
    assert await log.landed("t1", v1, {MSG_ID: own}) == v2
    assert await log.landed("t1", v1, {MSG_ID: own + "0"}) == 0
    assert await log.landed("t1", v2, {MSG_ID: own}) == 0


async def test_changes_too_large_for_one_message_take_several_and_read_back_whole(
    log: TaskLog, nc: NATS
) -> None:
    where = Where("t1", "i1", "s", "c1")
    v1 = await log.append(where, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    size = nc.max_payload // 3
    big = [Change(seq, artifact("t1", size)) for seq in (2, 3, 4)]
    v = await log.append(where, big, snapshot("t1", WORKING), v1)
    read = await log.read("t1")
    assert read is not None and read.version == v
    # (the last message holds the snapshot: the changes before it came as e)
    assert read.snapshot.pos == v and [e.seq for e in read.snapshot.changes] == [4]
    assert [e.seq for e in await log.entries("t1", v1)] == [2, 3, 4]
    huge = Task(id="t1", history=[], artifacts=[Artifact(parts=[Part(text="y" * nc.max_payload)])])
    with pytest.raises(StoreError, match="exceeds a NATS message"):
        await log.append(where, [Change(5, artifact("t1", 1))], huge, v)


async def test_a_message_in_another_format_is_refused_not_guessed(log: TaskLog, nc: NATS) -> None:
    where = Where("t1", "i1", "s", "c1")
    kind, payload, headers = tasklog.encode(
        [status(1, "t1", WORKING)], snapshot("t1", WORKING), where, "i1"
    )
    headers[FORMAT] = "4"
    await nc.jetstream(timeout=TIMEOUT).publish(where.subject(kind), payload, headers=headers)
    with pytest.raises(UnknownFormatError, match="4"):
        await log.read("t1")


async def test_the_index_holds_each_tasks_newest_snapshot_under_one_subject(
    log: TaskLog, nc: NATS
) -> None:
    where = Where("t1", "i1", "scope-a", "ctx-1")
    v1 = await log.append(where, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    entry = await index_entry(nc, where)
    assert (entry.kind, entry.task().status.state) == ("s", WORKING)
    v2 = await log.append(where, [Change(2, artifact("t1", 1))], None, v1)
    claim = Where("t1", "i2", "scope-a", "ctx-1")
    v3 = await log.append(claim, [status(3, "t1", WORKING)], snapshot("t1", WORKING), v2)
    final = snapshot("t1", COMPLETED, "ctx-1")
    await log.append(claim, [status(4, "t1", COMPLETED)], final, v3)

    entry = await index_entry(nc, where)
    assert (entry.kind, entry.owner, entry.scope) == ("f", "i2", "scope-a")
    assert entry.task() == final
    subjects = await stored(nc, tasklog.CURRENT_STREAM, "a2a.cur.>")
    assert subjects == {tasklog.current_subject("scope-a", "ctx-1", "t1"): 1}


async def test_a_unary_task_that_runs_and_ends_is_two_writes_one_if_it_ends_at_once(
    log: TaskLog, nc: NATS
) -> None:
    js = nc.jetstream(timeout=TIMEOUT)
    before = (await js.stream_info(tasklog.LOG_STREAM)).state.last_seq
    runs = Where("t1", "i1", "s", "c1")
    v1 = await log.append(runs, [status(1, "t1", WORKING)], snapshot("t1", WORKING), 0)
    done = snapshot("t1", COMPLETED)
    await log.append(runs, [status(2, "t1", COMPLETED)], done, v1)
    ends = Where("t2", "i1", "s", "c1")
    await log.append(ends, [status(1, "t2", COMPLETED)], snapshot("t2", COMPLETED), 0)
    after = (await js.stream_info(tasklog.LOG_STREAM)).state.last_seq
    assert after - before == 3  # (each write one acknowledged message: 2 + 1)
    read = await log.read("t2")
    assert read is not None and read.final and read.seq == 1

"""The record spread over several event streams (``nats_event_streams``), on a real
nats-server: tasks land in every stream, and everything a task's record serves (relayed
subscribers, cancels through another instance, resumes, reads) works the same wherever
its record is, through an instance spreading over three streams and one keeping to one."""

from __future__ import annotations

import asyncio

import nats
from a2a.types.a2a_pb2 import CancelTaskRequest, StreamResponse, Task, TaskState

from a2a_grpc_server._internal.jetstream.conn import TASKS_BUCKET, NatsConfig, connect
from a2a_grpc_server._internal.jetstream.formats import Formats
from a2a_grpc_server._internal.jetstream.journal import SHARD, JetStreamJournal, shard_for
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.journal import Change
from tests.cluster.test_cluster import attach, start_task, stored_state
from tests.support import formatfixtures as fx
from tests.support.agents import GatedPerTask
from tests.support.clusterharness import collect, instances, start_instance, stop_instance
from tests.support.harness import last_state, read_all, resume_call, seq_of

S = TaskState
STREAMS = 3
RUNS = 30


async def shard_of(nats_url: str, task_id: str) -> int:
    """The event stream the task's snapshot names (its header; absent: 0)."""
    client = await nats.connect(nats_url)
    try:
        msg = await client.jetstream().get_msg(
            f"KV_{TASKS_BUCKET}", subject=f"$KV.{TASKS_BUCKET}.{task_id}"
        )
        return int((msg.headers or {}).get(SHARD, "0"))
    finally:
        await client.close()


async def test_tasks_spread_over_the_event_streams_behave_as_on_one(nats_url: str) -> None:
    agent = GatedPerTask()
    async with (
        asyncio.timeout(60),
        # (the bucket's event streams: tasks in the task log have none)
        instances(agent, [nats_url], lease=1.0, event_streams=STREAMS, task_log=False) as (a, b),
    ):
        await a.service.cluster.formats.wait_for(2)  # type: ignore[union-attr]
        # (settled: every instance heard reading records where snapshots say)
        one = await start_instance(
            "C", agent, [nats_url], lease=1.0, event_streams=1, task_log=False
        )
        try:
            shards: set[int] = set()
            for run in range(RUNS):  # (ids are random: until every stream has had a task)
                if shards == set(range(STREAMS)) and run >= 6:
                    break
                task_id, sender = await start_task(a)
                shard = await shard_of(nats_url, task_id)
                assert shard == shard_for(task_id, STREAMS)
                shards.add(shard)
                streams = [sender, await attach(b, task_id), await attach(one, task_id)]
                tails = asyncio.gather(*(collect(s) for s in streams))
                if run % 3 == 0:  # a cancel through another instance
                    await b.client.cancel_task(CancelTaskRequest(id=task_id))
                    want = S.TASK_STATE_CANCELED
                else:
                    agent.release(task_id)
                    want = S.TASK_STATE_COMPLETED
                ends = [last_state(frames) for frames in await tails]
                assert ends == [want] * 3, (run, shard, ends)
                for instance in (a, b, one):
                    assert await stored_state(instance, task_id) == want
                # A resume from the first frame, through the instance keeping to one stream.
                frames: list[StreamResponse] = []
                await read_all(resume_call(one.stub, task_id, 0), frames)
                assert [seq_of(f) for f in frames] == list(range(1, len(frames) + 1)), shard
                assert last_state(frames) == want
            assert shards == set(range(STREAMS)), "every stream holds some task"
        finally:
            await stop_instance(one)


async def test_new_tasks_keep_to_the_first_stream_while_an_older_version_is_heard(
    nats_url: str,
) -> None:
    """An instance of a version that reads only A2A_EVENTS (its heartbeat does not say
    ``shards``) is in the cluster: new tasks go to the first stream, whatever the setting."""
    conn = await connect(NatsConfig(servers=[nats_url], event_streams=STREAMS))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    formats = Formats()
    formats.settle()
    journal = JetStreamJournal(requests, conn.js, "i-1", formats=formats, event_streams=STREAMS)
    try:
        ids = [f"t-{n}" for n in range(12)]
        assert {shard_for(i, STREAMS) for i in ids} == set(range(STREAMS))
        formats.heard("old-1", fx.load("heartbeat-2")[1])  # (formats 1 and 2, no features)
        for task_id in ids[:6]:
            await create(journal, task_id)
            assert await shard_of(nats_url, task_id) == 0
        formats.gone("old-1")
        for task_id in ids[6:]:
            await create(journal, task_id)
            assert await shard_of(nats_url, task_id) == shard_for(task_id, STREAMS)
        for task_id in ids:
            got = await journal.get(task_id)
            assert got is not None and got.task.status.state == S.TASK_STATE_WORKING
            assert [e.seq for e in await journal.entries(task_id, 0)] == [1]
    finally:
        await journal.close()
        await requests.close()
        await conn.close()


async def create(journal: JetStreamJournal, task_id: str) -> None:
    task = Task(id=task_id, context_id="c")
    task.status.state = S.TASK_STATE_WORKING
    frame = StreamResponse(task=task).SerializeToString()
    await journal.create(task, [Change(1, frame, task.status.state)])

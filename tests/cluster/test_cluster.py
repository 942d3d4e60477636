"""Two and three instances on a real nats-server: every subscriber on every instance
gets the task's outcome, whichever instance the request went through."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)

from a2a_grpc_server._internal.jetstream.conn import EVENTS_STREAM
from a2a_grpc_server._internal.jetstream.journal import subject
from a2a_grpc_server._internal.model import taskops
from tests.support import natsserver
from tests.support.agents import (
    BurstAgent,
    CallerAgent,
    ChunkAgent,
    FloodAgent,
    GatedPerTask,
    InputAgent,
    StepAgent,
)
from tests.support.clusterharness import Instance, collect, instances
from tests.support.harness import (
    RESUME,
    V1,
    assert_each_rebuilds,
    attach_as_it_flows,
    burst_to_readers,
    last_state,
    read_all,
    resume_call,
    rich_status,
    send_request,
    seq_of,
)

S = TaskState

pytestmark = pytest.mark.usefixtures("layout")  # (every test on both layouts: conftest)


async def start_task(
    owner: Instance,
) -> tuple[str, AsyncIterator[StreamResponse]]:
    """A streaming send on ``owner``; returns once WORKING is persisted and broadcast."""
    sender = owner.client.send_message_streaming(send_request("go"))
    first = await anext(sender)
    assert first.WhichOneof("payload") == "task"
    working = await anext(sender)  # so every later snapshot, local or relayed, has it
    assert working.status_update.status.state == S.TASK_STATE_WORKING
    return first.task.id, sender


async def attach(instance: Instance, task_id: str) -> AsyncIterator[StreamResponse]:
    """SubscribeToTask on ``instance``; returns once its snapshot frame arrived."""
    sub = instance.client.subscribe(SubscribeToTaskRequest(id=task_id))
    snapshot = await anext(sub)
    assert snapshot.WhichOneof("payload") == "task"
    assert snapshot.task.id == task_id
    return sub  # type: ignore[no-any-return]


async def stored_state(instance: Instance, task_id: str) -> TaskState:
    task = await instance.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
    state: TaskState = task.status.state
    return state


@pytest.mark.parametrize("cooperative", [True, False], ids=["cooperative", "noop-cancel"])
async def test_cancel_through_the_non_owner_ends_every_stream_on_both_instances_canceled(
    nats_url: str, cooperative: bool
) -> None:
    agent = GatedPerTask(cooperative=cooperative)
    async with asyncio.timeout(50), instances(agent, [nats_url]) as (a, b):
        for run in range(20):
            task_id, sender = await start_task(a)
            streams = [sender, await attach(a, task_id), await attach(b, task_id)]
            streams.append(await attach(b, task_id))
            tails = asyncio.gather(*(collect(s) for s in streams))
            canceled = await b.client.cancel_task(CancelTaskRequest(id=task_id))
            assert canceled.status.state == S.TASK_STATE_CANCELED
            ends = [last_state(frames) for frames in await tails]
            assert ends == [S.TASK_STATE_CANCELED] * 4, f"run {run}: {ends}"
            assert await stored_state(a, task_id) == S.TASK_STATE_CANCELED
            assert await stored_state(b, task_id) == S.TASK_STATE_CANCELED


async def test_executor_crash_on_the_owner_ends_streams_on_both_instances_failed(
    nats_url: str,
) -> None:
    agent = GatedPerTask(crash=True)
    async with asyncio.timeout(20), instances(agent, [nats_url]) as (a, b):
        task_id, sender = await start_task(a)
        streams = [sender, await attach(a, task_id), await attach(b, task_id)]
        tails = asyncio.gather(*(collect(s) for s in streams))
        agent.release(task_id)
        results = await tails
        assert [last_state(f) for f in results] == [S.TASK_STATE_FAILED] * 3
        texts = {f[-1].status_update.status.message.parts[0].text for f in results}
        assert texts == {"agent failed with RuntimeError"}
        assert await stored_state(b, task_id) == S.TASK_STATE_FAILED


async def test_completion_on_the_owner_reaches_the_other_instance_with_every_frame(
    nats_url: str,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(20), instances(agent, [nats_url]) as (a, b):
        task_id, sender = await start_task(a)
        on_a, on_b = await attach(a, task_id), await attach(b, task_id)
        tails = asyncio.gather(collect(sender), collect(on_a), collect(on_b))
        agent.release(task_id)
        from_sender, from_a, from_b = await tails
        assert from_a == from_b, "a relayed subscriber sees exactly the owner's frames"
        assert [f.WhichOneof("payload") for f in from_b] == ["artifact_update", "status_update"]
        assert last_state(from_sender) == S.TASK_STATE_COMPLETED


async def test_a_subscriber_attaching_on_the_non_owner_mid_stream_misses_and_repeats_nothing(
    nats_url: str,
) -> None:
    agent = FloodAgent(count=300, size=64, window=150)
    async with asyncio.timeout(30), instances(agent, [nats_url]) as (a, b):
        sender = a.client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        on_a = await attach(a, task_id)
        agent.release.set()
        from_a: list[StreamResponse] = []
        while sum(f.WhichOneof("payload") == "artifact_update" for f in from_a) < 150:
            from_a.append(await anext(on_a))
        for _ in range(75):  # the second half flows while B attaches
            agent.credits.release()
        sub_b = b.client.subscribe(SubscribeToTaskRequest(id=task_id))
        snapshot = (await anext(sub_b)).task
        for _ in range(75):  # (the task cannot end before B attached)
            agent.credits.release()
        rest_a, from_b = await asyncio.gather(collect(on_a), collect(sub_b))
        from_a += rest_a
        # B's frames are exactly A's after the point of B's snapshot: no gap, no duplicate.
        seen = len(snapshot.artifacts)
        assert 150 <= seen <= 300
        a_artifacts = [f for f in from_a if f.WhichOneof("payload") == "artifact_update"]
        b_artifacts = [f for f in from_b if f.WhichOneof("payload") == "artifact_update"]
        assert len(a_artifacts) == 300
        assert b_artifacts == a_artifacts[seen:]
        assert last_state(from_a) == last_state(from_b) == S.TASK_STATE_COMPLETED
        rebuilt = taskops.copy(snapshot)
        for frame in from_b:
            if frame.WhichOneof("payload") == "artifact_update":
                taskops.apply(rebuilt, frame.artifact_update)
        stored = await b.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert list(rebuilt.artifacts) == list(stored.artifacts)
        await collect(sender)


async def test_a_follow_up_through_the_non_owner_runs_on_the_owner_and_streams_back(
    nats_url: str,
) -> None:
    async with asyncio.timeout(20), instances(InputAgent(), [nats_url]) as (a, b):
        asked = await a.client.send_message(send_request("hi"))
        task = asked.task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        on_a = await attach(a, task.id)
        a_tail = asyncio.ensure_future(collect(on_a))
        reply = b.client.send_message_streaming(send_request("Ada", task_id=task.id))
        frames = await collect(reply)
        assert frames[0].WhichOneof("payload") == "task"
        assert frames[0].task.history[-1].parts[0].text == "Ada"
        assert last_state(frames) == S.TASK_STATE_COMPLETED
        assert frames[-1].status_update.status.message.parts[0].text == "hello Ada"
        assert last_state(await a_tail) == S.TASK_STATE_COMPLETED
        stored = await a.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
        assert [m.parts[0].text for m in stored.history][:1] == ["hi"]
        assert any(m.parts[0].text == "Ada" for m in stored.history)


async def test_a_blocking_follow_up_through_the_non_owner_returns_the_completed_task(
    nats_url: str,
) -> None:
    async with asyncio.timeout(20), instances(InputAgent(), [nats_url]) as (a, b):
        asked = await a.client.send_message(send_request("hi"))
        done = await b.client.send_message(send_request("Bo", task_id=asked.task.id))
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        assert done.task.status.message.parts[0].text == "hello Bo"


async def test_the_owner_executor_sees_the_metadata_of_a_follow_up_sent_through_the_non_owner(
    nats_url: str,
) -> None:
    agent = CallerAgent()
    async with asyncio.timeout(20), instances(agent, [nats_url]) as (a, b):
        asked = await a.stub.SendMessage(send_request("who"), metadata=V1)
        metadata = (*V1, ("x-team", "green"), ("a2a-extensions", "urn:x,urn:y"))
        done = await b.stub.SendMessage(
            send_request("me", task_id=asked.task.id), metadata=metadata
        )
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        headers, extensions, _, _ = agent.seen[-1]
        assert headers["x-team"] == "green"
        assert extensions == {"urn:x", "urn:y"}


async def test_cancel_of_an_ended_task_through_the_non_owner_is_refused_clearly(
    nats_url: str,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(20), instances(agent, [nats_url]) as (a, b):
        task_id, sender = await start_task(a)
        agent.release(task_id)
        await collect(sender)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await b.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert rich_status(err.value)[1].reason == "TASK_NOT_CANCELABLE"


async def test_the_record_numbers_a_tasks_changes_without_gaps_in_stream_order(
    nats_url: str,
) -> None:
    async with asyncio.timeout(20), instances(InputAgent(), [nats_url]) as (a, b):
        asked = await a.client.send_message(send_request("hi"))
        await b.client.send_message(send_request("Cy", task_id=asked.task.id))
        entries = await a.cluster.journal.entries(asked.task.id, 0)
        assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
        positions = [e.pos for e in entries]
        assert positions == sorted(positions)
        assert [e.kind for e in entries].count("message") == 1, "the follow-up message"
        final = StreamResponse.FromString(entries[-1].data)
        assert final.status_update.status.state == S.TASK_STATE_COMPLETED
        assert entries[-1].final
        recorded = await b.cluster.journal.get(asked.task.id)
        assert recorded is not None
        assert (recorded.seq, recorded.version) == (entries[-1].seq, entries[-1].pos)


@pytest.mark.timeout(150)
async def test_a_burst_reaches_every_relayed_subscriber_whole_in_order_with_the_outcome(
    nats_url: str,
) -> None:
    agent = BurstAgent(count=10_000)
    async with asyncio.timeout(140), instances(agent, [nats_url]) as (a, b):
        from_sender, readers = await burst_to_readers(a.stub, b.address, agent, 100)
        expected = [f"chunk-{i}" for i in range(10_000)]
        assert [f.artifact_update.artifact.artifact_id for f in from_sender[:-1]] == expected
        assert last_state(from_sender) == S.TASK_STATE_COMPLETED
        for stream in readers:
            assert stream["ids"] == expected
            assert stream["last_state"] == S.TASK_STATE_COMPLETED
            assert stream["same_as_first"]
        assert b.service.metrics.frames_dropped == 0


async def test_subscribers_attaching_on_the_owner_mid_stream_rebuild_the_recorded_task(
    nats_url: str,
) -> None:
    agent = ChunkAgent(count=400)
    async with asyncio.timeout(40), instances(agent, [nats_url]) as (a, b):
        points = sorted(random.Random(11).sample(range(1, 400), 30))
        _, streams, task_id = await attach_as_it_flows(a.stub, agent, points)
        stored = await b.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert len(streams) == 30
        assert_each_rebuilds(streams, stored)


async def test_a_stream_cut_on_the_owner_resumes_on_the_other_instance_exactly_after_its_cursor(
    nats_url: str,
) -> None:
    agent = StepAgent()
    async with asyncio.timeout(20), instances(agent, [nats_url]) as (a, b):
        sender = a.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
        task_id = (await sender.read()).task.id
        watcher = a.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=RESUME)
        assert seq_of(await watcher.read()) >= 1
        agent.step(3)
        seen: list[StreamResponse] = []
        while len([f for f in seen if f.WhichOneof("payload") == "artifact_update"]) < 2:
            seen.append(await watcher.read())
        cursor = seq_of(seen[-1])
        watcher.cancel()  # instance A's connection is cut; the client goes to B
        relayed = b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=RESUME)
        relayed_snapshot = await relayed.read()
        agent.step(2)
        agent.finish()
        everything: list[StreamResponse] = []
        await read_all(sender, everything)
        resumed: list[StreamResponse] = []
        await read_all(resume_call(b.stub, task_id, cursor), resumed)
        assert resumed == [f for f in everything if seq_of(f) > cursor], "exactly what followed"
        from_relay: list[StreamResponse] = []
        await read_all(relayed, from_relay)
        after = seq_of(relayed_snapshot)
        assert from_relay == [f for f in everything if seq_of(f) > after], "same numbers on B"


async def test_an_ended_task_resumes_from_the_record_on_any_instance(nats_url: str) -> None:
    agent = StepAgent()
    async with asyncio.timeout(20), instances(agent, [nats_url]) as (a, b):
        sender = a.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
        agent.step(3)
        agent.finish()
        frames: list[StreamResponse] = []
        await read_all(sender, frames)
        task_id, final = frames[0].task.id, seq_of(frames[-1])
        for instance in (a, b):
            resumed: list[StreamResponse] = []
            await read_all(resume_call(instance.stub, task_id, 2), resumed)
            assert resumed == [f for f in frames if seq_of(f) > 2]
            ended: list[StreamResponse] = []
            await read_all(resume_call(instance.stub, task_id, final), ended)
            assert ended == []


BUCKET_ONLY = pytest.mark.parametrize("layout", ["format-2"], indirect=True)
"""A limit of the bucket's event streams (``events_per_task``, ``events_ttl``); the task log
keeps a task's changes as long as the task (tests/cluster/test_logjournal.py)."""


@BUCKET_ONLY
async def test_a_cursor_older_than_the_record_keeps_is_out_of_range_on_the_other_instance() -> None:
    agent = StepAgent()
    with natsserver.running(1) as cluster:
        async with (
            asyncio.timeout(20),
            instances(agent, cluster.urls, events_per_task=4) as (a, b),
        ):
            sender = a.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
            frames = [await sender.read(), await sender.read()]  # the task, WORKING
            for _ in range(5):  # one write (one message) per change
                agent.step()
                frames.append(await sender.read())
            agent.finish()
            await read_all(sender, frames)
            task_id, final = frames[0].task.id, seq_of(frames[-1])
            with pytest.raises(grpc.aio.AioRpcError) as old:
                await read_all(resume_call(b.stub, task_id, 1), [])
            assert old.value.code() == grpc.StatusCode.OUT_OF_RANGE
            info = rich_status(old.value)[1]
            assert info.reason == "FRAME_NOT_KEPT"
            assert int(info.metadata["oldestKeptSeq"]) == final - 3
            kept: list[StreamResponse] = []
            await read_all(resume_call(b.stub, task_id, final - 4), kept)
            assert [seq_of(f) for f in kept] == list(range(final - 3, final + 1))


@BUCKET_ONLY
async def test_a_task_whose_messages_left_the_stream_still_takes_its_follow_up(
    nats_url: str,
) -> None:
    async with asyncio.timeout(20), instances(InputAgent(), [nats_url]) as (a, b):
        asked = await a.client.send_message(send_request("hi"))
        task_id = asked.task.id
        assert asked.task.status.state == S.TASK_STATE_INPUT_REQUIRED
        # What a task parked past events_ttl (or past the stream's byte limit) meets:
        # its messages are gone, its snapshot stays.
        await a.cluster.conn.js.purge_stream(EVENTS_STREAM, subject=subject(task_id))
        assert await a.cluster.journal.last_entry(task_id) is None
        done = await b.client.send_message(send_request("Ada", task_id=task_id))
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        assert done.task.status.message.parts[0].text == "hello Ada"
        assert await stored_state(b, task_id) == S.TASK_STATE_COMPLETED

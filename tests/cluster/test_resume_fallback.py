"""The resume extension's snapshot fallback across two instances on a real nats-server.

The event stream keeps four messages per task (``events_per_task=4``): a cursor
older than that cannot be replayed from the record on the instance that does not
run the task, so the fallback answers with the task as it stands, marked, and the
stream goes on from there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from a2a.types.a2a_pb2 import StreamResponse, SubscribeToTaskRequest, TaskState
from google.protobuf import json_format

from a2a_grpc_server._internal.rpc.resume import FALLBACK_KEY, RESUME_AFTER_KEY, SNAPSHOT, URI
from tests.support import natsserver
from tests.support.agents import StepAgent
from tests.support.clusterharness import instances
from tests.support.harness import (
    RESUME,
    read_all,
    resume_call,
    rich_status,
    send_request,
    seq_of,
)

S = TaskState


def fallback_call(stub: Any, task_id: str, after: int) -> Any:
    """SubscribeToTask resumed after ``after``, with the snapshot fallback."""
    metadata = (*RESUME, (FALLBACK_KEY, SNAPSHOT), (RESUME_AFTER_KEY, str(after)))
    return stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=metadata)


def skipped_of(frame: StreamResponse) -> tuple[int, int]:
    """The frames a snapshot stands in for, as (from, to)."""
    assert frame.WhichOneof("payload") == "task", "the fallback answers with the task"
    skipped = json_format.MessageToDict(frame.task.metadata)[URI]["skipped"]
    return int(skipped["from"]), int(skipped["to"])


async def collected(call: Any) -> list[StreamResponse]:
    frames: list[StreamResponse] = []
    await read_all(call, frames)
    return frames


async def test_a_cursor_the_record_no_longer_holds_gets_the_task_then_every_later_frame() -> None:
    agent = StepAgent()
    with natsserver.running(1) as cluster:
        async with (
            asyncio.timeout(30),
            # (40 messages: more than the changes between two snapshots, 32, so the
            # record can always tell the task as it stands)
            instances(agent, cluster.urls, events_per_task=40) as (a, b),
        ):
            sender = a.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
            frames = [await sender.read(), await sender.read()]  # the task, WORKING
            for _ in range(45):  # one write (one message) per change
                agent.step()
                frames.append(await sender.read())
            task_id, at = frames[0].task.id, seq_of(frames[-1])
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                await collected(resume_call(b.stub, task_id, 1))
            assert plain.value.code() == grpc.StatusCode.OUT_OF_RANGE, "without it: unchanged"
            resumed = fallback_call(b.stub, task_id, 1)
            snapshot = await resumed.read()
            assert (seq_of(snapshot), skipped_of(snapshot)) == (at, (2, at))
            assert snapshot.task.status.state == S.TASK_STATE_WORKING
            artifacts = [a.artifact_id for a in snapshot.task.artifacts]
            assert artifacts == [f"step-{i}" for i in range(45)]
            agent.step(2)
            agent.finish()
            rest, resumed_rest = await asyncio.gather(collected(sender), collected(resumed))
            assert [seq_of(f) for f in rest] == [at + 1, at + 2, at + 3]
            assert rest[-1].status_update.status.state == S.TASK_STATE_COMPLETED
            assert resumed_rest == rest, "after the snapshot: exactly the frames after it"


async def test_a_record_that_cannot_tell_the_task_past_a_snapshot_ends_out_of_range_once() -> None:
    agent = StepAgent()
    with natsserver.running(1) as cluster:
        async with (
            asyncio.timeout(30),
            # (4 messages: the changes after the task's last snapshot leave the record)
            instances(agent, cluster.urls, events_per_task=4) as (a, b),
        ):
            sender = a.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
            frames = [await sender.read(), await sender.read()]
            for _ in range(5):
                agent.step()
                frames.append(await sender.read())
            task_id = frames[0].task.id
            got: list[StreamResponse] = []
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await read_all(fallback_call(b.stub, task_id, 1), got)
            assert ended.value.code() == grpc.StatusCode.OUT_OF_RANGE
            (told,) = got  # the task as the record tells it, once; then no more catching up
            assert seq_of(told) < seq_of(frames[-1])
            assert skipped_of(told) == (2, seq_of(told))
            agent.finish()
            await read_all(sender, frames)


async def test_an_ended_task_is_replayed_where_kept_and_answered_with_its_outcome_elsewhere() -> (
    None
):
    agent = StepAgent()
    with natsserver.running(1) as cluster:
        async with (
            asyncio.timeout(30),
            instances(agent, cluster.urls, events_per_task=4) as (a, b),
        ):
            sender = a.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
            frames = [await sender.read(), await sender.read()]
            for _ in range(5):
                agent.step()
                frames.append(await sender.read())
            agent.finish()
            await read_all(sender, frames)
            task_id, final = frames[0].task.id, seq_of(frames[-1])
            replayed = await collected(fallback_call(a.stub, task_id, 1))
            assert replayed == frames[1:], "the owner's log still keeps every frame"
            (outcome,) = await collected(fallback_call(b.stub, task_id, 1))
            assert (seq_of(outcome), skipped_of(outcome)) == (final, (2, final))
            assert outcome.task.status.state == S.TASK_STATE_COMPLETED
            assert len(outcome.task.artifacts) == 5
            assert await collected(fallback_call(b.stub, task_id, final)) == []
            with pytest.raises(grpc.aio.AioRpcError) as ahead:
                await collected(fallback_call(b.stub, task_id, final + 1))
            assert ahead.value.code() == grpc.StatusCode.OUT_OF_RANGE, "past the end: no snapshot"
            assert rich_status(ahead.value)[1].reason == "FRAME_NOT_KEPT"

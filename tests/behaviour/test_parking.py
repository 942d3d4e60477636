"""Tasks waiting for input leave memory when idle, come back on demand, and are capped."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from tests.support import natsserver
from tests.support.agents import AskWhenReleased, InputAgent
from tests.support.clusterharness import instances
from tests.support.harness import (
    V1,
    Harness,
    last_state,
    read_all,
    rich_status,
    send_request,
    serve,
)
from tests.support.harness import user_message as message

S = TaskState


async def park(h: Harness) -> str:
    answer = await h.stub.SendMessage(send_request("hi"), metadata=V1)
    assert answer.task.status.state == S.TASK_STATE_INPUT_REQUIRED
    return str(answer.task.id)


def follow_up(task_id: str, text: str = "Ada") -> SendMessageRequest:
    return SendMessageRequest(message=message(text, task_id=task_id))


def leave_memory(h: Harness) -> int:
    """Run the parked-task sweep as if ``parked_timeout`` had passed."""
    engine = h.service.engine
    return engine.tasks.parking.evict_idle(
        now=engine.tasks.pool.clock() + h.service.config.parked_timeout
    )


async def test_an_idle_parked_task_leaves_memory_and_every_operation_brings_it_back() -> None:
    async with asyncio.timeout(10), serve(InputAgent()) as h:
        engine = h.service.engine
        continued, watched, canceled = [await park(h) for _ in range(3)]
        assert engine.tasks.count == 3
        assert leave_memory(h) == 3
        assert engine.tasks.count == 0 and engine.tasks.pool.used == 0
        # Its record stays: read as it was.
        task = await h.stub.GetTask(GetTaskRequest(id=continued), metadata=V1)
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        # A follow-up continues it.
        done = await h.stub.SendMessage(follow_up(continued), metadata=V1)
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        assert "hello Ada" in done.task.status.message.parts[0].text
        # A subscription joins it where it was, and sees it continue.
        stream = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=watched), metadata=V1)
        first = await stream.read()
        assert first.task.status.state == S.TASK_STATE_INPUT_REQUIRED
        assert leave_memory(h) == 0, "a task being read stays in memory"
        await h.stub.SendMessage(follow_up(watched), metadata=V1)
        frames: list[StreamResponse] = []
        await read_all(stream, frames)
        assert last_state(frames) == S.TASK_STATE_COMPLETED
        # A cancel ends it.
        ended = await h.stub.CancelTask(CancelTaskRequest(id=canceled), metadata=V1)
        assert ended.status.state == S.TASK_STATE_CANCELED
        assert engine.tasks.count == 0


async def test_over_max_parked_tasks_a_new_task_is_refused_until_one_is_continued() -> None:
    config = ServerConfig(cancel_timeout=1.0, max_parked_tasks=2)
    async with asyncio.timeout(10), serve(InputAgent(), config) as h:
        first = await park(h)
        await park(h)
        assert leave_memory(h) == 2, "out of memory, but still held in the in-memory journal"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.SendMessage(send_request("one more"), metadata=V1)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        _, info = rich_status(caught.value)
        assert info.reason == "PARKED_TASKS_LIMIT"
        assert info.metadata["limit"] == "2"
        done = await h.stub.SendMessage(follow_up(first), metadata=V1)
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        assert await park(h)


async def test_in_cluster_mode_the_longest_parked_task_leaves_memory_for_a_new_one() -> None:
    config = ServerConfig(cancel_timeout=1.0, max_parked_tasks=2)
    with natsserver.running(1) as cluster:
        async with (
            asyncio.timeout(30),
            instances(InputAgent(), cluster.urls, config=config) as (a, b),
        ):
            oldest = (await a.stub.SendMessage(send_request("1"), metadata=V1)).task.id
            for text in ("2", "3"):
                answer = await a.stub.SendMessage(send_request(text), metadata=V1)
                assert answer.task.status.state == S.TASK_STATE_INPUT_REQUIRED
            parking = a.service.engine.tasks.parking
            assert parking.count == 2 and parking.evicted == 1
            # Its owner brings it back when a follow-up reaches it through another instance.
            done = await b.stub.SendMessage(follow_up(oldest), metadata=V1)
            assert done.task.status.state == S.TASK_STATE_COMPLETED
            stored = await b.stub.GetTask(GetTaskRequest(id=oldest), metadata=V1)
            assert stored.status.state == S.TASK_STATE_COMPLETED


async def test_in_cluster_mode_tasks_that_ask_for_input_later_stay_within_max_parked_tasks() -> (
    None
):
    # The cap was applied only when a task was created: three tasks created while none
    # waited all stayed in memory once they asked (issue 22). In cluster mode a waiting task
    # costs nothing out of memory: the longest-waiting one leaves, none fails.
    config = ServerConfig(cancel_timeout=1.0, max_parked_tasks=2)
    agent = AskWhenReleased()
    with natsserver.running(1) as cluster:
        async with (
            asyncio.timeout(30),
            instances(agent, cluster.urls, config=config) as (a, b),
        ):
            texts = ["1", "2", "3"]
            calls = []
            for text in texts:
                calls.append(a.stub.SendMessage(send_request(text), metadata=V1))
                await agent.working(text).wait()
            ids = []
            for text, call in zip(texts, calls, strict=True):
                agent.release(text)
                answer = await call
                assert answer.task.status.state == S.TASK_STATE_INPUT_REQUIRED
                ids.append(answer.task.id)
            parking = a.service.engine.tasks.parking
            assert parking.count == 2 and parking.evicted == 1
            assert a.service.engine.tasks.live_task(ids[0]) is None, "the longest-waiting left"
            done = await b.stub.SendMessage(follow_up(ids[0]), metadata=V1)
            assert done.task.status.state == S.TASK_STATE_COMPLETED

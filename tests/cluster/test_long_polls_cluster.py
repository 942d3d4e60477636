"""v1.1 long-polls of a task another instance runs (issue 42, hole 3, in cluster mode).

A poll through an instance that does not run the task waits on that instance's relay
of it as a passive reader: it holds one of the task's poll slots (``quota_subscribers``
of them, apart from the subscribers'), never a subscriber's place, and the relay goes
on for it alone until the task moves. On a real nats-server with two instances.
"""

from __future__ import annotations

import asyncio
from typing import Any

from a2a.types.a2a_pb2 import GetTaskRequest, StreamResponse, SubscribeToTaskRequest, Task
from a2a.types.a2a_pb2 import TaskState as S

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.model import generation
from tests.behaviour.test_long_poll_quotas import GET_TASK, poll_request
from tests.support.agents import GatedAgent
from tests.support.clusterharness import Instance, instances
from tests.support.harness import V1, read_all, send_request


def poll(instance: Instance, task_id: str, current: int, timeout: float) -> Any:
    """A GetTask through ``instance`` that waits for the task to move past ``current``."""
    call = instance.channel.unary_unary(
        GET_TASK, request_serializer=lambda b: b, response_deserializer=Task.FromString
    )
    return asyncio.ensure_future(call(poll_request(task_id, current), metadata=V1, timeout=timeout))


async def working_on(a: Instance, b: Instance) -> tuple[str, int, Any]:
    """A task A runs (WORKING, held by the agent), and its generation as B reads it."""
    sender = a.stub.SendStreamingMessage(send_request("go"), metadata=V1)
    task_id = (await sender.read()).task.id
    assert (await sender.read()).status_update.status.state == S.TASK_STATE_WORKING
    read = await b.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
    at = generation.generation_of(read)
    assert at is not None
    return task_id, at, sender


def moved_past(task: Task, at: int) -> bool:
    return (generation.generation_of(task) or 0) > at


async def test_a_poll_through_another_instance_answers_when_the_task_moves(
    nats_url: str,
) -> None:
    agent = GatedAgent()
    async with asyncio.timeout(30), instances(agent, [nats_url]) as [a, b]:
        task_id, at, sender = await working_on(a, b)
        waiting = poll(b, task_id, at, timeout=10)
        await asyncio.wait([waiting], timeout=0.5)  # (a bound: it must still wait)
        assert not waiting.done(), f"the poll answered before the task moved: {waiting}"
        agent.release.set()
        assert moved_past(await waiting, at), "answered with the task moved on"
        await read_all(sender, [])


async def test_polls_through_another_instance_never_take_a_subscribers_place(
    nats_url: str,
) -> None:
    agent = GatedAgent()
    limits = ServerConfig(cancel_timeout=1.0, quota_subscribers=2)
    async with asyncio.timeout(30), instances(agent, [nats_url], config=limits) as [a, b]:
        task_id, at, sender = await working_on(a, b)
        polls = [poll(b, task_id, at, timeout=10) for _ in range(3)]
        done, _ = await asyncio.wait(polls, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "two polls wait, the third has no slot"
        as_it_is = done.pop().result()
        assert generation.generation_of(as_it_is) == at, "no slot: the task as it is"
        subscribers = [
            b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
            for _ in range(2)
        ]
        frames: list[list[StreamResponse]] = [[await s.read()] for s in subscribers]
        assert all(f[0].task.id == task_id for f in frames), "polls take no subscriber's place"
        agent.release.set()
        waited = [p for p in polls if not p.done()]
        assert len(waited) == 2
        assert all(moved_past(task, at) for task in await asyncio.gather(*waited))
        for stream, got in zip(subscribers, frames, strict=True):
            await read_all(stream, got)
            assert got[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        await read_all(sender, [])


async def test_a_poll_whose_relay_is_severed_answers_with_the_task_as_it_is(
    nats_url: str,
) -> None:
    agent = GatedAgent()
    async with asyncio.timeout(30), instances(agent, [nats_url]) as [a, b]:
        task_id, at, sender = await working_on(a, b)
        waiting = poll(b, task_id, at, timeout=10)
        await asyncio.wait([waiting], timeout=0.5)  # (a bound: it must still wait)
        assert not waiting.done()
        await b.cluster.leave()  # (B stops relaying, as when it shuts down)
        answered = await waiting  # (was UNAVAILABLE RELAY_LOST)
        assert answered.id == task_id and generation.generation_of(answered) == at
        agent.release.set()
        await read_all(sender, [])

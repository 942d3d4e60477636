"""A waiting task is released on SIGTERM even within the owner's first lease (issue 42, 7).

Before a lease has passed, an instance has not heard every other instance through its
watch, so it writes format 1 (``jetstream.formats``), and a release needs format 2: a
task waiting for input ended FAILED with an owner stopped that early. At shutdown the
owner now reads every heartbeat directly from the bucket; when each live instance reads
format 2, the task is released, as it is later on.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import GetTaskRequest, SubscribeToTaskRequest, TaskState

from tests.cluster.test_waiting_tasks import (
    AGENT,
    HANDED_OVER,
    answer_request,
    ask,
    assert_completed,
    frames_until_end,
)
from tests.support.agents import InputAgent
from tests.support.clusterharness import instances
from tests.support.harness import V1
from tests.support.serveproc import owner_process

S = TaskState
LEASE = 8.0
"""Long enough that the owner is stopped well within its first lease."""


async def test_a_waiting_task_is_released_when_its_owner_gets_sigterm_within_its_first_lease(
    nats_url: str,
) -> None:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(40):
        started = loop.time()
        async with (
            owner_process(nats_url, LEASE, agent=AGENT) as (owner, _),
            instances(InputAgent(), [nats_url], names=("B",), lease=LEASE) as [b],
            grpc.aio.insecure_channel(owner.grpc_addr) as channel,
        ):
            a = a2a_pb2_grpc.A2AServiceStub(channel)
            task = await ask(a)
            through_owner = a.SubscribeToTask(SubscribeToTaskRequest(id=task.id), metadata=V1)
            first = await anext(aiter(through_owner))
            assert first.task.status.state == S.TASK_STATE_INPUT_REQUIRED
            assert loop.time() - started < LEASE / 2, "stopped within the owner's first lease"
            owner.proc.send_signal(signal.SIGTERM)
            frames, code, reason = await frames_until_end(through_owner)
            assert (frames, code, reason) == ([], grpc.StatusCode.UNAVAILABLE, HANDED_OVER)
            assert await owner.proc.wait() == 0
            waiting = await b.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
            assert waiting.status.state == S.TASK_STATE_INPUT_REQUIRED, (
                "released, not ended FAILED: " + waiting.status.message.parts[0].text
                if waiting.status.message.parts
                else S.Name(waiting.status.state)
            )
            reply = await b.stub.SendMessage(answer_request(task), metadata=V1, timeout=10)
            assert_completed(reply.task)
            assert b.service.metrics.tasks_claimed == 1

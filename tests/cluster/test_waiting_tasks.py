"""A task waiting for input belongs to the cluster, not to an instance (issue 21).

Its owner releases it when it shuts down (SIGTERM), a survivor releases it
when the owner is lost (SIGKILL, the lease runs out) or left it out of memory;
the next message, through any instance, claims it and runs the executor there.
Every stream of it learns what happened: streams through the leaving instance
end UNAVAILABLE TASK_HANDED_OVER (retryable), relayed ones go on to the outcome.
Only tasks with a running execution end FAILED with their owner, as before.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import grpc
import pytest
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.errors import ServerShuttingDownError
from a2a_grpc_server._internal.jetstream import formats
from tests.support.agents import InputAgent
from tests.support.clusterharness import Instance, instances
from tests.support.harness import KEYED, V1, rich_status, send_request, serve, user_message
from tests.support.serveproc import logged, owner_process

S = TaskState
pytestmark = pytest.mark.usefixtures("layout")  # (every test on both layouts: conftest)
AGENT = "tests.support.agents:InputAgent"
HANDED_OVER = "TASK_HANDED_OVER"


async def ask(stub: a2a_pb2_grpc.A2AServiceStub) -> Task:
    """A new task, waiting for input (the agent asked for a name)."""
    answer = await stub.SendMessage(send_request("hi"), metadata=V1, timeout=10)
    task: Task = answer.task
    assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
    return task


def answer_request(task: Task, name: str = "Ada") -> SendMessageRequest:
    return SendMessageRequest(
        message=user_message(name, task_id=task.id, context_id=task.context_id)
    )


async def frames_until_end(call: Any) -> tuple[list[StreamResponse], grpc.StatusCode, str]:
    """Every frame of a stream call, its status, and the ErrorInfo reason ("" if none)."""
    frames: list[StreamResponse] = []
    try:
        async for frame in call:
            frames.append(frame)
    except grpc.aio.AioRpcError as err:
        return frames, err.code(), rich_status(err)[1].reason
    return frames, grpc.StatusCode.OK, ""


async def continued_through(b: Instance, task: Task) -> Task:
    """Answer the task through ``b``, as a client would: UNAVAILABLE is retried, with
    safe retries asked for (an attempt refused may have taken effect)."""
    for _ in range(200):  # (bounded by the caller's timeout too)
        try:
            reply = await b.stub.SendMessage(answer_request(task), metadata=KEYED, timeout=10)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise AssertionError(f"not retryable: {err.code()} {err.details()}") from err
            await asyncio.sleep(0.1)  # sync-ok: a client's retry back-off
            continue
        done: Task = reply.task
        return done
    raise AssertionError("the follow-up was never taken")


async def both_read_format_2(*members: Instance) -> None:
    """Wait until every instance writes format 2 (a lease after start, every one heard):
    only then is a waiting task released (``jetstream.formats``)."""
    for member in members:
        await member.cluster.formats.wait_for(formats.CURRENT)


def assert_completed(task: Task) -> None:
    assert task.status.state == S.TASK_STATE_COMPLETED, S.Name(task.status.state)
    assert task.status.message.parts[0].text == "hello Ada"


async def test_a_waiting_task_goes_on_through_another_instance_after_its_owner_got_sigterm(
    nats_url: str,
) -> None:
    async with (
        asyncio.timeout(40),
        owner_process(nats_url, 2.0, agent=AGENT) as (owner, _),
        instances(InputAgent(), [nats_url], names=("B",), lease=2.0) as [b],
        grpc.aio.insecure_channel(owner.grpc_addr) as channel,
    ):
        a = a2a_pb2_grpc.A2AServiceStub(channel)
        await logged(owner, "writing format 2")  # (a lease after start: B reads it too)
        task = await ask(a)
        through_owner = a.SubscribeToTask(SubscribeToTaskRequest(id=task.id), metadata=V1)
        relayed = b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task.id), metadata=V1)
        for call in (through_owner, relayed):
            first = await anext(aiter(call))
            assert first.task.status.state == S.TASK_STATE_INPUT_REQUIRED
        owner.proc.send_signal(signal.SIGTERM)
        frames, code, reason = await frames_until_end(through_owner)
        assert (frames, code, reason) == ([], grpc.StatusCode.UNAVAILABLE, HANDED_OVER)
        assert await owner.proc.wait() == 0
        waiting = await b.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
        assert waiting.status.state == S.TASK_STATE_INPUT_REQUIRED, "not ended FAILED"
        # No lease has to run out: the first follow-up through B is taken.
        reply = await b.stub.SendMessage(answer_request(task), metadata=V1, timeout=10)
        assert_completed(reply.task)
        frames, code, _ = await frames_until_end(relayed)
        assert code == grpc.StatusCode.OK
        assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        assert b.service.metrics.tasks_claimed == 1


async def test_a_waiting_task_goes_on_through_another_instance_after_its_owner_got_sigkill(
    nats_url: str,
) -> None:
    async with (
        asyncio.timeout(40),
        owner_process(nats_url, 2.0, agent=AGENT) as (owner, _),
        instances(InputAgent(), [nats_url], names=("B",), lease=2.0) as [b],
        grpc.aio.insecure_channel(owner.grpc_addr) as channel,
    ):
        task = await ask(a2a_pb2_grpc.A2AServiceStub(channel))
        relayed = b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task.id), metadata=V1)
        await anext(aiter(relayed))
        owner.proc.kill()
        await owner.proc.wait()
        # Until B takes the owner for lost, the follow-up is UNAVAILABLE (retried);
        # then the sweep releases the task (it does not end it) and B takes it.
        assert_completed(await continued_through(b, task))
        frames, code, _ = await frames_until_end(relayed)
        assert code == grpc.StatusCode.OK
        states = [f.status_update.status.state for f in frames if f.HasField("status_update")]
        assert S.TASK_STATE_FAILED not in states
        assert states[-1] == S.TASK_STATE_COMPLETED
        assert b.service.metrics.tasks_released == 1 and b.service.metrics.tasks_reaped == 0


async def test_a_waiting_task_out_of_its_owners_memory_goes_on_after_the_owner_left(
    nats_url: str,
) -> None:
    async with (
        asyncio.timeout(40),
        instances(InputAgent(), [nats_url], names=("A", "B"), lease=2.0) as (a, b),
    ):
        task = await ask(a.stub)
        await both_read_format_2(a, b)
        engine = a.service.engine
        horizon = engine.tasks.pool.clock() + a.service.config.parked_timeout
        assert engine.tasks.parking.evict_idle(now=horizon) == 1
        assert engine.tasks.count == 0, "it left A's memory: A's shutdown cannot release it"
        await a.service.shutdown(grace=0)  # (its lease key goes: B sweeps at once)
        assert_completed(await continued_through(b, task))
        assert b.service.metrics.tasks_released == 1


async def test_a_running_task_still_ends_failed_with_its_lost_owner(nats_url: str) -> None:
    async with (
        asyncio.timeout(40),
        owner_process(nats_url, 2.0) as (owner, client),  # (the Hanging agent: it works on)
        instances(InputAgent(), [nats_url], names=("B",), lease=2.0) as [b],
    ):
        sender = client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        await anext(sender)  # WORKING
        relayed = b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        await anext(aiter(relayed))
        owner.proc.kill()
        await owner.proc.wait()
        frames, code, _ = await frames_until_end(relayed)
        assert code == grpc.StatusCode.OK
        status = frames[-1].status_update.status
        assert status.state == S.TASK_STATE_FAILED
        assert status.message.parts[0].text.endswith("was lost")
        assert b.service.metrics.tasks_released == 0


async def test_two_instances_racing_for_a_released_task_run_it_once(nats_url: str) -> None:
    agent = InputAgent()
    async with (
        asyncio.timeout(40),
        instances(agent, [nats_url], names=("A", "B", "C"), lease=2.0) as (a, b, c),
    ):
        task = await ask(a.stub)
        await both_read_format_2(a, b, c)
        await a.service.shutdown(grace=0)
        replies = await asyncio.gather(
            b.stub.SendMessage(answer_request(task), metadata=V1, timeout=10),
            c.stub.SendMessage(answer_request(task, "Bob"), metadata=V1, timeout=10),
            return_exceptions=True,
        )
        taken = [r for r in replies if not isinstance(r, BaseException)]
        refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
        assert len(taken) + len(refused) == 2
        assert taken, "one of them continued it"
        claimed = b.service.metrics.tasks_claimed + c.service.metrics.tasks_claimed
        assert claimed == 1, "claimed once (the other was routed to the winner)"
        done = await b.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
        assert done.status.state == S.TASK_STATE_COMPLETED
        names = [m.parts[0].text for m in done.history if m.role == 1]  # ROLE_USER
        assert names[0] == "hi" and len(names) == 2, "one follow-up ran: the executor ran once"
        for err in refused:
            assert err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)


async def test_a_follow_up_its_leaving_owner_refuses_waits_for_the_hand_over(
    nats_url: str,
) -> None:
    """A follow-up through B, routed to the owner A while A shuts down (A refuses: it is
    leaving, and has not released its waiting task yet): B waits for the release, claims
    the task and runs the follow-up, instead of answering UNAVAILABLE (in a rolling update
    a client's one retry could land there, and fail)."""
    async with (
        asyncio.timeout(40),
        instances(InputAgent(), [nats_url], names=("A", "B"), lease=2.0) as (a, b),
    ):
        task = await ask(a.stub)
        await both_read_format_2(a, b)
        releasing, go, refused = asyncio.Event(), asyncio.Event(), asyncio.Event()
        release = a.cluster.journal.ownership.release

        async def held(task_id: str, owner: str) -> object:
            releasing.set()
            await go.wait()
            return await release(task_id, owner)

        front = b.service.operations
        routed = front._peers.send  # type: ignore[attr-defined]

        async def watched(*args: object) -> object:
            try:
                return await routed(*args)
            except ServerShuttingDownError:
                refused.set()
                raise

        a.cluster.journal.ownership.release = held  # type: ignore[method-assign, assignment]
        front._peers.send = watched  # type: ignore[attr-defined]
        leaving = asyncio.create_task(a.service.shutdown(grace=0))
        await releasing.wait()  # (A refuses new work now; its task is not released yet)
        call = b.stub.SendMessage(answer_request(task), metadata=V1, timeout=10)
        answered = asyncio.ensure_future(call)
        await refused.wait()  # (A refused it; B waits for the hand-over)
        go.set()
        await leaving
        reply = await answered
        assert_completed(reply.task)
        assert b.service.metrics.tasks_claimed == 1


async def test_a_released_task_can_be_canceled_through_any_instance(nats_url: str) -> None:
    async with (
        asyncio.timeout(40),
        instances(InputAgent(), [nats_url], names=("A", "B"), lease=2.0) as (a, b),
    ):
        task = await ask(a.stub)
        await both_read_format_2(a, b)
        await a.service.shutdown(grace=0)
        canceled = await b.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=V1, timeout=10)
        assert canceled.status.state == S.TASK_STATE_CANCELED


async def test_push_configs_of_a_released_task_are_delivered_by_whoever_claims_it(
    nats_url: str,
) -> None:
    # A config created while nobody owned the task had no deliverer, so a sweep after its
    # claimer's loss skipped it (issue 21): the claimer now becomes its deliverer.
    hooks = ServerConfig(cancel_timeout=1.0, push_allow_private=True, push_retry_for=0)
    async with (
        asyncio.timeout(40),
        instances(InputAgent(), [nats_url], names=("A", "B"), lease=2.0, config=hooks) as (a, b),
    ):
        task = await ask(a.stub)
        await both_read_format_2(a, b)
        await a.service.shutdown(grace=0)  # released: owned by nobody
        config = TaskPushNotificationConfig(task_id=task.id, id="hook", url="http://127.0.0.1:9/")
        await b.stub.CreateTaskPushNotificationConfig(config, metadata=V1, timeout=10)
        store = b.cluster.push_store
        assert [o.config.id for o in await store.without_deliverer(task.id)] == ["hook"]
        await b.stub.SendMessage(answer_request(task), metadata=V1, timeout=10)
        assert await store.without_deliverer(task.id) == [], "B delivers it now"
        orphans = await store.orphans(alive=set())  # (this task's: the bucket is the module's)
        mine = [(o.config.id, o.deliverer) for o in orphans if o.task_id == task.id]
        assert mine == [("hook", b.cluster.instance_id)]


async def test_in_memory_mode_keeps_ending_waiting_tasks_failed_at_shutdown() -> None:
    async with asyncio.timeout(20), serve(InputAgent()) as h:
        task = await ask(h.stub)
        watch = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task.id), metadata=V1)
        await anext(aiter(watch))
        await h.service.shutdown(grace=0)
        frames, code, _ = await frames_until_end(watch)
        assert code == grpc.StatusCode.OK
        assert frames[-1].status_update.status.state == S.TASK_STATE_FAILED

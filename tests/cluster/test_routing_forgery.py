"""A bus client that forges or replays routed traffic (issue 42, holes 1 and 2).

A client of the NATS bus that reads ``a2a.ctl.>`` sees each routed request and the
inbox its answer goes to. It may put a bare "no responders" status (``Status: 503``, no
payload) into that inbox, or publish a request it overheard again after the owner
restarted under the same ``--instance-id``. Neither may make the owner act twice, or
the asker say the owner is unavailable while it acts.

Real nats-server, real instances (one a ``serve`` process, restarted), and a plain
nats-py client playing the intruder.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import nats
import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    Part,
    Role,
    Task,
    TaskState,
)
from nats.aio.client import Client
from nats.aio.msg import Msg

from a2a_grpc_server._internal.jetstream.routing import control_subject
from a2a_grpc_server._internal.jetstream.signing import SIGNATURE
from tests.support.agents import Hanging
from tests.support.clusterharness import instances
from tests.support.harness import KEYED, V1, copy, send_request
from tests.support.serveproc import logged, start

S = TaskState
ASKING = "tests.cluster.test_routing_forgery:Asking"
FIXED_ID = "forgery-owner"


class Asking(AgentExecutor):
    """Asks for input after every message: its task takes follow-ups for ever."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        said = updater.new_agent_message([Part(text=f"got {context.get_user_input()}")])
        await updater.requires_input(said)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def runs_of(task: Task, message_id: str) -> int:
    """How often the task's history holds the message (once per run of it)."""
    return [m.message_id for m in task.history].count(message_id)


async def forging_no_responders(intruder: Client, subject: str) -> asyncio.Event:
    """Answer the first request on ``subject`` at once with a bare "no responders" status.

    Returns:
        Set once the forged status was sent.
    """
    forged = asyncio.Event()

    async def forge(msg: Msg) -> None:
        if not forged.is_set():
            forged.set()
            await intruder.publish(msg.reply, b"", headers={"Status": "503"})

    await intruder.subscribe(subject, cb=forge)
    await intruder.flush()
    return forged


async def test_a_forged_no_responders_answer_does_not_end_a_routed_cancel(
    nats_url: str,
) -> None:
    # The owner answers after cancel_timeout (its agent ignores cancel): the forged
    # status is in the asker's inbox a second before the owner's answer.
    async with asyncio.timeout(30), instances(Hanging(), [nats_url]) as (a, b):
        stream = a.stub.SendStreamingMessage(send_request("hi"), metadata=V1)
        task_id = (await stream.read()).task.id
        intruder = await nats.connect(nats_url)
        try:
            subject = control_subject(a.cluster.instance_id, "cancel")
            forged = await forging_no_responders(intruder, subject)
            canceled = await b.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
            assert forged.is_set()
            assert canceled.status.state == S.TASK_STATE_CANCELED, "the owner's own answer"
        finally:
            await intruder.close()
        while await stream.read() is not grpc.aio.EOF:  # (up to its final frame)
            pass


async def test_a_forged_no_responders_answer_does_not_make_a_follow_up_run_twice(
    nats_url: str,
) -> None:
    # Believed, the forged status is UNAVAILABLE: the asker lets the retry key go and
    # the client's retry runs the turn again, though the owner ran it already.
    async with asyncio.timeout(30), instances(Asking(), [nats_url]) as (a, b):
        task = (await a.stub.SendMessage(send_request("hi"), metadata=KEYED)).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        follow_up = send_request("one", task_id=task.id)
        intruder = await nats.connect(nats_url)
        try:
            forged = await forging_no_responders(
                intruder, control_subject(a.cluster.instance_id, "send")
            )
            refused: grpc.aio.AioRpcError | None = None
            try:
                await b.stub.SendMessage(copy(follow_up), metadata=KEYED, timeout=10)
            except grpc.aio.AioRpcError as err:
                refused = err  # (a client retries UNAVAILABLE)
            again = (await b.stub.SendMessage(copy(follow_up), metadata=KEYED, timeout=10)).task
            assert forged.is_set()
        finally:
            await intruder.close()
        seen = await a.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
        assert runs_of(seen, follow_up.message.message_id) == 1, "the retry ran it again"
        assert refused is None, f"{refused.code()}: {refused.details()}"
        assert again.status.state == S.TASK_STATE_INPUT_REQUIRED


async def test_a_signed_request_replayed_after_its_owner_restarted_is_refused(
    nats_url: str,
) -> None:
    args = ("--agent", ASKING, "--nats", nats_url, "--lease", "2", "--instance-id", FIXED_ID)
    first = await start(*args)
    second = None
    intruder = await nats.connect(nats_url)
    try:
        async with (
            asyncio.timeout(60),
            instances(Asking(), [nats_url], names=("B",), lease=2.0) as [b],
        ):
            await logged(first, "writing format 2")  # (so that SIGTERM releases the task)
            async with grpc.aio.insecure_channel(first.grpc_addr) as channel:
                stub = a2a_pb2_grpc.A2AServiceStub(channel)
                task = (await stub.SendMessage(send_request("hi"), metadata=V1)).task
            assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
            # A follow-up through B is routed to the owner, and overheard.
            overheard: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

            async def overhear(msg: Msg) -> None:
                if not overheard.done():
                    overheard.set_result(msg)

            subject = control_subject(FIXED_ID, "send")
            await intruder.subscribe(subject, cb=overhear)
            await intruder.flush()
            one = send_request("one", task_id=task.id)
            reply = await b.stub.SendMessage(copy(one), metadata=V1, timeout=10)
            assert reply.task.status.state == S.TASK_STATE_INPUT_REQUIRED
            real = await overheard
            assert real.headers is not None and SIGNATURE in real.headers
            # The owner stops (its waiting task released) and starts again, same id;
            # the next message through it takes the task back.
            first.proc.send_signal(signal.SIGTERM)
            assert await first.proc.wait() == 0
            second = await start(*args)
            async with grpc.aio.insecure_channel(second.grpc_addr) as channel:
                stub = a2a_pb2_grpc.A2AServiceStub(channel)
                two = send_request("two", task_id=task.id)
                taken = (await stub.SendMessage(two, metadata=V1, timeout=10)).task
                assert taken.status.state == S.TASK_STATE_INPUT_REQUIRED
                # The intruder replays the overheard request, answer and all. Then a
                # real routed follow-up, which the owner reads after the replay.
                answers = await intruder.subscribe(real.reply)
                await intruder.publish(subject, real.data, reply=real.reply, headers=real.headers)
                await intruder.flush()
                three = send_request("three", task_id=task.id)
                after = (await b.stub.SendMessage(copy(three), metadata=V1, timeout=10)).task
                assert after.status.state == S.TASK_STATE_INPUT_REQUIRED
                seen = await stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
            assert runs_of(seen, one.message.message_id) == 1, "the replay ran"
            assert [m.parts[0].text for m in seen.history if m.role == Role.ROLE_USER] == [
                "hi",
                "one",
                "two",
                "three",
            ]
            with pytest.raises(nats.errors.TimeoutError):
                await answers.next_msg(timeout=0)  # (the replay was not answered)
    finally:
        await intruder.close()
        for proc in (first.proc, second.proc if second else None):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()

"""A rolling restart of every instance under load (issue 21): no request fails after one
retry through another instance, and no task waiting for input is lost.

Three real ``serve`` processes share a nats-server. A client keeps starting tasks (the agent
asks for input, so each one waits) and answering earlier ones, each call through a random
instance, retried once through another when it is refused (UNAVAILABLE: the instance is
draining or gone), as a client behind a load balancer is. Meanwhile each instance in turn
gets SIGTERM and is replaced by a new process. At the end every task started is answered
and COMPLETED.
"""

from __future__ import annotations

import asyncio
import random
import signal
from dataclasses import dataclass, field

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import GetTaskRequest, SendMessageRequest, Task, TaskState

from tests.support.harness import V1, send_request, user_message
from tests.support.serveproc import Process, logged, start

S = TaskState
AGENT = "tests.support.agents:InputAgent"
INSTANCES = 3
RETRY_BACKOFF = 0.3
"""Seconds a client waits before its one retry (gRPC retry policies start near this)."""
MOST_CALLS = 5000
"""Most calls the load makes (it stops once the restarts are done and every task answered)."""


@dataclass
class Member:
    """One instance slot: its current process and a stub of it."""

    process: Process
    channel: grpc.aio.Channel
    stub: a2a_pb2_grpc.A2AServiceStub
    stopping: bool = False
    """Its SIGTERM was sent (a load balancer would take it out of rotation now)."""


@dataclass
class Load:
    """What the client did."""

    waiting: list[Task] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    retried: int = 0
    took_effect: int = 0
    """Retried follow-ups whose first attempt had taken effect (see ``call``)."""
    failed: list[str] = field(default_factory=list)


async def launch(nats_url: str) -> Member:
    process = await start(
        "--agent", AGENT, "--nats", nats_url, "--lease", "2", "--shutdown-drain", "0.3"
    )
    channel = grpc.aio.insecure_channel(process.grpc_addr)
    return Member(process, channel, a2a_pb2_grpc.A2AServiceStub(channel))


async def call(members: list[Member], request: SendMessageRequest, load: Load) -> Task | None:
    """SendMessage through a random instance; once more through another if refused.

    A follow-up whose first attempt was refused UNAVAILABLE may have taken effect all
    the same (the owner ran it, its answer was lost as an instance left): its retry is
    then refused because the task ended, and the task holds the answer. That is the
    retried-SendMessage problem issue 24's idempotency keys solve; here the client
    checks the task, as a client without them must.
    """
    member = random.choice(members)
    for attempt in range(2):
        if attempt:  # one retry, as a client's retry policy makes it: a back-off, elsewhere
            await asyncio.sleep(RETRY_BACKOFF)  # sync-ok: the client's own back-off
            member = random.choice([m for m in members if m is not member and not m.stopping])
        try:
            reply = await member.stub.SendMessage(request, metadata=V1, timeout=10)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if attempt == 1 and code == grpc.StatusCode.FAILED_PRECONDITION:
                task = await took_effect(member, request)
                if task is not None:
                    load.took_effect += 1
                    return task
            if code != grpc.StatusCode.UNAVAILABLE or attempt == 1:  # (never CANCELLED)
                load.failed.append(f"{code.name}: {err.details()}")
                return None
            load.retried += 1
            continue
        answered: Task = reply.task
        return answered
    return None


async def took_effect(member: Member, request: SendMessageRequest) -> Task | None:
    """The task, if the follow-up ``request`` is already in its history (it took effect)."""
    if not request.message.task_id:
        return None
    task: Task = await member.stub.GetTask(
        GetTaskRequest(id=request.message.task_id), metadata=V1, timeout=10
    )
    ids = {m.message_id for m in task.history}
    return task if request.message.message_id in ids else None


async def drive(members: list[Member], load: Load, done: asyncio.Event) -> None:
    """Ask and answer, alternating, until the restarts are done; then answer the rest."""
    for n in range(MOST_CALLS):
        if done.is_set() and not load.waiting:
            return
        if load.waiting and (done.is_set() or n % 2):
            task = load.waiting.pop(0)
            message = user_message("Ada", task_id=task.id, context_id=task.context_id)
            answered = await call(members, SendMessageRequest(message=message), load)
            if answered is not None:
                if answered.status.state == S.TASK_STATE_COMPLETED:
                    load.completed.append(task.id)
                else:
                    load.failed.append(f"{task.id} ended {S.Name(answered.status.state)}")
        else:
            asked = await call(members, send_request("hi"), load)
            if asked is not None:
                if asked.status.state == S.TASK_STATE_INPUT_REQUIRED:
                    load.waiting.append(asked)
                else:
                    load.failed.append(f"new task {S.Name(asked.status.state)}")
    raise AssertionError(f"{len(load.waiting)} tasks still waiting after {MOST_CALLS} calls")


async def test_a_rolling_restart_under_load_fails_nothing_after_one_retry_and_loses_no_task(
    nats_url: str,
) -> None:
    members: list[Member] = []
    replaced: list[Member] = []
    load, done = Load(), asyncio.Event()
    try:
        async with asyncio.timeout(120):
            for _ in range(INSTANCES):
                members.append(await launch(nats_url))
            # A settled cluster: until an instance writes format 2 (a lease after it heard
            # every other one), its waiting tasks end FAILED with it, as the upgrade rule
            # says (docs/how-to/upgrades.md); on a loaded machine the first SIGTERM came
            # before that.
            for member in members:
                await logged(member.process, "writing format 2")
            driving = asyncio.ensure_future(drive(members, load, done))
            for i in range(INSTANCES):
                old = members[i]
                old.stopping = True
                old.process.proc.send_signal(signal.SIGTERM)
                assert await old.process.proc.wait() == 0, "a clean drain"
                members[i] = await launch(nats_url)
                replaced.append(old)  # (its channel closes at the end: no call is cut by us)
            done.set()
            await driving
            assert not load.failed, load.failed[:5]
            assert load.completed and not load.waiting, "every task answered"
            assert load.retried, "the restarts refused some first attempts (retried once)"
            for task_id in load.completed:
                read = await members[0].stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
                assert read.status.state == S.TASK_STATE_COMPLETED
    finally:
        for member in [*members, *replaced]:
            await member.channel.close()
            if member.process.proc.returncode is None:
                member.process.proc.kill()
                await member.process.proc.wait()

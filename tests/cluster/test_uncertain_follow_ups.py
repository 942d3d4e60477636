"""A keyed follow-up whose owner did not answer runs once, when its client retries.

Routed to the task's owner, a follow-up that gets no trusted answer in time (an owner
SIGKILLed: NATS's "no responders" is not believed while its heartbeat stands) may or may
not have run: its retry key says so (``journal.keys``, *uncertain*), and each retry looks
at the task (``rpc.idempotency``). These are the cases where it must run it, once: the
owner died before acting, and a message id an earlier turn used (with
``idempotency-key``). (A refusal as too late, where nothing ran, lets the key go:
tests/unit/rpc/test_uncertain_keys.py.) Real nats-server, an owner process
and an instance in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import grpc
import pytest
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import GetTaskRequest, Role, SendMessageRequest, Task, TaskState

from tests.cluster.test_routing_forgery import ASKING, Asking, runs_of
from tests.support.clusterharness import Instance, instances
from tests.support.harness import KEYED, V1, copy, send_request
from tests.support.serveproc import Process, logged, start

S = TaskState
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
Metadata = Sequence[tuple[str, str]]


async def retried(
    b: Instance, request: SendMessageRequest, metadata: Metadata, deadline: float = 1.0
) -> tuple[Task, list[str]]:
    """Send through ``b`` until answered, retrying what a client retries (bounded)."""
    refusals: list[str] = []
    for _ in range(400):  # (bounded by each test's timeout too)
        try:
            reply = await b.stub.SendMessage(copy(request), metadata=metadata, timeout=deadline)
        except grpc.aio.AioRpcError as err:
            refusals.append(f"{err.code().name}: {err.details()}")
            if err.code() not in RETRYABLE:
                break
            await asyncio.sleep(0.1)  # sync-ok: a client's retry back-off
            continue
        return reply.task, refusals
    raise AssertionError(f"not answered: {refusals[-3:]}")


def said(task: Task) -> list[str]:
    """What the users said to the task, in order."""
    return [m.parts[0].text for m in task.history if m.role == Role.ROLE_USER]


@asynccontextmanager
async def owner_and_b(nats_url: str) -> AsyncIterator[tuple[Process, Instance, Task]]:
    """An owner process with a task waiting for input, and instance B (lease 2 s)."""
    owner = await start("--agent", ASKING, "--nats", nats_url, "--lease", "2")
    try:
        async with instances(Asking(), [nats_url], names=("B",), lease=2.0) as [b]:
            await logged(owner, "writing format 2")  # (so that its task is released)
            async with grpc.aio.insecure_channel(owner.grpc_addr) as channel:
                stub = a2a_pb2_grpc.A2AServiceStub(channel)
                task = (await stub.SendMessage(send_request("hi"), metadata=V1)).task
            assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
            yield owner, b, task
    finally:
        if owner.proc.returncode is None:
            owner.proc.kill()
            await owner.proc.wait()


async def test_a_follow_up_to_a_killed_owner_runs_once_when_retried(nats_url: str) -> None:
    # The review of the first forged-503 rule: a deadline under a lease ended
    # OWNER_TIMEOUT, and the retry was answered the task as it stood, never run.
    async with asyncio.timeout(60), owner_and_b(nats_url) as (owner, b, task):
        owner.proc.kill()
        await owner.proc.wait()
        one = send_request("one", task_id=task.id)
        answer, refusals = await retried(b, one, KEYED)
        seen = await b.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
    assert runs_of(seen, one.message.message_id) == 1, f"not run once; refused {refusals}"
    assert answer.status.message.parts[0].text == "got one", "answered with its own run"


async def test_a_turn_under_a_message_id_used_before_runs_when_retried(nats_url: str) -> None:
    # idempotency-key is for clients that reuse message ids: an earlier turn with the same
    # id in the history is not this turn having run.
    async with asyncio.timeout(60), owner_and_b(nats_url) as (owner, b, task):
        one = send_request("one", task_id=task.id, msg_id="reused")
        done = await b.stub.SendMessage(one, metadata=(*V1, ("idempotency-key", "k1")))
        assert done.task.status.state == S.TASK_STATE_INPUT_REQUIRED
        owner.proc.kill()
        await owner.proc.wait()
        two = send_request("two", task_id=task.id, msg_id="reused")
        answer, refusals = await retried(b, two, (*V1, ("idempotency-key", "k2")))
        seen = await b.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
    assert said(seen) == ["hi", "one", "two"], f"refused {refusals}"
    assert answer.status.message.parts[0].text == "got two"


async def test_an_owner_records_no_follow_up_after_its_askers_wait(nats_url: str) -> None:
    # A second review: an owner slowed past its asker's wait (here its task's lock, as a
    # slow journal would) recorded the follow-up afterwards, whenever it got there, so a
    # retry that took the key over after ``until`` ran it a second time.
    async with asyncio.timeout(30), instances(Asking(), [nats_url], lease=2.0) as [a, b]:
        task = (await a.stub.SendMessage(send_request("hi"), metadata=V1)).task
        live = a.service.engine.tasks.live_task(task.id)
        assert live is not None
        one = send_request("one", task_id=task.id)
        async with live.lock:  # (the owner's add_user_message queues behind this)
            with pytest.raises(grpc.aio.AioRpcError) as held:
                await b.stub.SendMessage(copy(one), metadata=KEYED, timeout=1.0)
            assert held.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        async with live.lock:  # (the lock is fair: the owner's turn came, and went)
            pass
        seen = await a.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
    assert said(seen) == ["hi"], "recorded after its asker stopped waiting"

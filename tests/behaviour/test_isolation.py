"""Isolation between principals (and tenants): one caller's task is, to every other caller,
exactly a task that does not exist; in memory and across two instances on NATS."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Part,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)

from a2a_grpc_server._internal.journal import RecordedTask
from a2a_grpc_server._internal.journal.memory import MemoryJournal
from a2a_grpc_server._internal.rpc.resume import RESUME_AFTER_KEY, URI
from tests.support.agents import InputAgent
from tests.support.clusterharness import instances
from tests.support.harness import ALICE, BOB, V1, error_of, rich_status, send_request, serve, tokens

S = TaskState
Stub = a2a_pb2_grpc.A2AServiceStub


async def answer_of(attempt: Any, task_id: str) -> tuple[object, ...]:
    """The error of a call, with the task id it names made anonymous."""
    err = await error_of(attempt)
    _, info = rich_status(err)
    return (
        err.code(),
        (err.details() or "").replace(task_id, "<id>"),
        info.reason,
        info.domain,
        sorted((k, v.replace(task_id, "<id>")) for k, v in info.metadata.items()),
    )


async def assert_as_if_missing(make: Callable[[str], Any], task_id: str) -> None:
    """``make(task_id)`` fails as ``make`` of an id that never existed: NOT_FOUND, same words."""
    missing = str(uuid.uuid4())
    seen = await answer_of(make(task_id), task_id)
    assert seen[0] == grpc.StatusCode.NOT_FOUND, seen
    assert seen == await answer_of(make(missing), missing)


async def assert_hidden(owner: Stub, outsider: Stub, task_id: str, context_id: str) -> None:
    """Every RPC naming the owner's task answers the outsider as for a missing task."""
    cases: list[Callable[[str], Any]] = [
        lambda i: outsider.GetTask(GetTaskRequest(id=i), metadata=BOB),
        lambda i: outsider.SubscribeToTask(SubscribeToTaskRequest(id=i), metadata=BOB),
        lambda i: outsider.SubscribeToTask(
            SubscribeToTaskRequest(id=i),
            metadata=(*BOB, ("a2a-extensions", URI), (RESUME_AFTER_KEY, "1")),
        ),
        lambda i: outsider.CancelTask(CancelTaskRequest(id=i), metadata=BOB),
        lambda i: outsider.SendMessage(send_request("me", task_id=i), metadata=BOB),
        # A wrong context id must not tell the task apart from a missing one either.
        lambda i: outsider.SendMessage(
            send_request("me", task_id=i, context_id="other"), metadata=BOB
        ),
        lambda i: outsider.SendStreamingMessage(send_request("me", task_id=i), metadata=BOB),
        lambda i: outsider.CreateTaskPushNotificationConfig(
            TaskPushNotificationConfig(task_id=i, url="https://hooks.example.com/a2a"),
            metadata=BOB,
        ),
        lambda i: outsider.GetTaskPushNotificationConfig(
            GetTaskPushNotificationConfigRequest(task_id=i, id="c1"), metadata=BOB
        ),
        lambda i: outsider.ListTaskPushNotificationConfigs(
            ListTaskPushNotificationConfigsRequest(task_id=i), metadata=BOB
        ),
        lambda i: outsider.DeleteTaskPushNotificationConfig(
            DeleteTaskPushNotificationConfigRequest(task_id=i, id="c1"), metadata=BOB
        ),
        # The owner under another tenant is another caller.
        lambda i: outsider.GetTask(GetTaskRequest(id=i, tenant="other"), metadata=ALICE),
        lambda i: outsider.CancelTask(CancelTaskRequest(id=i, tenant="other"), metadata=ALICE),
    ]
    for make in cases:
        await assert_as_if_missing(make, task_id)
    listed = await outsider.ListTasks(ListTasksRequest(), metadata=BOB)
    assert task_id not in [t.id for t in listed.tasks]
    assert listed.total_size == len(listed.tasks)
    other_tenant = await outsider.ListTasks(ListTasksRequest(tenant="other"), metadata=ALICE)
    assert task_id not in [t.id for t in other_tenant.tasks]
    # Nothing the outsider did touched the task.
    task = await owner.GetTask(GetTaskRequest(id=task_id), metadata=ALICE)
    assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
    assert task.context_id == context_id
    assert len(task.history) == 1, "no follow-up of the outsider was added"


async def assert_owner_served(owner: Stub, via: Stub, task_id: str) -> None:
    """The owner reaches its own task through ``via``: list, push configs, subscribe, continue."""
    listed = await via.ListTasks(ListTasksRequest(), metadata=ALICE)
    assert task_id in [t.id for t in listed.tasks]
    configs = await via.ListTaskPushNotificationConfigs(
        ListTaskPushNotificationConfigsRequest(task_id=task_id), metadata=ALICE
    )
    assert list(configs.configs) == []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await via.GetTaskPushNotificationConfig(
            GetTaskPushNotificationConfigRequest(task_id=task_id, id="c1"), metadata=ALICE
        )
    assert rich_status(caught.value)[1].reason == "PUSH_CONFIG_NOT_FOUND"
    stream = via.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=ALICE)
    first = await stream.read()
    assert first.task.id == task_id
    stream.cancel()
    answer = await via.SendMessage(send_request("alice", task_id=task_id), metadata=ALICE)
    assert answer.task.status.state == S.TASK_STATE_COMPLETED
    assert answer.task.status.message.parts[0].text == "hello alice"


async def test_another_principal_cannot_tell_a_task_from_a_missing_one(tmp_path: Path) -> None:
    async with asyncio.timeout(30), serve(InputAgent(), auth=tokens(tmp_path)) as h:
        task = (await h.stub.SendMessage(send_request("hi"), metadata=ALICE)).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        await assert_hidden(h.stub, h.stub, task.id, task.context_id)
        await assert_owner_served(h.stub, h.stub, task.id)


async def test_tasks_of_one_tenant_are_not_seen_under_another(tmp_path: Path) -> None:
    async with asyncio.timeout(30), serve(InputAgent()) as h:  # no authentication
        request = send_request("hi")
        request.tenant = "t1"
        task = (await h.stub.SendMessage(request, metadata=V1)).task
        await assert_as_if_missing(
            lambda i: h.stub.GetTask(GetTaskRequest(id=i), metadata=V1), task.id
        )
        got = await h.stub.GetTask(GetTaskRequest(id=task.id, tenant="t1"), metadata=V1)
        assert got.id == task.id
        listed = await h.stub.ListTasks(ListTasksRequest(tenant="t1"), metadata=V1)
        assert [t.id for t in listed.tasks] == [task.id]
        assert not (await h.stub.ListTasks(ListTasksRequest(), metadata=V1)).tasks
        await h.stub.CancelTask(CancelTaskRequest(id=task.id, tenant="t1"), metadata=V1)


async def test_isolation_holds_through_either_instance_of_a_cluster(
    nats_url: str, tmp_path: Path
) -> None:
    auth = tokens(tmp_path)
    async with asyncio.timeout(60), instances(InputAgent(), [nats_url], auth=auth) as (a, b):
        task = (await a.stub.SendMessage(send_request("hi"), metadata=ALICE)).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        await assert_hidden(a.stub, a.stub, task.id, task.context_id)  # through the owner
        await assert_hidden(a.stub, b.stub, task.id, task.context_id)  # through the other
        # The owner's follow-up through B is routed to A, which runs it as alice.
        await assert_owner_served(a.stub, b.stub, task.id)
        other = (await b.stub.SendMessage(send_request("hi"), metadata=ALICE)).task
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await a.stub.CancelTask(CancelTaskRequest(id=other.id), metadata=BOB)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        canceled = await a.stub.CancelTask(CancelTaskRequest(id=other.id), metadata=ALICE)
        assert canceled.status.state == S.TASK_STATE_CANCELED


class MemoryAgent(AgentExecutor):
    """Keeps memory per context (a common pattern): answers each message with every earlier
    message of its context."""

    def __init__(self) -> None:
        self.memory: dict[str, list[str]] = {}

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        earlier = self.memory.setdefault(context.context_id, [])
        reply = " | ".join(earlier) or "(nothing earlier)"
        earlier.append(context.get_user_input())
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.complete(updater.new_agent_message([Part(text=reply)]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


async def test_a_context_belongs_to_the_caller_that_created_it(tmp_path: Path) -> None:
    async def reply(stub: Stub, text: str, context_id: str, who: Any) -> Task:
        request = send_request(text, context_id=context_id)
        task: Task = (await stub.SendMessage(request, metadata=who)).task
        return task

    async with asyncio.timeout(30), serve(MemoryAgent(), auth=tokens(tmp_path)) as h:
        first = await reply(h.stub, "alice's secret plan", "", ALICE)
        mine = first.context_id
        again = await reply(h.stub, "and more", mine, ALICE)
        assert again.context_id == mine, "the creator joins its own context"
        assert again.status.message.parts[0].text == "alice's secret plan"
        # Bob names alice's context: he gets a fresh one, exactly as for an id never issued.
        stolen = await reply(h.stub, "what did alice say?", mine, BOB)
        invented = await reply(h.stub, "hello", "a-context-nobody-made", BOB)
        for task, asked in ((stolen, mine), (invented, "a-context-nobody-made")):
            assert task.context_id not in (asked, mine), "a fresh context"
            assert task.status.message.parts[0].text == "(nothing earlier)"
        listed = await h.stub.ListTasks(ListTasksRequest(context_id=mine), metadata=BOB)
        assert not listed.tasks
        odd = await reply(h.stub, "hi", "x.\u00e9t\u00e9", BOB)  # any text: still a fresh one
        assert odd.context_id != "x.\u00e9t\u00e9"
        # Bob's own context is his to continue.
        more = await reply(h.stub, "and again", stolen.context_id, BOB)
        assert more.context_id == stolen.context_id
        assert more.status.message.parts[0].text == "what did alice say?"


class CountingJournal(MemoryJournal):
    """The in-memory journal, counting the task bodies it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    async def get(self, task_id: str) -> RecordedTask | None:
        self.reads.append(task_id)
        return await super().get(task_id)


async def test_another_callers_task_is_refused_before_its_body_is_read(tmp_path: Path) -> None:
    # The time to answer NOT_FOUND must not tell a large task of alice's from a missing id
    # (z = 25 over 2,000 pairs for 1 MiB, before): the scope is checked first (issue 22).
    journal = CountingJournal()
    async with (
        asyncio.timeout(30),
        serve(InputAgent(), journal=journal, auth=tokens(tmp_path)) as h,
    ):
        task = (await h.stub.SendMessage(send_request("hi"), metadata=ALICE)).task
        h.service.engine.tasks.parking.evict_idle(now=float("inf"))  # (out of memory: read)
        journal.reads.clear()
        attempts: list[Callable[[], Any]] = [
            lambda: h.stub.GetTask(GetTaskRequest(id=task.id), metadata=BOB),
            lambda: h.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=BOB),
            lambda: h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task.id), metadata=BOB),
            lambda: h.stub.SendMessage(send_request("me", task_id=task.id), metadata=BOB),
        ]
        for make in attempts:
            err = await error_of(make())
            assert err.code() == grpc.StatusCode.NOT_FOUND
        assert journal.reads == [], "refused before the body was read"
        await h.stub.GetTask(GetTaskRequest(id=task.id), metadata=ALICE)
        assert journal.reads == [task.id], "the owner's read does read it"


async def test_a_context_belongs_to_the_tenant_that_created_it_without_authentication() -> None:
    # Without an authenticator only the tenant tells callers apart: a context id must be
    # good for the tenant it was issued to only (issue 22).
    async def reply(text: str, context_id: str, tenant: str) -> Task:
        request = send_request(text, context_id=context_id)
        request.tenant = tenant
        task: Task = (await h.stub.SendMessage(request, metadata=V1)).task
        return task

    agent = MemoryAgent()
    async with asyncio.timeout(30), serve(agent) as h:
        first = await reply("tenant a's secret plan", "", "a")
        mine = first.context_id
        again = await reply("and more", mine, "a")
        assert again.context_id == mine, "the creating tenant joins its own context"
        assert again.status.message.parts[0].text == "tenant a's secret plan"
        stolen = await reply("what did tenant a say?", mine, "b")
        assert stolen.context_id != mine, "a fresh context"
        assert stolen.status.message.parts[0].text == "(nothing earlier)"
        # Nor may a caller without a tenant (the anonymous scope takes ids as sent).
        tenantless = await reply("and what now?", mine, "")
        assert tenantless.context_id != mine, "a fresh context"
        assert tenantless.status.message.parts[0].text == "(nothing earlier)"
        assert agent.memory[mine] == ["tenant a's secret plan", "and more"]
        # Without tenant or principal, ids are taken as sent, as before.
        plain = await reply("one", "my-own-context", "")
        assert plain.context_id == "my-own-context"
        assert (await reply("two", "my-own-context", "")).status.message.parts[0].text == "one"

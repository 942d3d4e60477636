"""Bad input gets the right status with ErrorInfo, and disturbs nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from google.rpc import error_details_pb2

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.app import errortable
from tests.support import ROOT
from tests.support.agents import GatedAgent
from tests.support.harness import V1, Harness, rich_status, send_request, serve, user_message

S = TaskState


def message(**fields: Any) -> SendMessageRequest:
    base: dict[str, Any] = {"message_id": "m1", "role": Role.ROLE_USER, "parts": [Part(text="x")]}
    base.update(fields)
    return SendMessageRequest(message=Message(**base))


INVALID: list[tuple[str, Callable[[Harness], Awaitable[object]], str]] = [
    ("no message", lambda h: h.stub.SendMessage(SendMessageRequest(), metadata=V1), "message"),
    (
        "no message id",
        lambda h: h.stub.SendMessage(message(message_id=""), metadata=V1),
        "message.message_id",
    ),
    ("no parts", lambda h: h.stub.SendMessage(message(parts=[]), metadata=V1), "message.parts"),
    (
        "empty part",
        lambda h: h.stub.SendMessage(message(parts=[Part()]), metadata=V1),
        "message.parts[0]",
    ),
    (
        "agent role",
        lambda h: h.stub.SendMessage(message(role=Role.ROLE_AGENT), metadata=V1),
        "message.role",
    ),
    ("unknown role", lambda h: h.stub.SendMessage(message(role=7), metadata=V1), "message.role"),
    (
        "oversized",
        lambda h: h.stub.SendMessage(message(parts=[Part(text="y" * 5000)]), metadata=V1),
        "request",
    ),
    ("get without id", lambda h: h.stub.GetTask(GetTaskRequest(), metadata=V1), "id"),
    (
        "negative history",
        lambda h: h.stub.GetTask(GetTaskRequest(id="t", history_length=-1), metadata=V1),
        "history_length",
    ),
    ("cancel without id", lambda h: h.stub.CancelTask(CancelTaskRequest(), metadata=V1), "id"),
    (
        "page size 0",
        lambda h: h.stub.ListTasks(ListTasksRequest(page_size=0), metadata=V1),
        "page_size",
    ),
    (
        "page size 101",
        lambda h: h.stub.ListTasks(ListTasksRequest(page_size=101), metadata=V1),
        "page_size",
    ),
    (
        "unknown status",
        lambda h: h.stub.ListTasks(ListTasksRequest(status=cast(TaskState, 42)), metadata=V1),
        "status",
    ),
    (
        "bad page token",
        lambda h: h.stub.ListTasks(ListTasksRequest(page_token="zzz"), metadata=V1),
        "page_token",
    ),
]


async def read_all(call: Any) -> list[object]:
    return [frame async for frame in call]


async def test_malformed_requests_get_invalid_argument_naming_the_field_and_disturb_nothing() -> (
    None
):
    agent = GatedAgent()
    config = ServerConfig(max_message_bytes=4000)
    async with asyncio.timeout(10), serve(agent, config) as h:
        live = h.client.send_message_streaming(send_request("keep going"))
        task_id = (await anext(live)).task.id
        await agent.working.wait()
        for name, call, field in INVALID:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(h)
            err = caught.value
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            status, info = rich_status(err)
            assert info.domain == "a2a-protocol.org", name
            assert info.reason == "INVALID_PARAMS", name
            bad = error_details_pb2.BadRequest()
            assert any(d.Unpack(bad) for d in status.details), name
            assert bad.field_violations[0].field == field, name
            assert field in (err.details() or ""), name
        for stream in (
            h.stub.SendStreamingMessage(SendMessageRequest(), metadata=V1),
            h.stub.SubscribeToTask(SubscribeToTaskRequest(), metadata=V1),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await read_all(stream)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        agent.release.set()
        frames = [f async for f in live]
        assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        task = await h.client.get_task(GetTaskRequest(id=task_id))
        assert task.status.state == S.TASK_STATE_COMPLETED
        await h.settle()


@pytest.mark.parametrize("version", ["2.0", "0.2", "banana"])
async def test_unsupported_version_is_refused_with_version_not_supported(version: str) -> None:
    async with asyncio.timeout(10), serve(GatedAgent()) as h:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.GetTask(GetTaskRequest(id="t"), metadata=(("a2a-version", version),))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        _, info = rich_status(caught.value)
        assert info.reason == "VERSION_NOT_SUPPORTED"
        assert "1.0" in (caught.value.details() or "")


PRECONDITIONS: list[tuple[Callable[[Harness], Awaitable[object]], str]] = [
    (
        lambda h: h.stub.CreateTaskPushNotificationConfig(
            TaskPushNotificationConfig(task_id="t", url="http://127.0.0.1/x"), metadata=V1
        ),
        "PUSH_NOTIFICATION_NOT_SUPPORTED",
    ),
    (
        lambda h: h.stub.GetTaskPushNotificationConfig(
            GetTaskPushNotificationConfigRequest(task_id="t", id="c"), metadata=V1
        ),
        "PUSH_NOTIFICATION_NOT_SUPPORTED",
    ),
    (
        lambda h: h.stub.ListTaskPushNotificationConfigs(
            ListTaskPushNotificationConfigsRequest(task_id="t"), metadata=V1
        ),
        "PUSH_NOTIFICATION_NOT_SUPPORTED",
    ),
    (
        lambda h: h.stub.DeleteTaskPushNotificationConfig(
            DeleteTaskPushNotificationConfigRequest(task_id="t", id="c"), metadata=V1
        ),
        "PUSH_NOTIFICATION_NOT_SUPPORTED",
    ),
    (
        lambda h: h.stub.GetExtendedAgentCard(GetExtendedAgentCardRequest(), metadata=V1),
        "EXTENDED_AGENT_CARD_NOT_CONFIGURED",
    ),
]


async def test_unsupported_features_answer_failed_precondition_with_their_reason() -> None:
    # Push is on by default (tests/behaviour/test_push.py); this server turns it off.
    config = ServerConfig(cancel_timeout=1.0, push=False)
    async with asyncio.timeout(10), serve(GatedAgent(), config) as h:
        assert not h.service.card.capabilities.push_notifications
        for call, reason in PRECONDITIONS:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(h)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert rich_status(caught.value)[1].reason == reason


async def test_error_codes_for_unknown_terminal_and_not_cancelable_tasks() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        for call in (
            h.stub.GetTask(GetTaskRequest(id="missing"), metadata=V1),
            h.stub.CancelTask(CancelTaskRequest(id="missing"), metadata=V1),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert rich_status(caught.value)[1].reason == "TASK_NOT_FOUND"
        agent.release.set()
        done = await h.stub.SendMessage(send_request("x"), metadata=V1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.CancelTask(CancelTaskRequest(id=done.task.id), metadata=V1)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert rich_status(caught.value)[1].reason == "TASK_NOT_CANCELABLE"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await read_all(
                h.stub.SubscribeToTask(SubscribeToTaskRequest(id=done.task.id), metadata=V1)
            )
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert rich_status(caught.value)[1].reason == "UNSUPPORTED_OPERATION"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.SendMessage(
                SendMessageRequest(message=user_message("x", task_id=done.task.id)), metadata=V1
            )
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert rich_status(caught.value)[1].reason == "UNSUPPORTED_OPERATION"


class BrokenJournal:
    """A journal whose every read fails: the server must answer INTERNAL, generically."""

    async def get(self, task_id: str) -> None:
        raise RuntimeError("disk on fire: secret path /var/lib/x")

    async def list(self, query: object) -> None:
        raise RuntimeError("disk on fire")


async def test_unexpected_errors_are_internal_with_a_generic_message() -> None:
    import grpc as _grpc

    from a2a_grpc_server import A2AService

    service = A2AService(GatedAgent(), journal=BrokenJournal())  # type: ignore[arg-type]
    server = _grpc.aio.server()
    service.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with _grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            from a2a.types import a2a_pb2_grpc

            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.GetTask(GetTaskRequest(id="t"), metadata=V1)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "secret" not in (caught.value.details() or "")
            assert rich_status(caught.value)[1].reason == "INTERNAL"
    finally:
        await server.stop(None)


async def test_part_with_a_media_type_the_card_does_not_accept_is_refused() -> None:
    agent = GatedAgent()
    agent.release.set()
    async with asyncio.timeout(10), serve(agent) as h:
        image = message(parts=[Part(raw=b"\x89PNG", media_type="image/png")])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.SendMessage(image, metadata=V1)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rich_status(caught.value)[1].reason == "CONTENT_TYPE_NOT_SUPPORTED"
        assert "text/plain" in (caught.value.details() or "")
        text = message(parts=[Part(text="hi", media_type="Text/Plain; charset=utf-8")])
        accepted = await h.stub.SendMessage(text, metadata=V1)
        assert accepted.task.status.state == S.TASK_STATE_COMPLETED


def test_the_errors_page_lists_every_error_of_the_tree() -> None:
    page = (ROOT / "docs" / "reference" / "errors.md").read_text()
    begin, end = "<!-- errors:begin -->\n", "<!-- errors:end -->"
    table = page[page.index(begin) + len(begin) : page.index(end)]
    assert table == errortable.markdown(), (
        "docs/reference/errors.md is stale: run scripts/errors_table"
    )
    for reason in ("FRAME_NOT_KEPT", "RELAY_LOST", "STREAMS_QUOTA", "TASK_NOT_FOUND"):
        assert f"| {reason} |" in table


async def test_ids_with_control_characters_are_refused_at_the_edge() -> None:
    # Ids reach log lines and headers: a newline in one would forge a log line (issue 22).
    async with asyncio.timeout(20), serve(GatedAgent()) as h:
        forged = "x\nINFO a2a_grpc_server: forged"
        message = user_message("hi", context_id=forged)
        bad_tenant = SendMessageRequest(message=user_message("hi"), tenant="t\x00")
        for attempt, field in (
            (h.stub.GetTask(GetTaskRequest(id=forged), metadata=V1), "id"),
            (h.stub.SendMessage(SendMessageRequest(message=message), metadata=V1), "context_id"),
            (h.stub.SendMessage(bad_tenant, metadata=V1), "tenant"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await attempt
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "control character" in (caught.value.details() or ""), field
            assert field in (caught.value.details() or "")
        assert h.service.engine.tasks.count == 0, "nothing started"

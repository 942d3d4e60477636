"""A hostile client: undecodable bytes, oversized ids and headers; clear errors, nothing lost."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.rpc.servicer import SERVICE
from tests.support.agents import BurstAgent, GatedAgent
from tests.support.harness import (
    V1,
    Harness,
    rich_status,
    send_request,
    serve,
    user_message,
    varint,
)

TRAILER_BUDGET = 4096
"""Bytes an error's trailers may take at most (clients read 8 KiB of metadata by default)."""


def field(number: int, body: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(body)) + body


def nested_struct(depth: int) -> bytes:
    """A SendMessageRequest whose message metadata nests Structs ``depth`` deep."""
    value = field(3, b"x")  # Value.string_value
    for _ in range(depth):
        entry = field(1, b"k") + field(2, value)  # map entry: key, Value
        value = field(5, field(1, entry))  # Value.struct_value = Struct{fields: [entry]}
    metadata = field(1, field(1, b"k") + field(2, value))  # Struct{fields: [k: value]}
    message = field(1, b"m1") + field(4, b"\x0a\x01x") + field(6, metadata)
    return field(1, message)


UNDECODABLE = {
    "truncated": send_request("hello").SerializeToString()[:-3],
    "random": bytes(range(7, 250, 3)),
    "invalid utf-8 in a string": field(1, field(1, b"\xff\xfe\xfd")),
    "a wrong message type": GetTaskRequest(id="t", history_length=3).SerializeToString() + b"\xff",
    "nested past the recursion limit": nested_struct(200),
}


def raw_call(h: Harness, method: str, streaming: bool) -> grpc.aio.UnaryUnaryMultiCallable:  # type: ignore[type-arg]
    path = f"/{SERVICE.full_name}/{method}"
    if streaming:
        return h.channel.unary_stream(path)  # type: ignore[return-value]
    return h.channel.unary_unary(path)


async def finish(call: object) -> None:
    """Await a unary call, or read a stream call to its end."""
    if hasattr(call, "read"):
        async for _ in call:  # type: ignore[attr-defined]
            pass
    else:
        await call  # type: ignore[misc]


async def test_undecodable_requests_answer_invalid_argument_with_error_info_at_every_method(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = GatedAgent()
    async with asyncio.timeout(20), serve(agent) as h:
        live = h.client.send_message_streaming(send_request("keep going"))
        task_id = (await anext(live)).task.id
        with caplog.at_level(logging.DEBUG, logger="a2a_grpc_server"):
            for method in SERVICE.methods:
                call = raw_call(h, method.name, method.server_streaming)
                for name, data in UNDECODABLE.items():
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await finish(call(data, metadata=V1, timeout=5))
                    err = caught.value
                    what = f"{method.name}: {name}"
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, what
                    _, info = rich_status(err)
                    assert info.reason == "INVALID_REQUEST", what
                    assert method.input_type.full_name in (err.details() or ""), what
        # At most one line per period for all of them, and never a traceback.
        ours = [r for r in caplog.records if "undecodable" in r.getMessage()]
        assert len(ours) == 1
        assert not any(r.exc_info for r in caplog.records)
        # The task that was running is unaffected.
        agent.release.set()
        frames = [f async for f in live]
        assert frames[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED
        task = await h.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert task.status.state == TaskState.TASK_STATE_COMPLETED


def trailer_size(err: grpc.aio.AioRpcError) -> int:
    size = len(err.details() or "")
    for key, value in err.trailing_metadata() or ():
        size += len(key) + len(value)
    return size


HUGE = "x" * 200_000


async def test_oversized_client_input_is_refused_with_a_small_error() -> None:
    agent = GatedAgent()
    agent.release.set()
    async with asyncio.timeout(20), serve(agent) as h:
        calls = {
            "GetTask id": h.stub.GetTask(GetTaskRequest(id=HUGE), metadata=V1),
            "CancelTask id": h.stub.CancelTask(CancelTaskRequest(id=HUGE), metadata=V1),
            "ListTasks context": h.stub.ListTasks(ListTasksRequest(context_id=HUGE), metadata=V1),
            "ListTasks token": h.stub.ListTasks(ListTasksRequest(page_token=HUGE), metadata=V1),
            "SendMessage task id": h.stub.SendMessage(
                SendMessageRequest(message=user_message(task_id=HUGE)), metadata=V1
            ),
            "SendMessage context id": h.stub.SendMessage(
                SendMessageRequest(message=user_message(context_id=HUGE)), metadata=V1
            ),
        }
        for what, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            err = caught.value
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert rich_status(err)[1].reason == "INVALID_PARAMS", what
            assert "at most 256" in (err.details() or "") or "at most 1024" in (
                err.details() or ""
            ), what
            assert trailer_size(err) < TRAILER_BUDGET, what
        # Not over the id bound, but long: quoted, cut.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.GetTask(GetTaskRequest(id="y" * 256), metadata=V1)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert trailer_size(caught.value) < TRAILER_BUDGET
        # A long version header: refused, not echoed whole.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.GetTask(GetTaskRequest(id="t"), metadata=(("a2a-version", "9" * 6000),))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert trailer_size(caught.value) < TRAILER_BUDGET
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in h.stub.SubscribeToTask(SubscribeToTaskRequest(id=HUGE), metadata=V1):
                pass
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        done = await h.stub.SendMessage(send_request("still serving"), metadata=V1)
        assert done.task.status.state == TaskState.TASK_STATE_COMPLETED


async def test_clients_that_leave_mid_burst_end_their_streams_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 64 KiB frames: a client that stops reading has a write pending within two frames.
    agent = BurstAgent(count=400, size=64 * 1024)
    config = ServerConfig(
        cancel_timeout=1.0, max_task_bytes=64 << 20, log_max_bytes=64 << 20, log_total_bytes=1 << 30
    )
    async with asyncio.timeout(30), serve(agent, config) as h:
        sender = h.stub.SendStreamingMessage(send_request("go"), metadata=V1)
        task_id = (await sender.read()).task.id
        await sender.read()  # WORKING
        watchers = []
        for _ in range(20):
            call = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
            await call.read()  # attached
            watchers.append(call)
        agent.release.set()
        for call in watchers:
            for _ in range(10):  # each takes a few frames, then its client leaves
                await call.read()
            call.cancel()
        frames: list[object] = []
        while (frame := await sender.read()) is not grpc.aio.EOF:
            frames.append(frame)
        assert len(frames) == 401
        await h.settle(within=5)
        ended = h.service.metrics.streams_ended
        assert ended["error"] == 0 and ended["disconnected"] == 20, ended
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

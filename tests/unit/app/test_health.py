"""gRPC conventions: health per service turns NOT_SERVING as a drain starts; channelz with
--admin, authenticated like the A2A service."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import TaskState
from grpc_channelz.v1 import channelz_pb2, channelz_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from a2a_grpc_server import A2AServer
from a2a_grpc_server._internal.rpc.auth import TokenFile
from tests.support.agents import GatedAgent
from tests.support.harness import V1, send_request

Status = health_pb2.HealthCheckResponse


async def test_every_service_turns_not_serving_as_the_drain_starts() -> None:
    agent = GatedAgent()
    server = A2AServer(agent, host="127.0.0.1", port=0, http_port=None)
    await server.start()
    stopping: asyncio.Task[None] | None = None
    try:
        async with (
            asyncio.timeout(20),
            grpc.aio.insecure_channel(server.grpc_address) as channel,
        ):
            health = health_pb2_grpc.HealthStub(channel)
            watches = {
                name: health.Watch(health_pb2.HealthCheckRequest(service=name))
                for name in ("", "lf.a2a.v1.A2AService")
            }
            for watch in watches.values():
                assert (await watch.read()).status == Status.SERVING
            stream = a2a_pb2_grpc.A2AServiceStub(channel).SendStreamingMessage(
                send_request("go"), metadata=V1
            )
            await stream.read()
            await agent.working.wait()
            stopping = asyncio.create_task(server.stop(grace=10))  # the task holds the drain
            for watch in watches.values():
                assert (await watch.read()).status == Status.NOT_SERVING
            check = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert check.status == Status.NOT_SERVING
            assert not stopping.done(), "still draining: the task is running"
            agent.release.set()
            last = None
            while (frame := await stream.read()) is not grpc.aio.EOF:
                last = frame
            assert last is not None
            assert last.status_update.status.state == TaskState.TASK_STATE_COMPLETED
            for watch in watches.values():
                watch.cancel()
            await stopping
    finally:
        agent.release.set()
        if stopping is None or not stopping.done():
            await server.stop(grace=0)


async def test_admin_serves_channelz_authenticated_like_a2a(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("ops:ops-token\n")
    server = A2AServer(
        GatedAgent(), host="127.0.0.1", port=0, http_port=None, auth=TokenFile(tokens), admin=True
    )
    await server.start()
    try:
        async with (
            asyncio.timeout(20),
            grpc.aio.insecure_channel(server.grpc_address) as channel,
        ):
            channelz = channelz_pb2_grpc.ChannelzStub(channel)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channelz.GetServers(channelz_pb2.GetServersRequest())
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = await channelz.GetServers(
                channelz_pb2.GetServersRequest(),
                metadata=(("authorization", "Bearer ops-token"),),
            )
            assert answer.server, "this server is listed"
            with pytest.raises(grpc.aio.AioRpcError) as caught:  # (set_code, not abort)
                await channelz.GetServer(
                    channelz_pb2.GetServerRequest(server_id=10**15),
                    metadata=(("authorization", "Bearer ops-token"),),
                )
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        handled = server.service.rpc_metrics.handled
        channelz_labels = ("grpc.channelz.v1.Channelz", "GetServer", "unary")
        assert handled[(*channelz_labels, "NOT_FOUND")] == 1, "counted with its real status"
        assert handled[(*channelz_labels, "OK")] == 0
    finally:
        await server.stop(grace=0)

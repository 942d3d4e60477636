"""/metrics after a scripted run, read with prometheus-client's own parser: every metric of
the server, the per-RPC ones, and the process's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import CancelTaskRequest, GetTaskRequest, SubscribeToTaskRequest, TaskState
from prometheus_client import CollectorRegistry, generate_latest

from a2a_grpc_server import A2AServer, A2AService, ServerConfig
from tests.support.agents import GatedAgent, InputAgent
from tests.support.harness import V1, Sample, samples, send_request

S = TaskState


def rpc(method: str, code: str | None = None, kind: str = "unary") -> tuple[tuple[str, str], ...]:
    labels = {"grpc_service": "lf.a2a.v1.A2AService", "grpc_method": method, "grpc_type": kind}
    if code is not None:
        labels["grpc_code"] = code
    return tuple(sorted(labels.items()))


@pytest.fixture
async def server() -> AsyncIterator[A2AServer]:
    agent = InputAgent()
    running = A2AServer(
        agent, host="127.0.0.1", port=0, http_port=0, config=ServerConfig(cancel_timeout=1.0)
    )
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace=0)


async def scrape(server: A2AServer) -> dict[Sample, float]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{server.http_port}/metrics") as answer,
    ):
        assert answer.status == 200
        assert answer.headers["Cache-Control"] == "no-store"
        return samples(await answer.text())


async def test_metrics_after_a_scripted_run(server: A2AServer) -> None:
    async with asyncio.timeout(20), grpc.aio.insecure_channel(server.grpc_address) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        # 1: a stream to a task that asks for input (interrupted), then a follow-up completes it.
        frames = [f async for f in stub.SendStreamingMessage(send_request("hi"), metadata=V1)]
        task_id = frames[0].task.id
        await stub.SendMessage(send_request("me", task_id=task_id), metadata=V1)
        # 2: a task canceled while it waits for input.
        parked = (await stub.SendMessage(send_request("hi"), metadata=V1)).task
        await stub.CancelTask(CancelTaskRequest(id=parked.id), metadata=V1)
        # 3: two lookups of a task that does not exist; a subscription to an ended one.
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.GetTask(GetTaskRequest(id="missing"), metadata=V1)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1).read()
        found = await scrape(server)
    assert found[("a2a_tasks_started_total", ())] == 2
    assert found[("a2a_tasks_ended_total", (("state", "TASK_STATE_COMPLETED"),))] == 1
    assert found[("a2a_tasks_ended_total", (("state", "TASK_STATE_CANCELED"),))] == 1
    assert found[("a2a_streams_ended_total", (("reason", "interrupted"),))] == 1
    assert found[("a2a_streams_open", ())] == 0
    assert found[("a2a_cancel_seconds_count", ())] == 1
    assert found[("a2a_log_frames_dropped_total", ())] == 0
    assert found[("grpc_server_started_total", rpc("SendMessage"))] == 2
    assert found[("grpc_server_handled_total", rpc("SendMessage", "OK"))] == 2
    assert found[("grpc_server_handled_total", rpc("CancelTask", "OK"))] == 1
    assert found[("grpc_server_handled_total", rpc("GetTask", "NOT_FOUND"))] == 2
    stream = ("SendStreamingMessage", "OK", "server_stream")
    assert found[("grpc_server_handled_total", rpc(*stream))] == 1
    subscribe = rpc("SubscribeToTask", "FAILED_PRECONDITION", "server_stream")
    assert found[("grpc_server_handled_total", subscribe)] == 1
    assert found[("grpc_server_handling_seconds_count", rpc("GetTask"))] == 2
    assert found[("grpc_server_handling_seconds_bucket", (*rpc("GetTask"), ("le", "+Inf")))] == 2
    assert found[("process_cpu_seconds_total", ())] > 0
    assert found[("process_resident_memory_bytes", ())] > 0
    assert any(name == "python_gc_collections_total" for name, _ in found)


async def test_an_embedder_registers_the_collector_in_its_own_registry() -> None:
    service = A2AService(GatedAgent())
    registry = CollectorRegistry()
    registry.register(service.collector())
    service.metrics.tasks_started += 3
    found = samples(generate_latest(registry).decode())
    assert found[("a2a_tasks_started_total", ())] == 3
    assert ("process_cpu_seconds_total", ()) not in found, "only what the embedder registered"

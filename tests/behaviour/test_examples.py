"""The runnable examples: embedding into an existing grpc.aio server, and a two-instance
cluster on one machine (examples/client.py: tests/behaviour/test_client_example.py)."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from examples.embed import serve
from examples.tck_agent import TckAgent
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY, generate_latest

from tests.support import ROOT
from tests.support.harness import V1, samples, send_request, user_message
from tests.support.harness import serve as harness_serve


async def test_embedding_beside_an_existing_service() -> None:
    stop, bound = asyncio.Event(), asyncio.Future[int]()
    running = asyncio.create_task(serve(0, stop, bound.set_result))
    try:
        async with asyncio.timeout(20):
            port = await bound
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                check = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                stub = a2a_pb2_grpc.A2AServiceStub(channel)
                answer = await stub.SendMessage(send_request("hi"), metadata=V1)
                assert answer.task.status.state == TaskState.TASK_STATE_COMPLETED
            found = samples(generate_latest(REGISTRY).decode())
            assert found[("a2a_tasks_started_total", ())] == 1
            ok = (
                ("grpc_code", "OK"),
                ("grpc_method", "SendMessage"),
                ("grpc_service", "lf.a2a.v1.A2AService"),
                ("grpc_type", "unary"),
            )
            assert found[("grpc_server_handled_total", ok)] == 1
    finally:
        stop.set()
        await running
    assert ("a2a_tasks_started_total", ()) not in samples(generate_latest(REGISTRY).decode())


async def test_the_two_instance_cluster_shares_its_tasks() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.cluster",
        "0",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            addresses: list[str] = []
            while len(addresses) < 2:
                line = (await proc.stdout.readline()).decode()
                assert line, "the example exited early"
                if line.startswith("instance"):
                    addresses.append(line.split("grpc ")[1].strip())
            async with (
                grpc.aio.insecure_channel(addresses[0]) as first,
                grpc.aio.insecure_channel(addresses[1]) as second,
            ):
                answer = await a2a_pb2_grpc.A2AServiceStub(first).SendMessage(
                    send_request("hi"), metadata=V1
                )
                got = await a2a_pb2_grpc.A2AServiceStub(second).GetTask(
                    GetTaskRequest(id=answer.task.id), metadata=V1
                )
                assert got.status.state == TaskState.TASK_STATE_COMPLETED
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _tck(kind: str, *, immediately: bool = False, task: Task | None = None) -> SendMessageRequest:
    """A request as the conformance kit makes them: the scenario is the message id's prefix."""
    message = user_message(
        "Execution-mode probe",
        msg_id=f"{kind}-{uuid.uuid4().hex[:8]}",
        task_id=task.id if task else "",
        context_id=task.context_id if task else "",
    )
    return SendMessageRequest(
        message=message, configuration=SendMessageConfiguration(return_immediately=immediately)
    )


async def test_the_tck_agent_plays_the_kits_execution_mode_and_auth_required_scenarios() -> None:
    async with asyncio.timeout(30), harness_serve(TckAgent()) as h:
        # CORE-EXECUTION-MODE-001/002: blocking answers terminal, returnImmediately does not.
        blocking = (await h.stub.SendMessage(_tck("tck-delayed-complete"), metadata=V1)).task
        assert blocking.status.state == TaskState.TASK_STATE_COMPLETED
        assert blocking.status.message.parts[0].text == "Done after delay"
        early = await h.stub.SendMessage(
            _tck("tck-delayed-complete", immediately=True), metadata=V1
        )
        assert early.task.status.state in (
            TaskState.TASK_STATE_SUBMITTED,
            TaskState.TASK_STATE_WORKING,
        )
        # AUTH-INTASK-001/002: the blocking send answers at AUTH_REQUIRED, a task.
        waiting = (await h.stub.SendMessage(_tck("tck-auth-required"), metadata=V1)).task
        assert waiting.id and waiting.status.state == TaskState.TASK_STATE_AUTH_REQUIRED
        read = await h.stub.GetTask(GetTaskRequest(id=waiting.id), metadata=V1)
        assert read.status.state == TaskState.TASK_STATE_AUTH_REQUIRED
        # Input required, then a tck-complete-task follow-up ends it.
        asked = (await h.stub.SendMessage(_tck("tck-input-required"), metadata=V1)).task
        assert asked.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
        done = await h.stub.SendMessage(_tck("tck-complete-task", task=asked), metadata=V1)
        assert done.task.status.state == TaskState.TASK_STATE_COMPLETED
        await h.stub.CancelTask(CancelTaskRequest(id=waiting.id), metadata=V1)
        watch = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=early.task.id), metadata=V1)
        try:
            frames = [frame async for frame in watch]  # (to its end: nothing left running)
            assert frames[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED
        except grpc.aio.AioRpcError as err:  # it had ended already
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise

"""JSON logs: a line logged during a task's run carries its ids, the caller and the instance;
``serve --log-format json`` writes nothing but JSON lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import CancelTaskRequest

from a2a_grpc_server._internal.obs.logs import JsonFormatter
from a2a_grpc_server._internal.rpc.auth import TokenFile
from a2a_grpc_server.testing import running_server
from tests.support import ROOT
from tests.support.harness import send_request


class ChattyAgent(AgentExecutor):
    """Logs a line while it works, then completes."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        logging.getLogger("agent.chatty").info("working on %s", "it")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


class PoliteAgent(AgentExecutor):
    """Works until cancelled; its cancel() logs a line, then cancels."""

    def __init__(self) -> None:
        self.working = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).start_work()
        self.working.set()
        await asyncio.Event().wait()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        logging.getLogger("agent.polite").info("cancelling")
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """Everything logged at INFO and above, as the JSON formatter writes it."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("test-instance"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def test_a_line_logged_during_a_run_carries_the_task_and_the_caller(
    tmp_path: Path, json_lines: io.StringIO
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a-secret\n")
    async with asyncio.timeout(20), running_server(ChattyAgent(), auth=TokenFile(tokens)) as h:
        metadata = (*h.metadata, ("authorization", "Bearer a-secret"))
        task = (await h.stub.SendMessage(send_request("hi"), metadata=metadata)).task
    lines = [json.loads(line) for line in json_lines.getvalue().splitlines()]
    [said] = [line for line in lines if line["logger"] == "agent.chatty"]
    assert said["message"] == "working on it"
    assert (said["task_id"], said["context_id"]) == (task.id, task.context_id)
    assert said["principal"] == "alice"
    assert said["instance"] == "test-instance"
    assert said["level"] == "INFO"
    assert said["time"].endswith("+00:00")
    ready = [line for line in lines if "ready" in line["message"]]
    assert ready and "task_id" not in ready[0], "outside a run, no task ids"


async def test_the_executors_cancel_logs_as_its_task_not_as_the_cancel_call(
    json_lines: io.StringIO,
) -> None:
    agent = PoliteAgent()
    async with asyncio.timeout(20), running_server(agent) as h:
        request = send_request("go", immediately=True)
        task = (await h.stub.SendMessage(request, metadata=h.metadata)).task
        await agent.working.wait()
        await h.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=h.metadata)
    lines = [json.loads(line) for line in json_lines.getvalue().splitlines()]
    [said] = [line for line in lines if line["logger"] == "agent.polite"]
    assert (said["task_id"], said["context_id"]) == (task.id, task.context_id)


async def test_serve_with_json_logs_writes_only_json_lines() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "a2a_grpc_server.cli",
        "serve",
        "--port",
        "0",
        "--http-port",
        "0",
        "--log-format",
        "json",
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(30):
            lines: list[dict[str, str]] = []
            while not any("ready" in line.get("message", "") for line in lines):
                raw = await proc.stderr.readline()
                assert raw, f"serve exited early: {lines}"
                lines.append(json.loads(raw))
            proc.send_signal(signal.SIGTERM)
            rest = (await proc.stderr.read()).decode().splitlines()
            lines += [json.loads(line) for line in rest if line.strip()]
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    assert all(line["instance"] for line in lines)
    assert any(line["message"] == "stopped" for line in lines)

"""The "raw" server of the comparison: a bare grpc.aio servicer of the same service.

It does what the ``Workload`` agent's scenarios need and nothing else: canned
responses of the same sizes, a list of queues per task for subscribers, no
store, no validation, no executor. It is the limit of grpc.aio on this
machine, the figure the others are measured against.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    Artifact,
    CancelTaskRequest,
    Part,
    SendMessageRequest,
    SendMessageResponse,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)

from .agents import PAYLOAD

Context = grpc.aio.ServicerContext[Any, Any]
S = TaskState


def _status(task: Task, state: TaskState) -> StreamResponse:
    return StreamResponse(
        status_update=TaskStatusUpdateEvent(
            task_id=task.id, context_id=task.context_id, status=TaskStatus(state=state)
        )
    )


def _artifact(task: Task, artifact_id: str, text: str = PAYLOAD) -> StreamResponse:
    return StreamResponse(
        artifact_update=TaskArtifactUpdateEvent(
            task_id=task.id,
            context_id=task.context_id,
            artifact=Artifact(artifact_id=artifact_id, parts=[Part(text=text)]),
        )
    )


class RawServicer(a2a_pb2_grpc.A2AServiceServicer):
    """Canned answers; per-task subscriber queues for fan-out and cancel."""

    def __init__(self) -> None:
        self._subs: dict[str, list[asyncio.Queue[StreamResponse | None]]] = {}
        self._tasks: dict[str, Task] = {}
        self._producers: set[asyncio.Task[None]] = set()

    def _new_task(self, request: SendMessageRequest, state: TaskState) -> Task:
        task = Task(id=str(uuid.uuid4()), context_id=str(uuid.uuid4()))
        task.status.state = state
        task.history.append(request.message)
        return task

    async def SendMessage(
        self, request: SendMessageRequest, context: Context
    ) -> SendMessageResponse:
        """Unary: a completed task with one artifact; ``park``/``fanout``: a working task."""
        text = request.message.parts[0].text if request.message.parts else ""
        if text.startswith(("park", "fanout")):
            task = self._new_task(request, S.TASK_STATE_WORKING)
            self._tasks[task.id] = task
            self._subs[task.id] = []
            if text.startswith("fanout"):
                _, count, delay = text.split()
                producer = asyncio.create_task(self._fan_out(task, int(count), int(delay)))
                self._producers.add(producer)
                producer.add_done_callback(self._producers.discard)
            return SendMessageResponse(task=task)
        task = self._new_task(request, S.TASK_STATE_COMPLETED)
        task.artifacts.append(Artifact(artifact_id="a0", parts=[Part(text=PAYLOAD)]))
        return SendMessageResponse(task=task)

    async def SendStreamingMessage(self, request: SendMessageRequest, context: Context) -> None:
        """13 frames: the task, WORKING, 10 artifact updates, COMPLETED."""
        task = self._new_task(request, S.TASK_STATE_SUBMITTED)
        await context.write(StreamResponse(task=task))
        await context.write(_status(task, S.TASK_STATE_WORKING))
        for i in range(10):
            await context.write(_artifact(task, f"a{i}"))
        await context.write(_status(task, S.TASK_STATE_COMPLETED))

    async def SubscribeToTask(self, request: SubscribeToTaskRequest, context: Context) -> None:
        """The task, then whatever its producer or a cancel queues."""
        queue: asyncio.Queue[StreamResponse | None] = asyncio.Queue()
        self._subs[request.id].append(queue)
        try:
            await context.write(StreamResponse(task=self._tasks[request.id]))
            while (frame := await queue.get()) is not None:
                await context.write(frame)
        finally:
            subs = self._subs.get(request.id)
            if subs is not None and queue in subs:
                subs.remove(queue)

    async def CancelTask(self, request: CancelTaskRequest, context: Context) -> Task:
        """Queue CANCELED to every subscriber and forget the task."""
        task = self._tasks.pop(request.id)
        task.status.state = S.TASK_STATE_CANCELED
        self._end(task, _status(task, S.TASK_STATE_CANCELED))
        return task

    async def _fan_out(self, task: Task, count: int, delay_ms: int) -> None:
        await asyncio.sleep(delay_ms / 1000)
        for i in range(count):
            frame = _artifact(task, f"f{i}", str(time.time_ns()))
            for queue in self._subs[task.id]:
                queue.put_nowait(frame)
            await asyncio.sleep(0)
        self._tasks.pop(task.id, None)
        self._end(task, _status(task, S.TASK_STATE_COMPLETED))

    def _end(self, task: Task, final: StreamResponse) -> None:
        for queue in self._subs.pop(task.id, []):
            queue.put_nowait(final)
            queue.put_nowait(None)

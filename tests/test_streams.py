"""Streams that end on the subscriber's side: too slow, or gone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from a2a.types.a2a_pb2 import StreamResponse, SubscribeToTaskRequest, TaskState

from a2a_grpc_server import ServerConfig

from .agents import FloodAgent, GatedAgent
from .harness import V1, rich_status, send_request, serve

S = TaskState


async def read_until_end(call: Any, into: list[object]) -> None:
    while (frame := await call.read()) is not grpc.aio.EOF:
        into.append(frame)


class Readers:
    """Reads several streams at once; hands the agent a credit per frame all have read."""

    def __init__(self, agent: FloodAgent, streams: int) -> None:
        self._agent = agent
        self._counts = [0] * streams
        self._credited = 0

    async def read(self, index: int, stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
        frames = []
        async for frame in stream:
            frames.append(frame)
            self._counts[index] += 1
            while min(self._counts) > self._credited:
                self._credited += 1
                self._agent.credits.release()
        return frames


async def test_slow_subscriber_alone_is_evicted_and_siblings_keep_every_frame() -> None:
    agent = FloodAgent(count=600, size=32 * 1024, window=16)
    config = ServerConfig(subscriber_buffer=64)
    async with asyncio.timeout(30), serve(agent, config) as h:
        sender = h.client.send_message_streaming(send_request("flood"))
        task_id = (await anext(sender)).task.id
        assert (await anext(sender)).status_update.status.state == S.TASK_STATE_WORKING
        slow = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        assert (await slow.read()).task.id == task_id  # attached; now it stops reading
        sibling = h.client.subscribe(SubscribeToTaskRequest(id=task_id))
        assert (await anext(sibling)).task.id == task_id
        agent.release.set()
        readers = Readers(agent, 2)
        sender_frames, sibling_frames = await asyncio.gather(
            readers.read(0, sender), readers.read(1, sibling)
        )
        for frames in (sender_frames, sibling_frames):
            assert len(frames) == 601
            assert [f.artifact_update.artifact.artifact_id for f in frames[:-1]] == [
                f"chunk-{i}" for i in range(600)
            ]
            assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        got: list[object] = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await read_until_end(slow, got)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status, info = rich_status(caught.value)
        assert info.reason == "SLOW_SUBSCRIBER"
        assert "SubscribeToTask" in status.message
        assert len(got) < 600
        assert h.service.metrics.evictions == 1
        stored = await h.service.store.get(task_id)  # 19 MB of artifacts: past a client's limit
        assert stored is not None and stored.task.status.state == S.TASK_STATE_COMPLETED
        await h.settle()


async def test_client_disconnect_ends_only_its_stream_and_the_task_runs_on() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        call = h.stub.SendStreamingMessage(send_request("go"), metadata=V1)
        task_id = (await call.read()).task.id
        await agent.working.wait()
        watcher = h.client.subscribe(SubscribeToTaskRequest(id=task_id))
        assert (await anext(watcher)).task.id == task_id
        call.cancel()
        # Only the watcher's stream remains on the server.
        async with asyncio.timeout(2):
            await h.service.servicer.wait_streams_closed(at_most=1)
        assert h.service.servicer.open_streams == 1
        agent.release.set()
        frames = [f async for f in watcher]
        assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        assert not agent.execute_cancelled.is_set()
        await h.settle()
        assert h.service.metrics.streams_ended["disconnected"] == 1

"""Streams as cursors into the task's log: bursts, readers that stop, readers that leave."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.journal import Change
from a2a_grpc_server._internal.journal.memory import MemoryJournal
from tests.support.agents import BurstAgent, ChunkAgent, FloodAgent, GatedAgent
from tests.support.harness import (
    V1,
    assert_each_rebuilds,
    attach_as_it_flows,
    burst_to_readers,
    read_all,
    rich_status,
    send_request,
    serve,
)

S = TaskState


def chunk_ids(frames: list[StreamResponse]) -> list[str]:
    return [
        f.artifact_update.artifact.artifact_id
        for f in frames
        if f.WhichOneof("payload") == "artifact_update"
    ]


@pytest.mark.timeout(120)
async def test_a_burst_reaches_every_subscriber_whole_in_order_with_the_outcome() -> None:
    agent = BurstAgent(count=10_000)
    async with asyncio.timeout(110), serve(agent) as h:
        from_sender, readers = await burst_to_readers(h.stub, h.address, agent, 100)
        expected = [f"chunk-{i}" for i in range(10_000)]
        assert chunk_ids(from_sender) == expected
        assert from_sender[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        for stream in readers:
            assert stream["ids"] == expected
            assert stream["last_state"] == S.TASK_STATE_COMPLETED
            assert stream["same_as_first"]
        assert h.service.metrics.frames_dropped == 0
        assert h.service.metrics.streams_ended["finished"] == 101
        await h.settle(within=2)


async def test_a_subscriber_that_stops_reading_slows_nothing_and_later_gets_every_frame() -> None:
    agent = BurstAgent(count=2000, size=100)
    async with asyncio.timeout(30), serve(agent) as h:
        sender = h.client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        stalled = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        assert (await stalled.read()).task.id == task_id  # attached; now it stops reading
        sibling = h.client.subscribe(SubscribeToTaskRequest(id=task_id))
        assert (await anext(sibling)).task.id == task_id
        agent.release.set()
        sender_frames = [f async for f in sender]
        sibling_frames = [f async for f in sibling]
        expected = [f"chunk-{i}" for i in range(2000)]
        for frames in (sender_frames, sibling_frames):
            assert chunk_ids(frames) == expected
            assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        late: list[StreamResponse] = []
        await read_all(stalled, late)  # it reads again: nothing was lost meanwhile
        assert chunk_ids(late) == expected
        assert late[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        await h.settle()


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


async def test_a_reader_behind_the_logs_budget_ends_out_of_range_and_memory_stays_bounded() -> None:
    agent = FloodAgent(count=600, size=32 * 1024, window=16)  # 19 MB: past any transport buffer
    config = ServerConfig(cancel_timeout=1.0, log_max_frames=64, max_task_bytes=32 << 20)
    async with asyncio.timeout(30), serve(agent, config) as h:
        sender = h.client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        assert (await anext(sender)).status_update.status.state == S.TASK_STATE_WORKING
        stalled = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        assert (await stalled.read()).task.id == task_id  # attached; now it stops reading
        sibling = h.client.subscribe(SubscribeToTaskRequest(id=task_id))
        assert (await anext(sibling)).task.id == task_id
        agent.release.set()
        readers = Readers(agent, 2)
        sender_frames, sibling_frames = await asyncio.gather(
            readers.read(0, sender), readers.read(1, sibling)
        )
        expected = [f"chunk-{i}" for i in range(600)]
        for frames in (sender_frames, sibling_frames):
            assert chunk_ids(frames) == expected, "readers that keep up lose nothing"
            assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        pool = h.service.engine.tasks.pool
        assert pool.peak <= 64 * (32 * 1024 + 200), "the log kept at most its budget"
        got: list[StreamResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await read_all(stalled, got)  # it reads again: every frame kept, then the gap
        assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
        status, info = rich_status(caught.value)
        assert info.reason == "FRAME_NOT_KEPT"
        assert "resubscribe" in status.message
        ids = chunk_ids(got)
        assert ids == expected[: len(ids)], "what it got is every frame up to the gap"
        assert int(info.metadata["oldestKeptSeq"]) > int(info.metadata["wantedSeq"])
        assert h.service.metrics.streams_ended["out_of_range"] == 1
        assert h.service.metrics.frames_dropped > 0
        await h.settle()


class SlowJournal(MemoryJournal):
    """Every write takes a moment, as a remote journal's does (an injected delay)."""

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        await asyncio.sleep(0.001)  # sync-ok: injected journal latency, not synchronisation
        return await super().update(task, expected_version, changes)


async def test_subscribers_attaching_during_slow_journal_writes_rebuild_the_recorded_task() -> None:
    agent = ChunkAgent(count=300)
    async with asyncio.timeout(30), serve(agent, journal=SlowJournal()) as h:
        points = sorted(random.Random(9).sample(range(1, 300), 30))
        _, streams, task_id = await attach_as_it_flows(h.stub, agent, points)
        stored = await h.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert len(streams) == 30
        assert_each_rebuilds(streams, stored)
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

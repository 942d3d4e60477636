"""Sizes are consistent end to end: what the server accepts it can store, send and replay."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    ListTasksRequest,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from tests.support import natsserver
from tests.support.agents import InputAgent, PayloadAgent
from tests.support.clusterharness import instances
from tests.support.harness import (
    V1,
    last_state,
    read_all,
    rich_status,
    send_request,
    serve,
    user_message,
)

S = TaskState
KIB = 1024


@pytest.fixture
def small_nats() -> Iterator[natsserver.Cluster]:
    with natsserver.running(1, max_payload=256 * KIB) as cluster:
        yield cluster


async def test_an_event_that_would_pass_max_task_bytes_ends_the_task_failed_on_every_stream() -> (
    None
):
    config = ServerConfig(cancel_timeout=1.0, max_task_bytes=64 * KIB, max_message_bytes=16 * KIB)
    async with asyncio.timeout(10), serve(PayloadAgent(), config) as h:
        sender = h.stub.SendStreamingMessage(send_request("add 20000 5"), metadata=V1)
        frames: list[StreamResponse] = []
        await read_all(sender, frames)
        assert last_state(frames) == S.TASK_STATE_FAILED
        text = frames[-1].status_update.status.message.parts[0].text
        assert "max_task_bytes" in text
        # The events that fitted were kept; the one that did not was not.
        assert [f.artifact_update.artifact.artifact_id for f in frames[2:-1]] == [
            "part-0",
            "part-1",
            "part-2",
        ]
        task = await h.stub.GetTask(GetTaskRequest(id=frames[0].task.id), metadata=V1)
        assert task.status.state == S.TASK_STATE_FAILED
        assert len(task.artifacts) == 3
        assert task.ByteSize() <= 64 * KIB
        done = await h.stub.SendMessage(send_request("add 100 2"), metadata=V1)
        assert done.task.status.state == S.TASK_STATE_COMPLETED


async def test_a_follow_up_that_would_pass_max_task_bytes_is_refused_and_the_task_waits_on() -> (
    None
):
    config = ServerConfig(cancel_timeout=1.0, max_task_bytes=64 * KIB, max_message_bytes=32 * KIB)
    async with asyncio.timeout(10), serve(InputAgent(pad=40_000), config) as h:
        first = await h.stub.SendMessage(send_request("x" * 10_000), metadata=V1)
        task_id = first.task.id
        assert first.task.status.state == S.TASK_STATE_INPUT_REQUIRED
        follow = SendMessageRequest(message=user_message("y" * 30_000, task_id=task_id))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.SendMessage(follow, metadata=V1)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_task_bytes" in (caught.value.details() or "")
        assert rich_status(caught.value)[1].reason == "INVALID_PARAMS"
        task = await h.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        small = SendMessageRequest(message=user_message("ok", task_id=task_id))
        done = await h.stub.SendMessage(small, metadata=V1)
        assert done.task.status.state == S.TASK_STATE_COMPLETED


def test_a_message_limit_past_half_the_task_limit_is_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="half of max_task_bytes"):
        ServerConfig(max_task_bytes=1 << 20, max_message_bytes=1 << 20)


async def test_in_cluster_mode_the_limits_follow_nats_max_payload(
    small_nats: natsserver.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="a2a_grpc_server"):
        async with asyncio.timeout(30), instances(PayloadAgent(), small_nats.urls) as (a, b):
            config = a.service.config
            assert config.max_task_bytes == 192 * KIB, "max_payload less room for headers"
            assert config.max_message_bytes == 96 * KIB
            said = [r for r in caplog.records if "max_payload" in r.getMessage()]
            assert said and all(r.levelno == logging.INFO for r in said), "default sizes: INFO"
            # Past the lowered request limit: refused before any work, on either instance.
            big = send_request("add 10 1")
            big.message.parts[0].text += " " + "z" * (100 * KIB)
            for instance in (a, b):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await instance.stub.SendMessage(big, metadata=V1)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # An agent that outgrows the record: FAILED, stored, seen the same everywhere.
            sender = a.stub.SendStreamingMessage(send_request("add 60000 5"), metadata=V1)
            frames: list[StreamResponse] = []
            await read_all(sender, frames)
            assert last_state(frames) == S.TASK_STATE_FAILED
            task_id = frames[0].task.id
            for instance in (a, b):
                task = await instance.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
                assert task.status.state == S.TASK_STATE_FAILED
                assert len(task.artifacts) == 3
            # A task right under the limit is stored, listed and replayed whole.
            sender = a.stub.SendStreamingMessage(send_request("add 60000 3"), metadata=V1)
            frames = []
            await read_all(sender, frames)
            assert last_state(frames) == S.TASK_STATE_COMPLETED
            task = await b.stub.GetTask(GetTaskRequest(id=frames[0].task.id), metadata=V1)
            assert task.status.state == S.TASK_STATE_COMPLETED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await read_all(
                    b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1), []
                )
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_list_tasks_pages_are_cut_by_bytes_and_the_token_continues_after_the_cut() -> None:
    config = ServerConfig(cancel_timeout=1.0, max_task_bytes=64 * KIB, max_message_bytes=32 * KIB)
    async with asyncio.timeout(10), serve(PayloadAgent(), config) as h:
        made = []
        for i in range(5):
            request = send_request(f"add 10 1 {i}" + " " * 30_000)
            made.append((await h.stub.SendMessage(request, metadata=V1)).task.id)
        pages, token = [], ""
        while True:
            page = await h.stub.ListTasks(ListTasksRequest(page_token=token), metadata=V1)
            assert page.ByteSize() <= 64 * KIB + 1024
            pages.append([t.id for t in page.tasks])
            token = page.next_page_token
            if not token:
                break
        assert [len(p) for p in pages] == [2, 2, 1], "cut by bytes, not by page_size (50)"
        assert [t for p in pages for t in p] == made[::-1], "each task once, newest first"


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


async def test_a_task_edited_in_place_costs_its_size_not_every_byte_it_was_ever_sent() -> None:
    # 2,000 replacements of one 64 KiB artifact: 131 MB emitted, a task of 64 KiB.
    async with asyncio.timeout(60), serve(PayloadAgent()) as h:
        await h.stub.SendMessage(send_request("replace 100 10"), metadata=V1)  # warm-up
        gc.collect()
        before = peak = rss_mb()

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss_mb())
                await asyncio.sleep(0.005)  # sync-ok: a sampling period, not a wait for an event

        sampler = asyncio.ensure_future(sample())
        try:
            done = await h.stub.SendMessage(send_request("replace 65536 2000"), metadata=V1)
        finally:
            sampler.cancel()
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        assert done.task.artifacts[0].parts[0].text.startswith("00001999")
        # Before: the task's arena kept every replaced artifact and the queue held up to
        # 1,024 events of any size (+190 MB at the peak here).
        assert peak - before < 80, f"peak {peak - before:.0f} MB above the start"


async def test_ended_tasks_kept_in_memory_leave_the_collector_almost_nothing_to_scan() -> None:
    # Every full collection pauses the loop for as long as it takes to scan what is
    # tracked; 10,000 kept ended tasks (max_final_tasks) once took 30-50 ms (10 objects
    # each: index lists, key records, and a cycle through each ended task itself).
    async with asyncio.timeout(60), serve(PayloadAgent()) as h:

        async def send(count: int) -> None:
            for _ in range(count):
                done = await h.stub.SendMessage(send_request("add 10 1"), metadata=V1)
                assert done.task.status.state == S.TASK_STATE_COMPLETED

        await send(20)  # (grpc's and the server's first-call objects)
        gc.collect()
        before = len(gc.get_objects())
        await send(300)
        gc.collect()
        per_task = (len(gc.get_objects()) - before) / 300
        assert per_task < 2, f"{per_task:.1f} tracked objects kept per ended task"

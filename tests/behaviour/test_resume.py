"""The resume extension: numbered frames, and SubscribeToTask from a cursor (one instance)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)
from google.protobuf import json_format

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.rpc.resume import FALLBACK_KEY, RESUME_AFTER_KEY, SNAPSHOT, URI
from tests.support.agents import FloodAgent, InputAgent, StepAgent
from tests.support.harness import (
    RESUME,
    V1,
    Harness,
    read_all,
    resume_call,
    rich_status,
    send_request,
    seq_of,
    serve,
)

S = TaskState


async def collected(call: Any) -> list[StreamResponse]:
    frames: list[StreamResponse] = []
    await read_all(call, frames)
    return frames


def fallback_call(stub: Any, task_id: str, after: int | None, *, size: int = 0) -> Any:
    """SubscribeToTask with the snapshot fallback (resumed after ``after`` unless None)."""
    cursor = () if after is None else ((RESUME_AFTER_KEY, str(after)),)
    metadata = (*RESUME, (FALLBACK_KEY, SNAPSHOT), *cursor)
    return stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=metadata)


def skipped_of(frame: StreamResponse) -> tuple[int, int]:
    """The frames a snapshot stands in for: the fallback's marker, as (from, to)."""
    assert frame.WhichOneof("payload") == "task", "the fallback answers with the task"
    marker = json_format.MessageToDict(frame.task.metadata)[URI]
    assert set(marker) == {"seq", "skipped"}
    skipped = marker["skipped"]
    assert skipped["to"] == marker["seq"], "it skips up to the change it includes"
    return int(skipped["from"]), int(skipped["to"])


async def started(h: Harness, agent: StepAgent) -> tuple[str, Any]:
    """A streaming send with the extension active; returns once WORKING arrived."""
    sender = h.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
    first = await sender.read()
    assert seq_of(first) == 1
    working = await sender.read()
    assert (working.status_update.status.state, seq_of(working)) == (S.TASK_STATE_WORKING, 2)
    return first.task.id, sender


async def test_the_card_declares_the_extension_and_a_call_that_activates_it_hears_so() -> None:
    async with asyncio.timeout(10), serve(StepAgent()) as h:
        extensions = [e for e in h.service.card.capabilities.extensions if e.uri == URI]
        assert len(extensions) == 1
        assert "resume" in URI and not extensions[0].required
        params = json_format.MessageToDict(extensions[0].params)
        assert (params["fallbackMetadataKey"], params["fallbacks"]) == (FALLBACK_KEY, [SNAPSHOT])
        call = h.stub.GetTask(GetTaskRequest(id="nope"), metadata=RESUME)
        with pytest.raises(grpc.aio.AioRpcError):
            await call
        assert (await call.initial_metadata())["a2a-extensions"] == URI
        await h.settle()


async def test_every_frame_carries_its_seq_and_a_snapshot_the_last_it_includes() -> None:
    agent = StepAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        task_id, sender = await started(h, agent)
        agent.step(2)
        assert [seq_of(await sender.read()) for _ in range(2)] == [3, 4]
        watcher = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=RESUME)
        snapshot = await watcher.read()
        assert (len(snapshot.task.artifacts), seq_of(snapshot)) == (2, 4)
        plain = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        assert URI not in (await plain.read()).task.metadata
        agent.step()
        agent.finish()
        rest, watched, plain_rest = await asyncio.gather(
            collected(sender), collected(watcher), collected(plain)
        )
        assert [seq_of(f) for f in rest] == [5, 6]
        assert [seq_of(f) for f in watched] == [5, 6]
        for frame in plain_rest:
            payload = getattr(frame, frame.WhichOneof("payload") or "")
            assert URI not in payload.metadata, "plain clients get frames as they were"
        got = await h.stub.GetTask(GetTaskRequest(id=task_id), metadata=RESUME)
        assert seq_of(StreamResponse(task=got)) == 6
        await h.settle()


async def test_a_cut_stream_resumes_with_exactly_the_frames_after_its_cursor() -> None:
    agent = StepAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        task_id, sender = await started(h, agent)
        watcher = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=RESUME)
        assert seq_of(await watcher.read()) == 2
        agent.step(3)
        seen = [await watcher.read() for _ in range(2)]
        assert [seq_of(f) for f in seen] == [3, 4]
        watcher.cancel()  # the connection is cut here; frames go on without it
        agent.step(2)
        agent.finish()
        everything = await collected(sender)
        resumed = await collected(resume_call(h.stub, task_id, 4))
        assert resumed == [f for f in everything if seq_of(f) > 4], "exactly what followed 4"
        assert resumed[0].WhichOneof("payload") == "artifact_update", "no snapshot first"
        assert resumed[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        await h.settle()


async def test_an_ended_task_resumes_within_the_window_and_its_final_cursor_ends_at_once() -> None:
    agent = StepAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        task_id, sender = await started(h, agent)
        agent.step(2)
        agent.finish()
        frames = await collected(sender)
        final = seq_of(frames[-1])
        assert final == 5
        after_two = await collected(resume_call(h.stub, task_id, 2))
        assert [seq_of(f) for f in after_two] == [3, 4, 5]
        assert after_two == frames
        assert await collected(resume_call(h.stub, task_id, final)) == []
        assert h.service.engine.tasks.pool.retained_count == 1
        await h.settle()


async def test_cursors_too_old_or_past_the_end_are_out_of_range_with_what_is_kept() -> None:
    agent = StepAgent()
    config = ServerConfig(cancel_timeout=1.0, log_max_frames=4)
    async with asyncio.timeout(10), serve(agent, config) as h:
        task_id, sender = await started(h, agent)
        for seq in range(3, 9):  # one at a time: the sender keeps up with a 4-frame log
            agent.step()
            assert seq_of(await sender.read()) == seq
        with pytest.raises(grpc.aio.AioRpcError) as old:
            await collected(resume_call(h.stub, task_id, 2))
        assert old.value.code() == grpc.StatusCode.OUT_OF_RANGE
        info = rich_status(old.value)[1]
        assert info.reason == "FRAME_NOT_KEPT"
        assert (info.metadata["wantedSeq"], info.metadata["oldestKeptSeq"]) == ("3", "5")
        assert info.metadata["lastSeq"] == "8"
        with pytest.raises(grpc.aio.AioRpcError) as ahead:
            await collected(resume_call(h.stub, task_id, 9))
        assert ahead.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "does not exist" in rich_status(ahead.value)[0].message
        agent.finish()
        await collected(sender)
        await h.settle()


async def test_a_resume_or_fallback_that_cannot_be_served_is_refused_naming_the_fix() -> None:
    agent = StepAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        task_id, sender = await started(h, agent)
        for metadata, says in [
            ((*V1, (RESUME_AFTER_KEY, "1")), "a2a-extensions"),
            ((*RESUME, (RESUME_AFTER_KEY, "-1")), "integer"),
            ((*RESUME, (RESUME_AFTER_KEY, "x" * 5000)), "integer"),
            ((*V1, (FALLBACK_KEY, SNAPSHOT)), "a2a-extensions"),
            ((*RESUME, (FALLBACK_KEY, "replay")), "snapshot"),
            ((*RESUME, (FALLBACK_KEY, SNAPSHOT), (RESUME_AFTER_KEY, "-1")), "integer"),
            ((*RESUME, (FALLBACK_KEY, SNAPSHOT), (RESUME_AFTER_KEY, "2x")), "integer"),
        ]:
            call = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collected(call)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            status, info = rich_status(refused.value)
            assert says in status.message and len(status.message) < 300
            assert info.reason == "INVALID_PARAMS"
        agent.finish()
        await collected(sender)
        await h.settle()


async def test_a_follow_up_message_takes_a_number_without_a_frame_and_resume_spans_it() -> None:
    async with asyncio.timeout(10), serve(InputAgent()) as h:
        asked = await h.stub.SendMessage(send_request("hi"), metadata=RESUME)
        task = asked.task
        at = seq_of(StreamResponse(task=task))
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED and at == 3
        done = await h.stub.SendMessage(send_request("Ada", task_id=task.id), metadata=RESUME)
        assert seq_of(StreamResponse(task=done.task)) == 6, "message 4, WORKING 5, COMPLETED 6"
        resumed = await collected(resume_call(h.stub, task.id, at))
        assert [seq_of(f) for f in resumed] == [5, 6]
        assert resumed[-1].status_update.status.message.parts[0].text == "hello Ada"
        await h.settle()


async def test_an_ended_task_no_resuming_client_followed_keeps_nothing() -> None:
    agent = StepAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        sender = h.client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        agent.step(3)
        agent.finish()
        assert len([f async for f in sender]) == 5
        await h.settle()
        assert h.service.engine.tasks.pool.retained_count == 0
        assert h.service.engine.tasks.pool.used == 0
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await collected(resume_call(h.stub, task_id, 1))
        assert gone.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert await collected(resume_call(h.stub, task_id, 6)) == [], (
            "its final seq still ends at once"
        )
        await h.settle()


async def test_a_cursor_older_than_the_log_keeps_gets_the_task_marked_then_every_later_frame() -> (
    None
):
    agent = StepAgent()
    config = ServerConfig(cancel_timeout=1.0, log_max_frames=4)
    async with asyncio.timeout(10), serve(agent, config) as h:
        task_id, sender = await started(h, agent)
        for seq in range(3, 9):  # one at a time: the sender keeps up with a 4-frame log
            agent.step()
            assert seq_of(await sender.read()) == seq
        resumed = fallback_call(h.stub, task_id, 2)
        snapshot = await resumed.read()
        assert (seq_of(snapshot), skipped_of(snapshot)) == (8, (3, 8))
        assert snapshot.task.status.state == S.TASK_STATE_WORKING
        assert [a.artifact_id for a in snapshot.task.artifacts] == [f"step-{i}" for i in range(6)]
        kept = fallback_call(h.stub, task_id, 5)  # still kept: replayed, no snapshot
        assert [seq_of(await kept.read()) for _ in range(3)] == [6, 7, 8]
        agent.step(2)
        agent.finish()
        rest, resumed_rest, kept_rest = await asyncio.gather(
            collected(sender), collected(resumed), collected(kept)
        )
        assert [seq_of(f) for f in rest] == [9, 10, 11]
        assert rest[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        assert resumed_rest == rest, "after the snapshot: exactly the frames after its seq"
        assert kept_rest == rest
        assert h.service.metrics.streams_ended["out_of_range"] == 0
        await h.settle()


async def test_an_ended_task_whose_frames_are_gone_answers_with_its_outcome_marked_then_ends() -> (
    None
):
    agent = StepAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        sender = h.client.send_message_streaming(
            send_request("go")
        )  # nobody resumable: kept nothing
        task_id = (await anext(sender)).task.id
        agent.step(3)
        agent.finish()
        assert len([f async for f in sender]) == 5
        await h.settle()
        assert h.service.engine.tasks.pool.retained_count == 0
        (outcome,) = await collected(fallback_call(h.stub, task_id, 1))
        assert (seq_of(outcome), skipped_of(outcome)) == (6, (2, 6))
        assert outcome.task.status.state == S.TASK_STATE_COMPLETED
        assert len(outcome.task.artifacts) == 3
        assert await collected(fallback_call(h.stub, task_id, 6)) == [], "final cursor: at once"
        with pytest.raises(grpc.aio.AioRpcError) as ahead:
            await collected(fallback_call(h.stub, task_id, 7))
        assert ahead.value.code() == grpc.StatusCode.OUT_OF_RANGE, "past the end: no snapshot"
        assert "does not exist" in rich_status(ahead.value)[0].message
        await h.settle()


async def test_a_stream_with_the_fallback_that_falls_behind_gets_the_task_instead_of_a_gap() -> (
    None
):
    agent = FloodAgent(count=600, size=32 * 1024, window=16)  # 19 MB: past any transport buffer
    config = ServerConfig(cancel_timeout=1.0, log_max_frames=64, max_task_bytes=32 << 20)
    big = [("grpc.max_receive_message_length", 64 << 20)]  # the snapshot is the whole task
    async with (
        asyncio.timeout(30),
        serve(agent, config) as h,
        grpc.aio.insecure_channel(h.address, options=big) as channel,
    ):
        sender = h.client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        assert (await anext(sender)).status_update.status.state == S.TASK_STATE_WORKING
        stalled = fallback_call(a2a_pb2_grpc.A2AServiceStub(channel), task_id, None)
        assert (await stalled.read()).task.id == task_id  # attached; now it stops reading
        agent.release.set()
        frames = []
        async for frame in sender:
            frames.append(frame)
            agent.credits.release()
        final = frames[-1]
        assert final.status_update.status.state == S.TASK_STATE_COMPLETED
        got = await collected(stalled)  # it reads again: the frames kept, then the task
        *before, outcome = got
        assert before, "it read what was still kept first"
        ids = [f.artifact_update.artifact.artifact_id for f in before]
        assert ids == [f"chunk-{i}" for i in range(len(ids))], "in order, up to the gap"
        gap_from = seq_of(before[-1]) + 1
        assert skipped_of(outcome) == (gap_from, 603), "the task, 3 + 600 changes"
        assert outcome.task.status.state == S.TASK_STATE_COMPLETED
        assert len(outcome.task.artifacts) == 600
        assert h.service.metrics.streams_ended["out_of_range"] == 0
        assert h.service.metrics.frames_dropped > 0
        await h.settle()

"""Every row of the outcome table: what each of 1 sender + 3 subscribers sees last."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import pytest
from a2a.server.agent_execution import AgentExecutor
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.journal import Change, StoreUnavailableError, VersionConflictError
from a2a_grpc_server._internal.journal.memory import MemoryJournal
from tests.support.agents import (
    EndingAgent,
    GatedAgent,
    LeakyAgent,
    MisbehavingAgent,
    StepAgent,
    StubbornAgent,
)
from tests.support.harness import V1, Harness, send_request, serve

S = TaskState
Trigger = Callable[[Harness, str], Awaitable[None]]


async def collect(stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
    return [frame async for frame in stream]


async def fan_out(
    h: Harness, working: asyncio.Event, trigger: Trigger
) -> tuple[list[StreamResponse], list[list[StreamResponse]], str]:
    """Start a streaming send, attach 3 subscribers once WORKING, fire ``trigger``,
    and return every stream's frames after the point all four were attached."""
    sender = h.client.send_message_streaming(send_request("go"))
    first = await anext(sender)
    assert first.WhichOneof("payload") == "task"
    task_id = first.task.id
    working_frame = await anext(sender)
    assert working_frame.status_update.status.state == S.TASK_STATE_WORKING
    await working.wait()
    subs = [h.client.subscribe(SubscribeToTaskRequest(id=task_id)) for _ in range(3)]
    snapshots = [await anext(s) for s in subs]
    for snap in snapshots:
        assert snap.WhichOneof("payload") == "task", "SubscribeToTask starts with the Task snapshot"
        assert snap.task.id == task_id
        assert snap.task.status.state == S.TASK_STATE_WORKING
    rest = asyncio.gather(collect(sender), *(collect(s) for s in subs))
    await trigger(h, task_id)
    sender_tail, *sub_tails = await rest
    return sender_tail, sub_tails, task_id


def final_state(frames: list[StreamResponse]) -> TaskState:
    assert frames, "stream ended without any frame"
    last = frames[-1]
    assert last.WhichOneof("payload") == "status_update", f"last frame is {last}"
    return last.status_update.status.state


def final_text(frames: list[StreamResponse]) -> str:
    return " ".join(p.text for p in frames[-1].status_update.status.message.parts)


async def release(agent: GatedAgent | EndingAgent | MisbehavingAgent) -> None:
    agent.release.set()


def cancel_trigger(expect_canceled: bool = True) -> Trigger:
    async def trigger(h: Harness, task_id: str) -> None:
        task = await h.client.cancel_task(CancelTaskRequest(id=task_id))
        if expect_canceled:
            assert task.status.state == S.TASK_STATE_CANCELED

    return trigger


async def run_row(
    agent: AgentExecutor,
    working: asyncio.Event,
    trigger: Trigger,
    config: ServerConfig | None = None,
) -> tuple[list[list[StreamResponse]], TaskState, str]:
    async with asyncio.timeout(10), serve(agent, config) as h:
        sender, subs, task_id = await fan_out(h, working, trigger)
        streams = [sender, *subs]
        first = streams[0]
        for other in streams[1:]:
            assert other == first, "every stream sees the same frames in the same order"
        stored = await h.client.get_task(GetTaskRequest(id=task_id))
        await h.settle()
        metrics = h.service.metrics
        assert metrics.final_frames == 4, "one final frame per stream"
        assert metrics.tasks_ended == {TaskState.Name(stored.status.state): 1}
        assert metrics.streams_open == 0
        assert metrics.streams_ended["finished"] == 4
        return streams, stored.status.state, final_text(first)


async def test_executor_reaching_a_terminal_state_ends_every_stream_with_it() -> None:
    agent = GatedAgent()
    streams, stored, _ = await run_row(agent, agent.working, lambda h, t: release(agent))
    assert [f.WhichOneof("payload") for f in streams[0]] == ["artifact_update", "status_update"]
    assert final_state(streams[0]) == S.TASK_STATE_COMPLETED
    assert stored == S.TASK_STATE_COMPLETED


@pytest.mark.parametrize("mode", ["cooperative", "noop", "raises", "hangs"])
async def test_cancel_ends_every_stream_canceled_whatever_the_executor_cancel_does(
    mode: str,
) -> None:
    agent = GatedAgent(cancel_mode=mode)  # type: ignore[arg-type]
    config = ServerConfig(cancel_timeout=0.5)
    streams, stored, _ = await run_row(agent, agent.working, cancel_trigger(), config)
    for frames in streams:
        assert final_state(frames) == S.TASK_STATE_CANCELED
        assert sum(f.WhichOneof("payload") == "status_update" for f in frames) == 1
    assert stored == S.TASK_STATE_CANCELED
    assert agent.cancel_called.is_set()
    assert agent.execute_cancelled.is_set(), "the producer is cancelled once the task is final"


async def test_executor_crash_ends_every_stream_failed_naming_only_the_error_class() -> None:
    agent = EndingAgent(crash=True)
    streams, stored, text = await run_row(agent, agent.working, lambda h, t: release(agent))
    for frames in streams:
        assert final_state(frames) == S.TASK_STATE_FAILED
    assert "ValueError" in text
    assert "hunter2" not in text
    assert stored == S.TASK_STATE_FAILED


async def test_executor_returning_without_outcome_ends_every_stream_failed() -> None:
    agent = EndingAgent(crash=False)
    streams, stored, text = await run_row(agent, agent.working, lambda h, t: release(agent))
    for frames in streams:
        assert final_state(frames) == S.TASK_STATE_FAILED
    assert "without an outcome" in text
    assert stored == S.TASK_STATE_FAILED


async def test_shutdown_ends_every_stream_failed_after_the_grace_period() -> None:
    agent = GatedAgent()

    async def shutdown(h: Harness, task_id: str) -> None:
        await h.service.shutdown(grace=0.05)
        stored = await h.service.journal.get(task_id)
        assert stored is not None and stored.task.status.state == S.TASK_STATE_FAILED

    streams, _, text = await run_row(agent, agent.working, shutdown)
    for frames in streams:
        assert final_state(frames) == S.TASK_STATE_FAILED
    assert "shutting down" in text


async def test_executor_ignoring_cancellation_cannot_reopen_a_canceled_task() -> None:
    agent = StubbornAgent()
    async with asyncio.timeout(10), serve(agent, ServerConfig(cancel_timeout=0.2)) as h:
        sender, subs, task_id = await fan_out(h, agent.working, cancel_trigger())
        for frames in (sender, *subs):
            assert final_state(frames) == S.TASK_STATE_CANCELED
        await agent.emitted_late.wait()
        stored = await h.client.get_task(GetTaskRequest(id=task_id))
        assert stored.status.state == S.TASK_STATE_CANCELED
        assert h.service.engine.tasks.count == 0
        assert h.service.metrics.dropped_events == 4, "3 late WORKING + 1 late COMPLETED"
        await h.settle()


class FlakyJournal(MemoryJournal):
    """Refuses every update once ``broken`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        if self.broken:
            raise VersionConflictError("journal unavailable")
        return await super().update(task, expected_version, changes)


async def test_journal_refusing_an_event_ends_every_stream_failed() -> None:
    agent = GatedAgent()
    journal = FlakyJournal()
    service_config = ServerConfig(cancel_timeout=1.0)
    async with asyncio.timeout(10), serve(agent, service_config, journal=journal) as h:

        async def break_store(h: Harness, task_id: str) -> None:
            journal.broken = True
            agent.release.set()

        sender, subs, _ = await fan_out(h, agent.working, break_store)
        for frames in (sender, *subs):
            assert final_state(frames) == S.TASK_STATE_FAILED
            assert "could not record" in final_text(frames)
        await h.settle()


class LandThenFailJournal(MemoryJournal):
    """Stores every update, but reports the first one after ``trap`` is set as failed
    (a write whose acknowledgement was lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.trap = False

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        version = await super().update(task, expected_version, changes)
        if self.trap:
            self.trap = False
            raise StoreUnavailableError("the acknowledgement was lost")
        return version


async def test_a_write_that_landed_but_reported_failure_reaches_every_stream_numbered_once() -> (
    None
):
    agent = StepAgent()
    journal = LandThenFailJournal()
    config = ServerConfig(cancel_timeout=1.0)
    async with asyncio.timeout(10), serve(agent, config, journal=journal) as h:

        async def lose_an_ack(h: Harness, task_id: str) -> None:
            journal.trap = True
            agent.step()  # one artifact: recorded, but the executor's write "failed"

        sender, subs, task_id = await fan_out(h, agent.working, lose_an_ack)
        for frames in (sender, *subs):
            assert [f.WhichOneof("payload") for f in frames] == ["artifact_update", "status_update"]
            assert final_state(frames) == S.TASK_STATE_FAILED, "the task cannot go on unsure"
            assert "could not record" in final_text(frames)
        stored = await journal.get(task_id)
        assert stored is not None
        assert stored.task.status.state == S.TASK_STATE_FAILED
        assert [a.artifact_id for a in stored.task.artifacts] == ["step-0"], "what landed stands"
        assert stored.seq == 4, "task 1, WORKING 2, the artifact 3 (once), FAILED 4"
        await h.settle()


async def test_hanging_cancel_ends_the_task_even_if_the_cancel_caller_gives_up() -> None:
    agent = GatedAgent(cancel_mode="hangs")
    async with asyncio.timeout(10), serve(agent, ServerConfig(cancel_timeout=0.3)) as h:

        async def impatient_cancel(h: Harness, task_id: str) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await h.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1, timeout=0.05)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        sender, subs, task_id = await fan_out(h, agent.working, impatient_cancel)
        for frames in (sender, *subs):
            assert final_state(frames) == S.TASK_STATE_CANCELED
        stored = await h.client.get_task(GetTaskRequest(id=task_id))
        assert stored.status.state == S.TASK_STATE_CANCELED
        await h.settle()


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("garbage", "invalid event"),
        ("exit", "SystemExit"),
        ("bad-append", "never created"),
    ],
)
async def test_misbehaving_executor_ends_every_stream_failed(how: str, says: str) -> None:
    agent = MisbehavingAgent(how)  # type: ignore[arg-type]
    streams, stored, text = await run_row(agent, agent.working, lambda h, t: release(agent))
    for frames in streams:
        assert final_state(frames) == S.TASK_STATE_FAILED
    assert says in text
    assert stored == S.TASK_STATE_FAILED


async def test_events_left_behind_by_a_returned_execute_are_dropped() -> None:
    agent = LeakyAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        task = (await h.client.send_message(send_request("hi"))).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        agent.release.set()
        await agent.leaked_emitted.wait()
        again = await h.client.get_task(GetTaskRequest(id=task.id))
        assert again.status.state == S.TASK_STATE_INPUT_REQUIRED
        await h.settle()

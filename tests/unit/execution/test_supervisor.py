"""The core's invariants on their own (no gRPC): the consumer never misses an event, and
closing a task's log always goes final frame, then cancellation, then the readers."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref

import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import Part, StreamResponse, TaskState

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.engine.engine import Started, TaskEngine
from a2a_grpc_server._internal.engine.registry import LiveTasks
from a2a_grpc_server._internal.journal.memory import MemoryJournal
from a2a_grpc_server._internal.model import taskops
from a2a_grpc_server._internal.model.caller import Caller
from a2a_grpc_server.testing import leftover_tasks
from tests.support.harness import send_request

S = TaskState


class Jittery(AgentExecutor):
    """Emits ``count`` artifacts, yielding a random number of loop turns before each put,
    so the consumer drains the queue and ends between some of them and not others."""

    def __init__(self, count: int, rng: random.Random) -> None:
        self.count, self.rng = count, rng

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        for i in range(self.count):
            for _ in range(self.rng.choice((0, 0, 1, 2, 5))):
                await asyncio.sleep(0)  # sync-ok: varies where the put lands in the consumer's life
            await updater.add_artifact([Part(text=str(i))], artifact_id=f"a{i}")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


class Parked(AgentExecutor):
    """Emits WORKING, then waits until cancelled; records whether it was."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).start_work()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


def engine_for(executor: AgentExecutor) -> TaskEngine:
    return TaskEngine(executor, LiveTasks(MemoryJournal(), ServerConfig(cancel_timeout=0.5)))


def frames_of(entries: list[bytes]) -> list[StreamResponse]:
    return [StreamResponse.FromString(frame) for frame in entries]


@pytest.mark.parametrize("seed", range(20))
async def test_every_event_is_committed_in_order_whatever_the_consumers_timing(seed: int) -> None:
    rng = random.Random(seed)
    engine = engine_for(Jittery(60, rng))
    async with asyncio.timeout(10):
        started = await engine.send(send_request("go"), Caller(()), subscribe=True)
        assert isinstance(started, Started) and started.reader is not None
        frames = frames_of([frame async for _, frame, _ in started.reader])
        await engine.wait_idle()
    artifacts = [
        f.artifact_update.artifact.artifact_id for f in frames if f.HasField("artifact_update")
    ]
    assert artifacts == [f"a{i}" for i in range(60)]
    assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
    recorded = await engine.tasks.journal.get(started.live.task_id)
    assert recorded is not None and len(recorded.task.artifacts) == 60
    assert recorded.seq == started.reader.next_seq - 1, "log and journal number the same changes"
    assert not leftover_tasks()


async def test_a_close_appends_the_final_frame_then_cancels_the_run_then_wakes_readers() -> None:
    agent = Parked()
    engine = engine_for(agent)
    async with asyncio.timeout(10):
        started = await engine.send(send_request("go"), Caller(()), subscribe=True)
        assert isinstance(started, Started) and started.reader is not None
        reader = started.reader
        first = StreamResponse.FromString((await anext(reader))[1])  # the task
        working = StreamResponse.FromString((await anext(reader))[1])
        assert working.status_update.status.state == S.TASK_STATE_WORKING
        live, run = started.live, started.run
        waiting = asyncio.ensure_future(anext(reader))
        await asyncio.sleep(0)  # sync-ok: lets the reader reach its wait (it has nothing to read)
        seen: list[str] = []

        def on_close() -> None:
            # Step 3 of the close: the final frame is in the log, the log is closed,
            # and no reader has been woken yet.
            seen.append(f"final={live.log.final_seq} closed={live.log.closed}")
            seen.append(f"readers still waiting={bool(live.log._waiters)}")
            seen.append(f"producer cancelled={all(t.cancelling() for t in run.sources)}")

        live.log.on_close(on_close)
        await live.finalize(S.TASK_STATE_FAILED, "ended from outside")
        assert seen == [
            f"final={live.log.last_seq} closed=True",
            "readers still waiting=True",
            "producer cancelled=True",
        ]
        seq, _, state = await waiting
        assert state == S.TASK_STATE_FAILED and seq == live.log.final_seq
        assert not run.sources or all(t.cancelling() or t.done() for t in run.sources)
        await agent.cancelled.wait()  # the producer was cancelled by the close
        await engine.wait_idle()
        assert run.finished
    assert taskops.state_name(S.TASK_STATE_FAILED) in engine.tasks.metrics.tasks_ended
    assert first.task.id == live.task_id
    assert not leftover_tasks()


async def test_an_ended_task_is_freed_at_once_not_at_the_next_full_collection() -> None:
    engine = engine_for(Jittery(5, random.Random(0)))
    gc.collect()
    gc.disable()  # only reference counting frees anything now: a cycle would keep the task
    try:
        async with asyncio.timeout(10):
            started = await engine.send(send_request("go"), Caller(()), subscribe=True)
            assert isinstance(started, Started) and started.reader is not None
            async for _ in started.reader:
                pass
            await engine.wait_idle()
        run = weakref.ref(started.run)  # it holds the task (and its queue, its context)
        del started
        assert run() is None, "the run, and the task it holds, are freed"
    finally:
        gc.enable()


def _of_ours(thing: object) -> bool:
    module = getattr(thing, "__module__", None) if callable(thing) else type(thing).__module__
    return isinstance(module, str) and module.startswith("a2a_grpc_server")


async def test_an_ended_task_leaves_nothing_of_ours_for_the_collector_to_find() -> None:
    # Garbage in a cycle waits for the collector; every object of a finished
    # call it has to find costs each of its passes (and a full pass scans all).
    engine = engine_for(Jittery(5, random.Random(1)))
    gc.collect()
    gc.disable()
    try:
        async with asyncio.timeout(10):
            for _ in range(3):
                started = await engine.send(send_request("go"), Caller(()), subscribe=True)
                assert isinstance(started, Started) and started.reader is not None
                async for _ in started.reader:
                    pass
            await engine.wait_idle()
        del started
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = sorted({type(o).__qualname__ for o in gc.garbage if _of_ours(o)})
        assert not found, f"left in cycles: {found}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()

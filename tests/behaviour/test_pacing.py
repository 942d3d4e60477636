"""Pacer: slices of bulk work, FIFO wake-ups, cancelled waiters; and a burst to many
streams that leaves other callers answered promptly."""

from __future__ import annotations

import asyncio
import time

import pytest
from a2a.server.agent_execution import RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import GetTaskRequest, Part, TaskState

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.execution.pacing import CROWD, IDLE_GAP, Pacer
from a2a_grpc_server._internal.execution.supervisor import FREE_EVENTS
from tests.support.agents import BurstAgent
from tests.support.harness import V1, send_request, serve

SLICE = 0.005


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_bulk_work_runs_a_slice_then_waits_for_a_round_of_the_loop() -> None:
    clock = Clock()
    pacer = Pacer(SLICE, clock=clock)
    loop = asyncio.get_running_loop()
    assert not pacer.due()  # the first unit of a round starts a slice
    clock.now = SLICE
    assert not pacer.due()
    clock.now = SLICE + 0.001
    assert pacer.due()
    polled = loop.create_future()
    loop.call_soon(polled.set_result, None)
    async with asyncio.timeout(1):
        await pacer.wait()
    assert polled.done(), "the waiter went on before the loop went round"
    assert not pacer.due(), "the waiter's slice starts when it goes on"
    assert pacer.waits == 1


async def test_a_round_with_less_bulk_work_than_a_slice_never_waits() -> None:
    clock = Clock()
    pacer = Pacer(SLICE, clock=clock)
    for _ in range(3):
        assert not pacer.due()
        clock.now += 1.0  # idle time, not bulk work: the loop polls in between
        await asyncio.sleep(0)  # sync-ok: one round of the loop, which ends the slice
    async with asyncio.timeout(1):
        await pacer.wait()  # not due: returns at once
    assert pacer.waits == 0


def test_a_slice_of_zero_turns_pacing_off() -> None:
    clock = Clock()
    pacer = Pacer(0, clock=clock)
    for step in range(3):
        clock.now = step * 3600.0
        assert not pacer.due()  # (and needs no running loop: nothing is scheduled)
    assert not pacer.enabled
    with pytest.raises(ValueError, match="negative"):
        Pacer(-0.001)
    with pytest.raises(ValueError, match="loop_slice"):
        ServerConfig(loop_slice=-1)


async def queued(
    pacer: Pacer, clock: Clock, count: int
) -> tuple[list[asyncio.Task[None]], list[int]]:
    """``count`` coroutines that find the slice spent, queued in order; they log who goes on."""
    order: list[int] = []

    async def unit(i: int) -> None:
        await pacer.wait()
        order.append(i)

    tasks = [asyncio.create_task(unit(i)) for i in range(count)]
    assert not pacer.due()  # a slice began...
    clock.now += 1.0  # ...and is spent before any of them runs
    await asyncio.sleep(0)  # sync-ok: every coroutine reaches its wait
    assert not order
    return tasks, order


@pytest.mark.parametrize("count", [2, CROWD + 2], ids=["few", "crowd"])
async def test_waiters_go_on_oldest_first(count: int) -> None:
    clock = Clock()
    pacer = Pacer(SLICE, clock=clock)
    loop = asyncio.get_running_loop()
    tasks, order = await queued(pacer, clock, count)
    queued_at = loop.time()
    async with asyncio.timeout(1):
        await asyncio.gather(*tasks)
    assert order == list(range(count))
    assert pacer.waits == count
    if count >= CROWD:  # a crowd: the loop idles before the next slice
        assert loop.time() - queued_at >= IDLE_GAP * 0.9


async def test_waiters_passed_over_go_before_the_one_that_spent_the_slice() -> None:
    clock = Clock()
    pacer = Pacer(SLICE, clock=clock)
    order: list[int] = []

    async def unit(i: int) -> None:
        await pacer.wait()
        order.append(i)
        if i == 0:
            clock.now += 1.0  # the first to go on spends the whole slice...
            await pacer.wait()  # ...and queues again, behind the ones it held up
            order.append(i)

    tasks = [asyncio.create_task(unit(i)) for i in range(3)]
    assert not pacer.due()
    clock.now += 1.0
    async with asyncio.timeout(1):
        await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 0]


async def test_a_cancelled_waiter_leaves_the_others_alone() -> None:
    clock = Clock()
    pacer = Pacer(SLICE, clock=clock)
    tasks, order = await queued(pacer, clock, 3)
    tasks[1].cancel()  # while it waits
    async with asyncio.timeout(1):
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2]
    assert isinstance(results[1], asyncio.CancelledError)
    # A lone waiter cancelled: the slice still ends, nothing is left queued.
    tasks, order = await queued(pacer, clock, 1)
    tasks[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    await asyncio.sleep(0)  # sync-ok: the round that ends the slice
    assert not pacer.due()


async def test_a_waiter_cancelled_once_woken_leaves_the_others_alone() -> None:
    clock = Clock()
    pacer = Pacer(SLICE, clock=clock)
    tasks: list[asyncio.Task[None]] = []
    order: list[int] = []

    async def unit(i: int) -> None:
        await pacer.wait()
        order.append(i)
        if i == 0:
            tasks[1].cancel()  # woken with the others, not yet back

    tasks.extend(asyncio.create_task(unit(i)) for i in range(3))
    assert not pacer.due()
    clock.now += 1.0
    async with asyncio.timeout(1):
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2]
    assert isinstance(results[1], asyncio.CancelledError)


class Spent(Clock):
    """A clock a second later at each reading: every slice is spent as soon as it began."""

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


async def test_a_short_task_goes_on_at_once_and_only_bulk_work_waits() -> None:
    agent = BurstOrAnswer(FREE_EVENTS * 2, FRAME_BYTES)
    agent.release.set()
    async with asyncio.timeout(30), serve(agent) as h:
        engine = h.service.engine
        engine.runs.pacer = pacer = Pacer(SLICE, clock=Spent())
        for _ in range(3):  # a unary answer: no executor of it waits, however busy the loop
            reply = await h.stub.SendMessage(send_request("ping"), metadata=V1)
            assert reply.task.status.state == TaskState.TASK_STATE_COMPLETED
        assert pacer.waits == 0
        reply = await h.stub.SendMessage(send_request("go"), metadata=V1)
        assert reply.task.status.state == TaskState.TASK_STATE_COMPLETED
        assert len(reply.task.artifacts) == FREE_EVENTS * 2
        assert pacer.waits >= FREE_EVENTS, "past its free events, a burst waits for each slice"
        await h.settle(within=10)


STREAMS = 20
BURST = 5_000
FRAME_BYTES = 256
LOOP_CPU_BOUND = 0.25
"""Seconds of CPU the event loop may spend while one GetTask waits for its answer, during
the burst. Client and server share this loop, so that is the bulk work the loop ran before
it answered; unlike the wall time, a busy machine does not inflate it (other processes
stretched single GetTasks to 1.7 s of wall time with 0.1 ms of loop CPU). Without pacing
(``loop_slice=0``) a GetTask waited for 0.6-1.5 s of CPU here; with it, for 30-70 ms."""


class BurstOrAnswer(BurstAgent):
    """A BurstAgent that answers "ping" at once, as a short agent would: WORKING, one
    artifact, COMPLETED."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        if context.get_user_input() == "ping":
            assert context.task_id is not None and context.context_id is not None
            updater = TaskUpdater(event_queue, context.task_id, context.context_id)
            await updater.start_work()
            await updater.add_artifact([Part(text="pong")], artifact_id="pong")
            await updater.complete()
            return
        await super().execute(context, event_queue)


@pytest.mark.timeout(120)
async def test_a_burst_to_streams_nobody_reads_leaves_other_calls_prompt() -> None:
    agent = BurstOrAnswer(BURST, FRAME_BYTES)
    async with asyncio.timeout(110), serve(agent, ServerConfig(cancel_timeout=1.0)) as h:
        ping = (await h.stub.SendMessage(send_request("ping"), metadata=V1)).task
        assert ping.status.state == TaskState.TASK_STATE_COMPLETED
        calls = [
            h.stub.SendStreamingMessage(send_request("go"), metadata=V1) for _ in range(STREAMS)
        ]
        for call in calls:  # the task, then WORKING; then the client reads no more
            assert (await call.read()).task.id
            assert (await call.read()).status_update.status.state == TaskState.TASK_STATE_WORKING
        engine = h.service.engine
        assert engine.tasks.count == STREAMS
        agent.release.set()
        # (loop CPU, wall) seconds per call, by method
        took: dict[str, list[tuple[float, float]]] = {"GetTask": [], "SendMessage": []}
        while engine.tasks.count and len(took["GetTask"]) < 5_000:
            for method, took_by in took.items():
                cpu, wall = time.thread_time(), time.perf_counter()
                if method == "GetTask":
                    await h.stub.GetTask(GetTaskRequest(id=ping.id), metadata=V1)
                else:  # a short task of its own: its executor is not held up with the burst's
                    reply = await h.stub.SendMessage(send_request("ping"), metadata=V1)
                    assert reply.task.status.state == TaskState.TASK_STATE_COMPLETED
                took_by.append((time.thread_time() - cpu, time.perf_counter() - wall))
                await asyncio.sleep(0.01)  # sync-ok: paces the probe calls, no synchronisation
        done = h.service.metrics.tasks_ended["TASK_STATE_COMPLETED"]
        assert done == STREAMS + 1 + len(took["SendMessage"])
        for method, took_by in took.items():
            slowest = [(round(c, 3), round(w, 3)) for c, w in sorted(took_by)[-3:]]
            assert max(c for c, _ in took_by) < LOOP_CPU_BOUND, (
                f"{len(took_by)} {method} during the burst; slowest (loop CPU, wall) s: {slowest}"
            )
        assert engine.runs.pacer.waits > 0
        for call in calls:
            call.cancel()
        await h.settle(within=10)
        assert h.service.metrics.streams_ended["disconnected"] == STREAMS

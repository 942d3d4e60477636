"""The core's routing logic across instances, on a fake cluster (``fakecluster``), no NATS.

Each instance is a full ``A2AService`` on its own grpc.aio server; they share
only the fake hub. What is tested is ``TaskEngine``'s side of cluster mode:
which requests go to the task's owner (follow-ups, cancels), what a non-owner
serves itself (subscriptions through its relay, resumptions from the record),
how the owner's errors and an unreachable or slow owner are answered, and
that every stream everywhere ends with the task's outcome. ``test_cluster*.py``
test the same against real NATS. Every test ends with the leak check of
``fake_instances``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeAlias

import grpc
import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from google.rpc import error_details_pb2

from a2a_grpc_server import ServerConfig
from tests.support.agents import CancelMode, GatedAgent, InputAgent, StepAgent
from tests.support.fakecluster import FakeInstance, fake_instances
from tests.support.harness import (
    RESUME,
    V1,
    last_state,
    read_all,
    rebuilt,
    resume_call,
    rich_status,
    send_request,
    seq_of,
)

S = TaskState
Stream: TypeAlias = "grpc.aio.UnaryStreamCall[Any, StreamResponse]"
"""A server-streaming call (SendStreamingMessage, SubscribeToTask)."""
Refusal = tuple[grpc.StatusCode, str, str, str]
"""A failed call's code, ErrorInfo domain and reason, and message."""


class NamedAgent(AgentExecutor):
    """Asks for input on a new task; completes a follow-up with ``hello <text> from <name>``.

    ``runs`` lists the task of every ``execute`` this instance's agent ran.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.runs: list[str] = []

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        self.runs.append(context.task_id)
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        if context.current_task is None:
            await updater.requires_input(updater.new_agent_message([Part(text="your name?")]))
            return
        text = f"hello {context.get_user_input()} from {self.name}"
        await updater.complete(updater.new_agent_message([Part(text=text)]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


class QuietFollowUpAgent(AgentExecutor):
    """Asks for input; answers a follow-up with an agent message only and returns, so the
    task still waits for input and no new status says so."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        if context.current_task is None:
            await updater.requires_input(updater.new_agent_message([Part(text="your name?")]))
            return
        await event_queue.enqueue_event(updater.new_agent_message([Part(text="again?")]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def named(*names: str) -> list[NamedAgent]:
    """One ``NamedAgent`` per instance."""
    return [NamedAgent(name) for name in names]


def follow_up(task_id: str, text: str = "Ada", *, immediately: bool = False) -> SendMessageRequest:
    """A follow-up message to ``task_id``."""
    return send_request(text, task_id=task_id, immediately=immediately)


async def park(owner: FakeInstance) -> str:
    """A new task on ``owner``, waiting for input; its id."""
    answer = await owner.stub.SendMessage(send_request("hi"), metadata=V1)
    assert answer.task.status.state == S.TASK_STATE_INPUT_REQUIRED
    return str(answer.task.id)


async def start_working(owner: FakeInstance) -> tuple[str, Stream]:
    """A streaming send on ``owner``; returns once WORKING is recorded and broadcast."""
    sender = owner.stub.SendStreamingMessage(send_request("go"), metadata=V1)
    first = await sender.read()
    assert first.WhichOneof("payload") == "task"
    working = await sender.read()
    assert working.status_update.status.state == S.TASK_STATE_WORKING
    return str(first.task.id), sender


async def attach(instance: FakeInstance, task_id: str) -> tuple[Task, Stream]:
    """SubscribeToTask on ``instance`` (numbered frames); returns with its snapshot."""
    call = instance.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=RESUME)
    first = await call.read()
    assert first.WhichOneof("payload") == "task"
    assert first.task.id == task_id
    return first.task, call


async def rest(call: Stream) -> list[StreamResponse]:
    """Every frame left in a stream, until it ends."""
    frames: list[StreamResponse] = []
    await read_all(call, frames)
    return frames


async def refusal(call: Awaitable[object]) -> Refusal:
    """What a call that must fail failed with."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    _, info = rich_status(caught.value)
    return caught.value.code(), info.domain, info.reason, caught.value.details() or ""


async def state_on(instance: FakeInstance, task_id: str) -> TaskState:
    """The task's state as GetTask on ``instance`` answers it."""
    task = await instance.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
    state: TaskState = task.status.state
    return state


def leave_memory(instance: FakeInstance) -> int:
    """Run the instance's parked-task sweep as if ``parked_timeout`` had passed."""
    engine = instance.engine
    later = engine.tasks.pool.clock() + instance.service.config.parked_timeout
    return engine.tasks.parking.evict_idle(now=later)


def bad_request_fields(err: grpc.aio.AioRpcError) -> list[str]:
    """The fields a failed call's ``google.rpc.BadRequest`` names (none without one)."""
    status, _ = rich_status(err)
    fields: list[str] = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [violation.field for violation in bad.field_violations]
    return fields


def user_texts(task: Task) -> list[str]:
    """The texts of the user's messages in the task's history."""
    return [m.parts[0].text for m in task.history if m.role == Role.ROLE_USER]


async def test_blocking_follow_up_via_non_owner_runs_on_owner_and_answers_outcome() -> None:
    agents = named("A", "B", "C")
    async with asyncio.timeout(10), fake_instances(agents, ("A", "B", "C")) as (a, b, c):
        task_id = await park(a)
        recorded = await b.cluster.journal.get(task_id)
        assert recorded is not None and recorded.owner == a.instance_id
        _, on_c = await attach(c, task_id)
        done = await b.stub.SendMessage(follow_up(task_id), metadata=V1)
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        assert done.task.status.message.parts[0].text == "hello Ada from A"
        assert user_texts(done.task) == ["hi", "Ada"]
        assert agents[0].runs == [task_id, task_id], "both runs on the owner"
        assert agents[1].runs == agents[2].runs == []
        assert b.service.metrics.tasks_started == 0 and b.engine.tasks.count == 0
        from_c = await rest(on_c)
        assert last_state(from_c) == S.TASK_STATE_COMPLETED
        assert from_c[-1].status_update.status == done.task.status
        stored = await c.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert stored == done.task


async def test_streaming_follow_up_via_non_owner_streams_owners_frames_to_the_end() -> None:
    agents = named("A", "B")
    async with asyncio.timeout(10), fake_instances(agents) as (a, b):
        task_id = await park(a)
        _, on_a = await attach(a, task_id)
        reply = b.stub.SendStreamingMessage(follow_up(task_id, "Bo"), metadata=V1)
        frames = await rest(reply)
        assert frames[0].task.history[-1].parts[0].text == "Bo"
        assert frames[0].task.status.state == S.TASK_STATE_INPUT_REQUIRED
        assert last_state(frames) == S.TASK_STATE_COMPLETED
        assert frames[-1].status_update.status.message.parts[0].text == "hello Bo from A"
        from_a = await rest(on_a)
        assert [f.status_update.status.state for f in from_a] == [
            f.status_update.status.state for f in frames[1:]
        ]
        assert agents[1].runs == []


async def test_immediate_follow_up_via_non_owner_answers_with_the_message_recorded() -> None:
    agents = named("A", "B")
    async with asyncio.timeout(10), fake_instances(agents) as (a, b):
        task_id = await park(a)
        _, on_a = await attach(a, task_id)
        answer = await b.stub.SendMessage(follow_up(task_id, immediately=True), metadata=V1)
        assert user_texts(answer.task) == ["hi", "Ada"]
        assert last_state(await rest(on_a)) == S.TASK_STATE_COMPLETED


@pytest.mark.parametrize("mode", ["cooperative", "noop", "raises", "hangs"])
async def test_cancel_via_non_owner_ends_every_stream_on_every_instance_canceled(
    mode: CancelMode,
) -> None:
    agent = GatedAgent(mode)
    config = ServerConfig(cancel_timeout=0.3)
    async with (
        asyncio.timeout(10),
        fake_instances(agent, ("A", "B", "C"), config=config) as (a, b, c),
    ):
        task_id, sender = await start_working(a)
        attached = [await attach(i, task_id) for i in (a, b, b, c)]
        assert b.cluster.relays == 1, "one relay per task and instance"
        tails = asyncio.gather(rest(sender), *(rest(call) for _, call in attached))
        canceled = await c.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
        assert canceled.status.state == S.TASK_STATE_CANCELED
        from_sender, from_a, *relayed = await tails
        assert last_state(from_sender) == last_state(from_a) == S.TASK_STATE_CANCELED
        assert all(frames == from_a for frames in relayed), "the owner's frames, numbered alike"
        assert agent.cancel_called.is_set()
        for instance in (a, b, c):
            assert await state_on(instance, task_id) == S.TASK_STATE_CANCELED


async def test_cancel_when_owner_is_down_is_unavailable_and_changes_nothing() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), fake_instances(agent) as (a, b):
        task_id, sender = await start_working(a)
        _, on_b = await attach(b, task_id)
        before = await b.cluster.journal.get(task_id)
        assert before is not None
        a.hub.mark_down(a.instance_id)
        code, domain, reason, text = await refusal(
            b.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
        )
        assert (code, domain, reason) == (
            grpc.StatusCode.UNAVAILABLE,
            "a2a-grpc-server",
            "OWNER_UNAVAILABLE",
        )
        assert a.instance_id in text
        after = await b.cluster.journal.get(task_id)
        assert after == before
        assert not agent.cancel_called.is_set()
        a.hub.mark_up(a.instance_id)
        agent.release.set()  # the task goes on as if nothing was asked
        assert last_state(await rest(sender)) == S.TASK_STATE_COMPLETED
        assert last_state(await rest(on_b)) == S.TASK_STATE_COMPLETED


async def test_follow_up_when_owner_is_down_is_unavailable_and_changes_nothing() -> None:
    agents = named("A", "B")
    async with asyncio.timeout(10), fake_instances(agents) as (a, b):
        task_id = await park(a)
        before = await b.cluster.journal.get(task_id)
        a.hub.mark_down(a.instance_id)
        blocking = await refusal(b.stub.SendMessage(follow_up(task_id), metadata=V1))
        streaming = await refusal(
            rest(b.stub.SendStreamingMessage(follow_up(task_id), metadata=V1))
        )
        assert (
            blocking[:3]
            == streaming[:3]
            == (
                grpc.StatusCode.UNAVAILABLE,
                "a2a-grpc-server",
                "OWNER_UNAVAILABLE",
            )
        )
        assert await b.cluster.journal.get(task_id) == before, "no message recorded"
        assert b.cluster.relays == 0, "the relay opened for the answer is closed"
        assert agents[0].runs == [task_id]
        a.hub.mark_up(a.instance_id)
        done = await b.stub.SendMessage(follow_up(task_id), metadata=V1)
        assert done.task.status.message.parts[0].text == "hello Ada from A"
        assert user_texts(done.task) == ["hi", "Ada"]


async def test_subscriber_on_non_owner_gets_snapshot_then_every_frame_to_the_end() -> None:
    agent = StepAgent()
    async with asyncio.timeout(10), fake_instances(agent, ("A", "B", "C")) as (a, b, c):
        task_id, sender = await start_working(a)
        snap_a, on_a = await attach(a, task_id)
        snap_b, on_b = await attach(b, task_id)
        assert snap_b == snap_a and snap_b.status.state == S.TASK_STATE_WORKING
        agent.step(2)
        early = [await on_b.read(), await on_b.read()]
        assert [f.artifact_update.artifact.artifact_id for f in early] == ["step-0", "step-1"]
        snap_c, on_c = await attach(c, task_id)  # mid-stream, on a third instance
        assert [x.artifact_id for x in snap_c.artifacts] == ["step-0", "step-1"]
        assert seq_of(StreamResponse(task=snap_c)) == seq_of(early[-1])
        agent.step(3)
        agent.finish()
        from_a, late_b, from_c, from_sender = await asyncio.gather(
            rest(on_a), rest(on_b), rest(on_c), rest(sender)
        )
        from_b = early + late_b
        assert from_b == from_a, "exactly the owner's frames, with its numbers"
        assert from_c == from_a[2:]
        assert last_state(from_b) == last_state(from_sender) == S.TASK_STATE_COMPLETED
        stored = await b.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        for snapshot, frames in ((snap_b, from_b), (snap_c, from_c)):
            whole = rebuilt([StreamResponse(task=snapshot), *frames])
            assert list(whole.artifacts) == list(stored.artifacts)


async def test_follow_up_to_working_task_via_non_owner_is_refused_as_by_owner() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), fake_instances(agent) as (a, b):
        task_id, sender = await start_working(a)
        routed = await refusal(b.stub.SendMessage(follow_up(task_id), metadata=V1))
        direct = await refusal(a.stub.SendMessage(follow_up(task_id), metadata=V1))
        assert routed == direct
        assert routed[:3] == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "a2a-protocol.org",
            "UNSUPPORTED_OPERATION",
        )
        assert "still TASK_STATE_WORKING" in routed[3]
        assert b.cluster.relays == 0
        agent.release.set()
        assert last_state(await rest(sender)) == S.TASK_STATE_COMPLETED


async def test_follow_up_reaching_owner_after_task_ended_is_refused_as_by_owner() -> None:
    agents = named("A", "B")
    async with asyncio.timeout(10), fake_instances(agents) as (a, b):
        task_id = await park(a)
        hold = a.hub.hold(a.instance_id)
        routed_call = asyncio.ensure_future(
            refusal(b.stub.SendMessage(follow_up(task_id), metadata=V1))
        )
        await hold.arrived.wait()  # B saw the task waiting for input, and routed
        canceled = await a.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
        assert canceled.status.state == S.TASK_STATE_CANCELED
        hold.release()
        routed = await routed_call
        direct = await refusal(a.stub.SendMessage(follow_up(task_id), metadata=V1))
        assert routed == direct
        assert routed[:3] == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "a2a-protocol.org",
            "UNSUPPORTED_OPERATION",
        )
        assert "CANCELED and accepts no more messages" in routed[3]
        assert agents[0].runs == [task_id]


async def test_cancel_reaching_owner_after_task_ended_is_refused_as_by_owner() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), fake_instances(agent) as (a, b):
        task_id, sender = await start_working(a)
        hold = a.hub.hold(a.instance_id)
        routed_call = asyncio.ensure_future(
            refusal(b.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1))
        )
        await hold.arrived.wait()
        agent.release.set()
        assert last_state(await rest(sender)) == S.TASK_STATE_COMPLETED
        hold.release()
        routed = await routed_call
        direct = await refusal(a.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1))
        assert routed == direct
        assert routed[:3] == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "a2a-protocol.org",
            "TASK_NOT_CANCELABLE",
        )
        assert not agent.cancel_called.is_set()


async def test_follow_up_too_large_for_the_task_via_non_owner_is_refused_as_by_owner() -> None:
    config = ServerConfig(cancel_timeout=1.0, max_task_bytes=4096, max_message_bytes=2048)
    async with asyncio.timeout(10), fake_instances(InputAgent(pad=3000), config=config) as (a, b):
        task_id = await park(a)
        too_large = follow_up(task_id, "x" * 1500)  # fits a request, not the task
        routed = await refusal(b.stub.SendMessage(too_large, metadata=V1))
        direct = await refusal(a.stub.SendMessage(too_large, metadata=V1))
        assert routed == direct
        assert routed[:3] == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "a2a-protocol.org",
            "INVALID_PARAMS",
        )
        canceled = await b.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
        assert canceled.status.state == S.TASK_STATE_CANCELED


async def test_follow_up_too_large_via_non_owner_names_the_field_as_the_owner_does() -> None:
    config = ServerConfig(cancel_timeout=1.0, max_task_bytes=4096, max_message_bytes=2048)
    async with asyncio.timeout(10), fake_instances(InputAgent(pad=3000), config=config) as (a, b):
        task_id = await park(a)
        too_large = follow_up(task_id, "x" * 1500)
        try:
            for instance in (a, b):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await instance.stub.SendMessage(too_large, metadata=V1)
                assert bad_request_fields(caught.value) == ["message"], instance.name
        finally:
            await a.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)


async def test_blocking_follow_up_via_non_owner_answers_when_the_owners_run_ends() -> None:
    async with asyncio.timeout(10), fake_instances(QuietFollowUpAgent()) as (a, b):
        task_id = await park(a)
        try:
            direct = await a.stub.SendMessage(follow_up(task_id), metadata=V1, timeout=5)
            assert direct.task.status.state == S.TASK_STATE_INPUT_REQUIRED
            routed = await b.stub.SendMessage(follow_up(task_id), metadata=V1, timeout=1)
            assert routed.task.status.state == S.TASK_STATE_INPUT_REQUIRED
            assert user_texts(routed.task) == ["hi", "Ada", "Ada"]
            # A stream of such a follow-up, on the owner or through another instance,
            # ends with the state the task is left in.
            for instance in (a, b):
                stream = instance.stub.SendStreamingMessage(follow_up(task_id), metadata=V1)
                frames = [frame async for frame in stream]
                assert frames[-1].status_update.status.state == S.TASK_STATE_INPUT_REQUIRED
        finally:
            await a.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)


async def test_owner_slower_than_callers_deadline_is_answered_owner_timeout() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), fake_instances(agent) as (a, b):
        task_id, sender = await start_working(a)
        _, on_b = await attach(b, task_id)
        hold = a.hub.hold(a.instance_id)
        code, domain, reason, text = await refusal(
            b.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1, timeout=0.8)
        )
        # Answered before the client's own deadline: it carries the server's reason.
        assert (code, domain, reason) == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "a2a-grpc-server",
            "OWNER_TIMEOUT",
        )
        assert "may or may not have taken effect" in text
        assert hold.arrived.is_set()
        hold.release()  # the owner acts after all
        assert last_state(await rest(sender)) == S.TASK_STATE_CANCELED
        assert last_state(await rest(on_b)) == S.TASK_STATE_CANCELED
        assert await state_on(b, task_id) == S.TASK_STATE_CANCELED


async def test_parked_task_out_of_owners_memory_is_revived_by_routed_requests() -> None:
    agents = named("A", "B")
    async with asyncio.timeout(10), fake_instances(agents) as (a, b):
        continued, watched, canceled = [await park(a) for _ in range(3)]
        assert leave_memory(a) == 3
        assert a.engine.tasks.count == 0
        # A follow-up through B: the owner revives the task from its record and runs it.
        done = await b.stub.SendMessage(follow_up(continued), metadata=V1)
        assert done.task.status.message.parts[0].text == "hello Ada from A"
        assert user_texts(done.task) == ["hi", "Ada"]
        # A subscriber on B reads the record; the owner keeps the task out of memory...
        snapshot, on_b = await attach(b, watched)
        assert snapshot.status.state == S.TASK_STATE_INPUT_REQUIRED
        assert a.engine.tasks.count == 0
        # ...until the follow-up revives it there; the relayed stream sees it end.
        done = await b.stub.SendMessage(follow_up(watched, "Bo"), metadata=V1)
        assert done.task.status.message.parts[0].text == "hello Bo from A"
        from_b = await rest(on_b)
        assert last_state(from_b) == S.TASK_STATE_COMPLETED
        assert from_b[-1].status_update.status == done.task.status
        # A cancel through B: the owner revives it to cancel it.
        ended = await b.stub.CancelTask(CancelTaskRequest(id=canceled), metadata=V1)
        assert ended.status.state == S.TASK_STATE_CANCELED
        assert agents[0].runs.count(continued) == agents[0].runs.count(watched) == 2
        assert agents[1].runs == []
        assert a.engine.tasks.count == b.engine.tasks.count == 0


async def test_resumption_on_non_owner_reads_exactly_the_frames_after_its_cursor() -> None:
    agent = StepAgent()
    async with asyncio.timeout(10), fake_instances(agent) as (a, b):
        sender = a.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
        task_id = (await sender.read()).task.id
        agent.step(2)
        seen = [await sender.read() for _ in range(3)]  # WORKING, two artifacts
        cursor = seq_of(seen[-1])
        resumed = resume_call(b.stub, task_id, cursor - 1)  # while the task runs
        first = await resumed.read()
        assert seq_of(first) == cursor and first == seen[-1]
        agent.step(2)
        agent.finish()
        everything = [*seen, *await rest(sender)]
        after_cut = [first, *await rest(resumed)]
        assert after_cut == [f for f in everything if seq_of(f) >= cursor]
        # After the end, from the record alone.
        assert await rest(resume_call(b.stub, task_id, 2)) == [
            f for f in everything if seq_of(f) > 2
        ]
        assert await rest(resume_call(b.stub, task_id, seq_of(everything[-1]))) == []


async def test_leaving_severs_relayed_streams_and_the_task_goes_on_at_its_owner() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), fake_instances(agent) as (a, b):
        task_id, sender = await start_working(a)
        _, on_b = await attach(b, task_id)
        await b.service.shutdown(grace=0)
        code, _, reason, _ = await refusal(rest(on_b))
        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "RELAY_LOST")
        again = b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        code, _, reason, _ = await refusal(rest(again))
        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "RELAY_LOST")
        agent.release.set()
        assert last_state(await rest(sender)) == S.TASK_STATE_COMPLETED


async def test_task_a_survivor_ended_ends_every_stream_once_its_owner_rechecks() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), fake_instances(agent) as (a, b):
        task_id, sender = await start_working(a)
        _, on_a = await attach(a, task_id)
        _, on_b = await attach(b, task_id)
        # A was out of touch: B took it for lost and ended its task (and owns the record).
        assert await b.cluster.end_as_survivor(task_id, "owner instance A was lost")
        from_b = await rest(on_b)
        assert last_state(from_b) == S.TASK_STATE_FAILED
        recorded = await a.cluster.journal.get(task_id)
        assert recorded is not None and recorded.owner == b.instance_id
        assert await a.engine.recheck_ownership() == 1
        from_sender, from_a = await rest(sender), await rest(on_a)
        assert from_a == from_b, "every stream gets the outcome the record holds"
        assert from_sender[-1].status_update.status == from_a[-1].status_update.status
        text = from_a[-1].status_update.status.message.parts[0].text
        assert text == "owner instance A was lost"
        await agent.execute_cancelled.wait()  # the owner's executor is stopped

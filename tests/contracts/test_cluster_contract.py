"""The cluster contract (``cluster.Cluster``, the ``engine.ports.Peers`` it extends), run
against both implementations: the in-memory fake (``tests.support.fakecluster``) and
``jetstream.node.NatsCluster`` on a real nats-server.

Two instances, A and B; every task here is A's (it runs A's executor), and each
test asks B's cluster membership what the front asks of it for a task another
instance owns: a relay (``subscribe``), a replay from a cursor (``replay``), the
owner's cancel and follow-up (``cancel``, ``send``), and the owner's errors as
their own class. What the fake does not model (outages, a lease) is not part
of this contract; the cluster and fault suites test it on NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from a2a.server.agent_execution import AgentExecutor
from a2a.types.a2a_pb2 import StreamResponse, Task, TaskState
from a2a.utils.errors import TaskNotCancelableError, UnsupportedOperationError

from a2a_grpc_server import A2AService
from a2a_grpc_server._internal.cluster import Cluster
from a2a_grpc_server._internal.engine.engine import Started
from a2a_grpc_server._internal.errors import OwnerUnavailableError, TaskHandedOverError
from a2a_grpc_server._internal.jetstream import formats
from a2a_grpc_server._internal.journal import RecordedTask, Released
from a2a_grpc_server._internal.log.tasklog import LogReader
from a2a_grpc_server._internal.model.caller import Caller
from tests.support import clusterharness, fakecluster
from tests.support.agents import GatedPerTask, HeldFollowUpAgent, InputAgent
from tests.support.harness import send_request

S = TaskState
Backend = tuple[str, str | None]
ANYONE = Caller((), 10.0)
"""The anonymous caller (the tasks here are unscoped), with a deadline."""


@dataclass
class Pair:
    """Two instances of one cluster: A runs the tasks, B is asked for them."""

    a: A2AService
    b: A2AService
    a_cluster: Cluster
    b_cluster: Cluster

    async def recorded(self, task_id: str) -> RecordedTask:
        """The task as A records it."""
        return await self.a.engine.tasks.recorded(task_id)


@contextlib.asynccontextmanager
async def pair(backend: Backend, executor: AgentExecutor) -> AsyncIterator[Pair]:
    """A and B on ``backend``; on a normal exit nothing of ours is left on either."""
    name, url = backend
    if name == "fake":
        async with fakecluster.fake_instances(executor) as (a, b):
            yield Pair(a.service, b.service, a.cluster, b.cluster)
    else:
        assert url is not None
        async with clusterharness.instances(executor, [url]) as (a, b):
            yield Pair(a.service, b.service, a.cluster, b.cluster)


@pytest.fixture(params=["fake", "nats"])
def backend(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    url = request.getfixturevalue("nats_url") if request.param == "nats" else None
    return request.param, url


async def started(p: Pair, agent: GatedPerTask) -> str:
    """A task of A's, WORKING (its executor waits for its release)."""
    reply = await p.a.engine.send(send_request("go"), ANYONE, subscribe=False)
    task_id = reply.live.task_id
    log = reply.live.log  # (a frame is appended once its change is recorded)
    while log.snapshot is None or log.snapshot.status.state != S.TASK_STATE_WORKING:
        await log.wait_changed()
    return task_id


async def frames(reader: LogReader) -> list[tuple[int, StreamResponse]]:
    """Every frame the reader yields until the task's final frame, with its seq."""
    return [(seq, StreamResponse.FromString(data)) async for seq, data, _ in reader]


def state_of(frame: StreamResponse) -> TaskState:
    return frame.status_update.status.state


async def test_a_relay_gives_the_owners_frames_with_its_numbers_through_the_final_one(
    backend: Backend,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(30), pair(backend, agent) as p:
        task_id = await started(p, agent)
        recorded = await p.recorded(task_id)
        snapshot, reader = await p.b_cluster.subscribe(recorded)
        assert snapshot.id == task_id and snapshot.status.state == S.TASK_STATE_WORKING
        _, own = await p.a.engine.subscribe(task_id, recorded.scope)
        agent.release(task_id)
        relayed, owned = await asyncio.gather(frames(reader), frames(own))
        assert [seq for seq, _ in relayed] == [seq for seq, _ in owned]
        assert relayed == owned, "the same frames, numbered as the owner numbers them"
        assert relayed[0][0] == reader_start(recorded)
        assert state_of(relayed[-1][1]) == S.TASK_STATE_COMPLETED


def reader_start(recorded: RecordedTask) -> int:
    """The first seq a relay of ``recorded`` yields: the change after the record's."""
    return recorded.seq + 1


async def test_a_relay_of_an_ended_task_is_refused_as_ended(
    backend: Backend,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(30), pair(backend, agent) as p:
        task_id = await started(p, agent)
        _, own = await p.a.engine.subscribe(task_id, "")
        agent.release(task_id)
        await frames(own)
        ended = await p.recorded(task_id)
        assert ended.task.status.state == S.TASK_STATE_COMPLETED
        with pytest.raises(UnsupportedOperationError, match="terminal task"):
            await p.b_cluster.subscribe(ended)


async def test_a_replay_gives_exactly_the_frames_after_the_cursor(
    backend: Backend,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(30), pair(backend, agent) as p:
        task_id = await started(p, agent)
        _, own = await p.a.engine.subscribe(task_id, "")
        first = await p.recorded(task_id)
        agent.release(task_id)
        owned = await frames(own)
        ended = await p.recorded(task_id)
        for after in (first.seq - 1, first.seq, ended.seq - 1):
            replayed = await frames(await p.b_cluster.replay(ended, after))
            assert [seq for seq, _ in replayed] == list(range(after + 1, ended.seq + 1))
            tail = [entry for entry in owned if entry[0] > after]
            assert replayed[-len(tail) :] == tail, f"after {after}: the owner's own frames"


async def test_a_cancel_runs_on_the_owner_and_every_reader_gets_canceled(
    backend: Backend,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(30), pair(backend, agent) as p:
        task_id = await started(p, agent)
        recorded = await p.recorded(task_id)
        _, relay = await p.b_cluster.subscribe(recorded)
        _, own = await p.a.engine.subscribe(task_id, "")
        canceled = await p.b_cluster.cancel(recorded, ANYONE)
        assert canceled.id == task_id and canceled.status.state == S.TASK_STATE_CANCELED
        for reader in (relay, own):
            assert state_of((await frames(reader))[-1][1]) == S.TASK_STATE_CANCELED
        assert (await p.recorded(task_id)).task.status.state == S.TASK_STATE_CANCELED


async def test_the_owners_errors_arrive_as_their_own_class(
    backend: Backend,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(30), pair(backend, agent) as p:
        task_id = await started(p, agent)
        _, own = await p.a.engine.subscribe(task_id, "")
        agent.release(task_id)
        await frames(own)
        ended = await p.recorded(task_id)
        with pytest.raises(TaskNotCancelableError, match="COMPLETED"):
            await p.b_cluster.cancel(ended, ANYONE)
        follow_up = send_request("more", task_id=task_id)
        with pytest.raises(UnsupportedOperationError, match="accepts no more messages"):
            await p.b_cluster.send(ended, follow_up, ANYONE)


async def test_a_follow_up_runs_on_the_owner(backend: Backend) -> None:
    async with asyncio.timeout(30), pair(backend, InputAgent()) as p:
        asked = await p.a.engine.send(send_request("hi"), ANYONE, subscribe=False)
        answer, _ = await asked.outcome(immediately=False)
        task_id = asked.live.task_id
        await p.a.engine.wait_idle()  # its run ended: the task waits for the follow-up
        assert (await p.recorded(task_id)).task.status.state == S.TASK_STATE_INPUT_REQUIRED
        recorded = await p.recorded(task_id)
        _, relay = await p.b_cluster.subscribe(recorded)
        await p.b_cluster.send(recorded, send_request("Ada", task_id=task_id), ANYONE)
        relayed = await frames(relay)
        assert state_of(relayed[-1][1]) == S.TASK_STATE_COMPLETED
        done = (await p.recorded(task_id)).task
        assert done.status.message.parts[0].text == "hello Ada"
        assert isinstance(answer, Task) and answer.id == task_id  # (the task, waiting)


async def test_an_owner_nobody_serves_is_unavailable(backend: Backend) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(30), pair(backend, agent) as p:
        task_id = await started(p, agent)
        recorded = await p.recorded(task_id)
        gone = RecordedTask(
            recorded.task, recorded.version, "lost-instance", recorded.seq, recorded.scope
        )
        with pytest.raises(OwnerUnavailableError):
            await p.b_cluster.cancel(gone, ANYONE)
        with pytest.raises(OwnerUnavailableError):
            await p.b_cluster.send(gone, send_request("more", task_id=task_id), ANYONE)
        assert (await p.recorded(task_id)).task.status.state == S.TASK_STATE_WORKING
        agent.release(task_id)


async def waiting_on_a(p: Pair) -> Started:
    """A task of A's that waits for input, once both instances write format 2 (releasable)."""
    asked = await p.a.engine.send(send_request("hi"), ANYONE, subscribe=False)
    await asked.outcome(immediately=False)
    await p.a.engine.wait_idle()
    for member in (p.a_cluster, p.b_cluster):
        written = getattr(member, "formats", None)  # (on NATS: a lease after start)
        if written is not None:
            await written.wait_for(formats.CURRENT)
    return asked


async def test_a_waiting_task_is_released_only_by_its_owner_and_claimed_once(
    backend: Backend,
) -> None:
    async with asyncio.timeout(30), pair(backend, InputAgent()) as p:
        asked = await waiting_on_a(p)
        task_id = asked.live.task_id
        assert not await p.b_cluster.release(task_id), "not B's to release"
        assert await p.a_cluster.release(task_id)
        free = await p.recorded(task_id)
        assert free.owner == "" and free.task.status.state == S.TASK_STATE_INPUT_REQUIRED
        claimed = await p.b_cluster.claim(free)
        assert claimed is not None and claimed.owner == p.b_cluster.instance_id
        assert claimed.task.id == task_id and claimed.seq == free.seq
        assert await p.a_cluster.claim(free) is None, "claimed once"
        assert (await p.recorded(task_id)).owner == p.b_cluster.instance_id
        assert not await p.a_cluster.release(task_id), "no longer A's"
        p.a.engine.tasks.hand_over(asked.live, "another instance took it over")


async def test_a_copy_another_instance_claimed_meanwhile_is_handed_over_at_shutdown(
    backend: Backend,
) -> None:
    # A kept a waiting task in memory while it was released and claimed by B (A was out of
    # touch, say, and its recheck had not run yet). A's shutdown must not end its copy
    # FAILED: its readers are handed over, and the record stays B's, still waiting.
    async with asyncio.timeout(30), pair(backend, InputAgent()) as p:
        asked = await waiting_on_a(p)
        task_id = asked.live.task_id
        assert await p.a_cluster.release(task_id)
        assert await p.b_cluster.claim(await p.recorded(task_id)) is not None
        _, reader = await p.a.engine.subscribe(task_id, ANYONE.scope)
        assert await p.a_cluster.release(task_id) is Released.MOVED_ON
        await p.a.engine.shutdown(0.0, release=p.a_cluster.release)
        with pytest.raises(TaskHandedOverError):
            await frames(reader)
        after = await p.recorded(task_id)
        assert after.owner == p.b_cluster.instance_id
        assert after.task.status.state == S.TASK_STATE_INPUT_REQUIRED, "not ended FAILED"


async def test_a_run_that_finds_its_task_continued_elsewhere_hands_its_readers_over(
    backend: Backend,
) -> None:
    # Fault suite seed 282806: A admitted a follow-up (its message recorded, its run
    # live) and was then out of touch; a survivor released the task, B claimed it and
    # ran it to its end. A's run, back, found the record ahead by B's changes. Sealing
    # A's log with the record's final frame (or numbering past B's changes) skipped
    # B's frames for A's readers; writing on top ended B's task FAILED. Its readers are
    # handed over instead (they follow the record), and A writes nothing more.
    agent = HeldFollowUpAgent()
    async with asyncio.timeout(30), pair(backend, agent) as p:
        asked = await waiting_on_a(p)
        task_id = asked.live.task_id
        _, reader = await p.a.engine.subscribe(task_id, ANYONE.scope)
        before = await p.recorded(task_id)
        held = await p.a.engine.send(send_request("held", task_id=task_id), ANYONE, subscribe=False)
        await agent.holding.wait()
        assert await p.a_cluster.release(task_id)  # (as a survivor releases it)
        assert await p.b_cluster.claim(await p.recorded(task_id)) is not None
        by_b = await p.b.engine.send(send_request("B", task_id=task_id), ANYONE, subscribe=False)
        await by_b.outcome(immediately=False)
        await p.b.engine.wait_idle()
        continued = await p.recorded(task_id)
        assert continued.task.status.state == S.TASK_STATE_COMPLETED
        agent.go.set()
        with pytest.raises(TaskHandedOverError):
            await frames(reader)
        await held.outcome(immediately=False)
        await p.a.engine.wait_idle()
        after = await p.recorded(task_id)
        assert (after.seq, after.task.status.state) == (continued.seq, S.TASK_STATE_COMPLETED)
        assert after.task.status.message.parts[0].text == "hello B", "nothing of A's on top"
        assert p.a.engine.tasks.live_task(task_id) is None, "A let go of it"
        replayed = await frames(await p.b_cluster.replay(after, before.seq))
        # (The two follow-up messages take numbers without frames.)
        assert [seq for seq, _ in replayed] == list(range(after.seq - 2, after.seq + 1))
        assert state_of(replayed[-1][1]) == S.TASK_STATE_COMPLETED, "a reader resumes to B's end"

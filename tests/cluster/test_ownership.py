"""Ownership under faults, with an agent that keeps emitting through them (issue 19).

Each case is what broke before: an owner paused past its lease whose agent's
next event met the survivor's write; a NATS-wide outage (nats-server SIGKILLed
and restarted, or paused) after which one instance reaped the other's work.
Every stream must end with the task's recorded outcome, and an outage every
instance saw must not end anyone's tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)

from a2a_grpc_server._internal.journal import StoreUnavailableError
from tests.support import natsserver
from tests.support.agents import Ticking
from tests.support.clusterharness import Instance, instances
from tests.support.faultsuite import Partition
from tests.support.harness import V1, send_request
from tests.support.serveproc import Process, owner_process

S = TaskState
pytestmark = pytest.mark.usefixtures("layout")  # (every test on both layouts: conftest)
LEASE = 2.0
TICKING = "tests.support.agents:Ticking"


async def record(call: Any) -> tuple[list[StreamResponse], grpc.StatusCode]:
    """Every frame of a stream and the status it ended with."""
    frames: list[StreamResponse] = []
    try:
        async for frame in call:
            frames.append(frame)
    except grpc.aio.AioRpcError as err:
        return frames, err.code()
    return frames, grpc.StatusCode.OK


def final_status(frames: Sequence[StreamResponse]) -> TaskState | None:
    """The state of a stream's last frame, if that frame is a final status."""
    if not frames:
        return None
    last = frames[-1]
    kind = last.WhichOneof("payload")
    state = (
        last.status_update.status.state
        if kind == "status_update"
        else last.task.status.state
        if kind == "task"
        else None
    )
    final = (S.TASK_STATE_COMPLETED, S.TASK_STATE_FAILED, S.TASK_STATE_CANCELED)
    return state if state in final else None


async def stored(stub: a2a_pb2_grpc.A2AServiceStub, task_id: str) -> Task:
    result: Task = await stub.GetTask(GetTaskRequest(id=task_id), metadata=V1, timeout=10)
    return result


async def start_streams(
    stubs: Sequence[a2a_pb2_grpc.A2AServiceStub],
    count: int,
    text: str,
    followers: Sequence[a2a_pb2_grpc.A2AServiceStub] | None = None,
) -> tuple[list[str], list[asyncio.Task[tuple[list[StreamResponse], grpc.StatusCode]]]]:
    """``count`` streaming tasks sent through ``stubs`` in turn; each also followed through
    every one of ``followers`` (default: ``stubs``)."""
    ids: list[str] = []
    tails: list[asyncio.Task[tuple[list[StreamResponse], grpc.StatusCode]]] = []
    for i in range(count):
        stub = stubs[i % len(stubs)]
        call = stub.SendStreamingMessage(send_request(text), metadata=V1)
        first: StreamResponse = await anext(aiter(call))
        ids.append(first.task.id)
        tails.append(asyncio.ensure_future(record(call)))
        for other in followers or stubs:
            sub = other.SubscribeToTask(SubscribeToTaskRequest(id=first.task.id), metadata=V1)
            await anext(aiter(sub))
            tails.append(asyncio.ensure_future(record(sub)))
    return ids, tails


def assert_outcomes(
    results: Sequence[tuple[list[StreamResponse], grpc.StatusCode]],
    recorded: dict[str, Task],
    ids_of: Sequence[str],
) -> None:
    """Every stream ended OK with a final frame equal to its task's recorded final state."""
    for (frames, code), task_id in zip(results, ids_of, strict=True):
        assert code == grpc.StatusCode.OK, (task_id, code)
        state = final_status(frames)
        assert state is not None, f"stream of {task_id} ended OK without a final frame"
        assert state == recorded[task_id].status.state, (task_id, state)


async def test_an_owner_paused_past_its_lease_while_its_agent_emits_ends_every_stream_failed(
    nats_url: str,
) -> None:
    async with (
        owner_process(nats_url, LEASE, agent=TICKING) as (owner, _),
        asyncio.timeout(45),
        instances(Ticking(), [nats_url], names=("B",), lease=LEASE) as (b,),
    ):
        channel = grpc.aio.insecure_channel(owner.grpc_addr)
        try:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            ids, tails = await start_streams([stub], 10, "400 0.05", [stub, b.stub])
            owner.proc.send_signal(signal.SIGSTOP)
            try:
                # The survivor ends them FAILED and its relayed streams get that frame.
                async with asyncio.timeout(3 * LEASE + 5):
                    relayed = await asyncio.gather(*tails[2::3])
                for frames, code in relayed:
                    assert code == grpc.StatusCode.OK
                    assert final_status(frames) == S.TASK_STATE_FAILED
            finally:
                owner.proc.send_signal(signal.SIGCONT)
            results = await asyncio.gather(*tails)
            recorded = {i: await stored(b.stub, i) for i in ids}
            assert all(t.status.state == S.TASK_STATE_FAILED for t in recorded.values())
            assert_outcomes(results, recorded, [i for i in ids for _ in range(3)])
            # The owner answers the same outcome, and has stopped the agents.
            for task_id in ids:
                assert (await stored(stub, task_id)).status == recorded[task_id].status
        finally:
            await channel.close()
        owner.proc.send_signal(signal.SIGTERM)
        assert await owner.proc.wait() == 0


async def nats_outage_keeps_every_task(
    instances_: Sequence[Instance], cause: str, outage: float, node: natsserver.Node
) -> None:
    """Tasks streaming on both instances; NATS goes away for ``outage``; nothing is reaped."""
    stubs = [i.stub for i in instances_]
    ids, tails = await start_streams(stubs, 10, "60 0.1")
    if cause == "kill":
        node.kill()
        await asyncio.sleep(outage)  # sync-ok: the outage's length is what is tested
        node.start()
    else:
        node.pause()
        await asyncio.sleep(outage)  # sync-ok: the outage's length is what is tested
        node.resume()
    results = await asyncio.gather(*tails)
    recorded = {i: await stored(stubs[0], i) for i in ids}
    reaped = sum(i.service.metrics.tasks_reaped for i in instances_)
    assert reaped == 0, "an outage every instance saw ended tasks"
    assert all(t.status.state == S.TASK_STATE_COMPLETED for t in recorded.values()), {
        i: S.Name(t.status.state) for i, t in recorded.items()
    }
    assert_outcomes(results, recorded, [i for i in ids for _ in range(3)])


async def test_nats_killed_and_restarted_past_the_lease_reaps_nothing() -> None:
    with natsserver.running(1) as cluster:
        async with (
            asyncio.timeout(60),
            instances(Ticking(), cluster.urls, lease=LEASE) as pair,
        ):
            await nats_outage_keeps_every_task(pair, "kill", LEASE + 1.1, cluster.nodes[0])


@pytest.mark.parametrize("leases", [0.8, 1.0, 3.0], ids=["under", "at", "well-past"])
async def test_nats_paused_around_the_lease_reaps_nothing(leases: float) -> None:
    with natsserver.running(1) as cluster:
        async with (
            asyncio.timeout(60),
            instances(Ticking(), cluster.urls, lease=LEASE) as pair,
        ):
            await nats_outage_keeps_every_task(pair, "pause", leases * LEASE, cluster.nodes[0])


@contextlib.asynccontextmanager
async def owner_and_survivor(
    nats_url: str, *, partitioned: bool
) -> AsyncIterator[tuple[Process, a2a_pb2_grpc.A2AServiceStub, Instance, Partition | None]]:
    """An owner process running Ticking (through a cuttable proxy to NATS, if
    ``partitioned``), a stub of it, and a survivor instance in this process."""
    proxy = None
    url = nats_url
    if partitioned:
        proxy = Partition(int(nats_url.rsplit(":", 1)[1]))
        await proxy.start()
        url = f"nats://127.0.0.1:{proxy.port}"
    try:
        async with (
            owner_process(url, LEASE, agent=TICKING) as (owner, _),
            instances(Ticking(), [nats_url], names=("B",), lease=LEASE) as (b,),
        ):
            channel = grpc.aio.insecure_channel(owner.grpc_addr)
            try:
                yield owner, a2a_pb2_grpc.A2AServiceStub(channel), b, proxy
            finally:
                await channel.close()
    finally:
        if proxy is not None:
            await proxy.close()


@pytest.mark.parametrize("fault", ["sigstop", "partition"])
async def test_an_owner_out_of_touch_for_part_of_its_lease_keeps_its_tasks(
    nats_url: str, fault: str
) -> None:
    async with (
        asyncio.timeout(45),
        owner_and_survivor(nats_url, partitioned=fault == "partition") as (owner, stub, b, cut),
    ):
        ids, tails = await start_streams([stub], 4, "30 0.05", [stub, b.stub])
        await out_of_touch(owner, cut, 0.5 * LEASE)
        results = await asyncio.gather(*tails)
        recorded = {i: await stored(b.stub, i) for i in ids}
        assert b.service.metrics.tasks_reaped == 0
        assert all(t.status.state == S.TASK_STATE_COMPLETED for t in recorded.values())
        assert_outcomes(results, recorded, [i for i in ids for _ in range(3)])


@pytest.mark.parametrize("fault", ["sigstop", "partition"])
async def test_an_owner_out_of_touch_for_about_its_lease_ends_each_task_one_way_everywhere(
    nats_url: str, fault: str
) -> None:
    async with (
        asyncio.timeout(45),
        owner_and_survivor(nats_url, partitioned=fault == "partition") as (owner, stub, b, cut),
    ):
        ids, tails = await start_streams([stub], 4, "30 0.05", [stub, b.stub])
        await out_of_touch(owner, cut, LEASE)
        results = await asyncio.gather(*tails)
        recorded = {i: await stored(b.stub, i) for i in ids}
        for task_id, task in recorded.items():  # either outcome, but the same everywhere
            assert (await stored(stub, task_id)).status == task.status
        assert_outcomes(results, recorded, [i for i in ids for _ in range(3)])


async def test_an_owner_partitioned_past_its_lease_while_serving_ends_every_stream_failed(
    nats_url: str,
) -> None:
    async with (
        asyncio.timeout(45),
        owner_and_survivor(nats_url, partitioned=True) as (owner, stub, b, cut),
    ):
        ids, tails = await start_streams([stub], 4, "400 0.05", [stub, b.stub])
        await out_of_touch(owner, cut, 2.5 * LEASE)
        results = await asyncio.gather(*tails)
        recorded = {i: await stored(b.stub, i) for i in ids}
        assert all(t.status.state == S.TASK_STATE_FAILED for t in recorded.values())
        assert b.service.metrics.tasks_reaped == len(ids)
        assert_outcomes(results, recorded, [i for i in ids for _ in range(3)])
        for task_id in ids:
            assert (await stored(stub, task_id)).status == recorded[task_id].status


async def out_of_touch(owner: Process, cut: Partition | None, seconds: float) -> None:
    """Take the owner out of touch for ``seconds``: SIGSTOP, or a cut between it and NATS."""
    if cut is not None:
        cut.open.clear()
    else:
        owner.proc.send_signal(signal.SIGSTOP)
    await asyncio.sleep(seconds)  # sync-ok: the fault's length is what is tested
    if cut is not None:
        cut.open.set()
    else:
        owner.proc.send_signal(signal.SIGCONT)


async def test_a_sweep_whose_claim_fails_is_run_again_until_the_lost_owners_task_ends(
    nats_url: str,
) -> None:
    async with (
        owner_process(nats_url, LEASE) as (owner, client),
        asyncio.timeout(30),
        instances(Ticking(), [nats_url], names=("B",), lease=LEASE) as (b,),
    ):
        sender = client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        await anext(sender)  # WORKING: recorded
        relayed = b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        await anext(aiter(relayed))
        lease = b.cluster.lease
        assert lease is not None
        real_claim, failed = lease._claim, asyncio.Event()

        async def claim_failing_once(task_id: str, owner: str, text: str) -> int:
            if not failed.is_set():
                failed.set()
                raise StoreUnavailableError("NATS did not answer (a stand-in)")
            return await real_claim(task_id, owner, text)

        lease._claim = claim_failing_once  # type: ignore[method-assign]
        owner.proc.kill()
        await owner.proc.wait()
        frames, code = await record(relayed)
        assert failed.is_set(), "the first claim failed"
        assert code == grpc.StatusCode.OK
        assert final_status(frames) == S.TASK_STATE_FAILED
        assert (await stored(b.stub, task_id)).status.state == S.TASK_STATE_FAILED

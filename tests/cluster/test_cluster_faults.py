"""Faults in a cluster: an instance killed with SIGKILL, a NATS node killed mid-stream,
an instance shutting down. Real processes, killed by PID."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from a2a.client.errors import A2AClientError
from a2a.client.transports.grpc import GrpcTransport
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)

from tests.support import natsserver
from tests.support.agents import ChunkAgent, FloodAgent, GatedPerTask
from tests.support.clusterharness import collect, instances
from tests.support.harness import V1, last_state, rich_status, send_request
from tests.support.serveproc import owner_process, start

S = TaskState
LEASE = 1.0
SWEEP_LEASE = 2.0
"""A lease long enough that a loaded machine does not miss it by accident."""


async def test_owner_killed_mid_task_every_subscriber_on_the_survivors_ends_failed_in_time(
    nats_url: str,
) -> None:
    async with (
        owner_process(nats_url, LEASE) as (owner, client),
        asyncio.timeout(20),
        instances(GatedPerTask(), [nats_url], names=("B", "C"), lease=LEASE) as (b, c),
    ):
        sender = client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        working = await anext(sender)
        assert working.status_update.status.state == S.TASK_STATE_WORKING
        subs = []
        for instance in (b, c, b):
            sub = instance.client.subscribe(SubscribeToTaskRequest(id=task_id))
            assert (await anext(sub)).task.status.state == S.TASK_STATE_WORKING
            subs.append(sub)
        tails = asyncio.gather(*(collect(s) for s in subs))
        owner.proc.kill()  # SIGKILL: no shutdown, no final frame from the owner
        await owner.proc.wait()
        async with asyncio.timeout(LEASE + 1.0):  # the promise: lease + 1 s
            results = await tails
        for frames in results:
            assert last_state(frames) == S.TASK_STATE_FAILED
            assert "was lost" in frames[-1].status_update.status.message.parts[0].text
        stored = await c.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert stored.status.state == S.TASK_STATE_FAILED
        reaped = b.service.metrics.tasks_reaped + c.service.metrics.tasks_reaped
        assert reaped == 1, "exactly one survivor claims the task"


async def test_an_instance_shutting_down_ends_its_tasks_failed_on_every_instance_at_once(
    nats_url: str,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(20), instances(agent, [nats_url], lease=30.0) as (a, b):
        sender = a.client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        await agent.working(task_id).wait()
        relayed = b.client.subscribe(SubscribeToTaskRequest(id=task_id))
        await anext(relayed)
        tails = asyncio.gather(collect(sender), collect(relayed))
        await a.service.shutdown(grace=0)  # long lease: only the shutdown itself can end it
        from_a, from_b = await tails
        assert last_state(from_a) == last_state(from_b) == S.TASK_STATE_FAILED
        stored = await b.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert stored.status.state == S.TASK_STATE_FAILED


async def test_relayed_streams_of_an_instance_shutting_down_end_unavailable_not_silently(
    nats_url: str,
) -> None:
    agent = GatedPerTask()
    async with asyncio.timeout(20), instances(agent, [nats_url]) as (a, b):
        sender = a.client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        await agent.working(task_id).wait()
        call = b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        await anext(aiter(call))
        await b.service.shutdown(grace=0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await anext(aiter(call))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "resubscribe" in (err.value.details() or "")
        agent.release(task_id)
        assert last_state(await collect(sender)) == S.TASK_STATE_COMPLETED


async def test_losing_a_nats_node_mid_stream_loses_no_task_event_or_final_frame() -> None:
    agent = FloodAgent(count=200, size=64, window=50)
    with natsserver.running(3) as cluster:
        async with (
            asyncio.timeout(50),
            instances(agent, cluster.urls, replicas=3, lease=15.0) as (
                a,
                b,
            ),  # above the failover stall
        ):
            sender = a.client.send_message_streaming(send_request("go"))
            task_id = (await anext(sender)).task.id
            on_a = a.client.subscribe(SubscribeToTaskRequest(id=task_id))
            on_b = b.client.subscribe(SubscribeToTaskRequest(id=task_id))
            await anext(on_a)
            await anext(on_b)
            agent.release.set()
            from_b: list[StreamResponse] = []
            while sum(f.WhichOneof("payload") == "artifact_update" for f in from_b) < 50:
                from_b.append(await anext(on_b))
            connected = a.cluster.conn.nc.connected_url
            assert connected is not None
            victim = next(n for n in cluster.nodes if n.port == connected.port)
            victim.kill()  # the node the owner is connected to
            for _ in range(150):
                agent.credits.release()
            from_sender, from_a, rest_b = await asyncio.gather(
                collect(sender), collect(on_a), collect(on_b)
            )
            from_b += rest_b
            for frames in (from_sender, from_a, from_b):
                artifacts = [f for f in frames if f.WhichOneof("payload") == "artifact_update"]
                assert [f.artifact_update.artifact.artifact_id for f in artifacts] == [
                    f"chunk-{i}" for i in range(200)
                ]
                assert last_state(frames) == S.TASK_STATE_COMPLETED
            stored = await b.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
            assert stored.status.state == S.TASK_STATE_COMPLETED
            assert len(stored.artifacts) == 200


async def test_a_restart_under_the_same_instance_id_ends_what_the_dead_process_left(
    nats_url: str,
) -> None:
    args = ("--agent", "tests.support.agents:Hanging", "--nats", nats_url, "--lease", "60")
    first = await start(*args, "--instance-id", "fixed-id")
    client = GrpcTransport(grpc.aio.insecure_channel(first.grpc_addr), None)
    second = None
    try:
        async with (
            asyncio.timeout(20),
            instances(GatedPerTask(), [nats_url], names=("B",), lease=60) as [b],
        ):
            sender = client.send_message_streaming(send_request("go"))
            task_id = (await anext(sender)).task.id
            await anext(sender)  # WORKING
            relayed = b.client.subscribe(SubscribeToTaskRequest(id=task_id))
            await anext(relayed)
            tail = asyncio.ensure_future(collect(relayed))
            first.proc.kill()
            await first.proc.wait()
            # A 60 s lease would keep the task WORKING; the restart ends it at once.
            second = await start(*args, "--instance-id", "fixed-id")
            frames = await tail
            assert last_state(frames) == S.TASK_STATE_FAILED
            text = frames[-1].status_update.status.message.parts[0].text
            assert text == "instance fixed-id restarted"
    finally:
        await client.close()
        for proc in (first.proc, second.proc if second else None):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_nats_paused_past_the_retry_budget_streams_end_failed_and_the_record_agrees() -> None:
    agent = ChunkAgent(count=0)  # after release: one artifact, then it waits (nothing final)
    with natsserver.running(1) as cluster:
        node = cluster.nodes[0]
        async with (
            asyncio.timeout(40),
            instances(agent, cluster.urls, lease=5.0, retry_for=0.5) as (a, b),
        ):
            sender = a.client.send_message_streaming(send_request("go"))
            task_id = (await anext(sender)).task.id
            assert (await anext(sender)).status_update.status.state == S.TASK_STATE_WORKING
            relayed = b.client.subscribe(SubscribeToTaskRequest(id=task_id))
            await anext(relayed)
            node.pause()
            try:
                agent.release.set()  # its artifact cannot be recorded: the task ends FAILED
                frames = await collect(sender)
                assert last_state(frames) == S.TASK_STATE_FAILED
                assert "could not record" in frames[-1].status_update.status.message.parts[0].text
                # The owner answers with the outcome its streams got, NATS or not.
                seen = await a.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
                assert seen.status.state == S.TASK_STATE_FAILED
            finally:
                node.resume()
            # Once NATS is back, the final state is recorded: everyone agrees.
            await a.service.engine.wait_idle()
            assert last_state(await collect(relayed)) == S.TASK_STATE_FAILED
            for instance in (a, b):
                stored = await instance.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
                assert stored.status.state == S.TASK_STATE_FAILED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await b.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            call = b.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await anext(aiter(call))
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_an_owner_paused_past_its_lease_ends_its_streams_with_the_survivors_outcome(
    nats_url: str,
) -> None:
    async with (
        owner_process(nats_url, LEASE) as (owner, client),
        asyncio.timeout(30),
        instances(GatedPerTask(), [nats_url], names=("B",), lease=LEASE) as (b,),
    ):
        sender = client.send_message_streaming(send_request("go"))
        task_id = (await anext(sender)).task.id
        assert (await anext(sender)).status_update.status.state == S.TASK_STATE_WORKING
        other = client.send_message_streaming(send_request("to cancel"))
        other_id = (await anext(other)).task.id
        relayed = b.client.subscribe(SubscribeToTaskRequest(id=task_id))
        await anext(relayed)
        owner.proc.send_signal(signal.SIGSTOP)
        try:
            # A routed cancel answers within the client's deadline, and says the
            # owner may still act on it (not that it is unavailable).
            request = CancelTaskRequest(id=other_id)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await b.stub.CancelTask(request, metadata=V1, timeout=1.0)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert rich_status(caught.value)[1].reason == "OWNER_TIMEOUT"
            # Past the lease, the survivor ends the tasks FAILED.
            from_b = await collect(relayed)
            assert last_state(from_b) == S.TASK_STATE_FAILED
            lost = from_b[-1].status_update.status.message.parts[0].text
            assert "was lost" in lost
        finally:
            owner.proc.send_signal(signal.SIGCONT)
        # Resumed, the owner does not overwrite that outcome: its own streams get
        # it, the one of a task nothing happened to since included.
        for stream in (sender, other):
            from_owner = [f async for f in stream]
            assert last_state(from_owner) == S.TASK_STATE_FAILED
            assert from_owner[-1].status_update.status.message.parts[0].text == lost
        stored = await b.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert stored.status.state == S.TASK_STATE_FAILED
        assert stored.status.message.parts[0].text == lost
        owner.proc.send_signal(signal.SIGTERM)
        assert await owner.proc.wait() == 0


async def test_nats_killed_and_restarted_mid_stream_loses_no_event_or_final_frame() -> None:
    agent = FloodAgent(count=120, size=64, window=40)
    with natsserver.running(1) as cluster:
        node = cluster.nodes[0]
        async with asyncio.timeout(60), instances(agent, cluster.urls, lease=15.0) as (a, b):
            sender = a.client.send_message_streaming(send_request("go"))
            task_id = (await anext(sender)).task.id
            on_b = b.client.subscribe(SubscribeToTaskRequest(id=task_id))
            await anext(on_b)
            agent.release.set()
            from_sender: list[StreamResponse] = []
            while sum(f.WhichOneof("payload") == "artifact_update" for f in from_sender) < 40:
                from_sender.append(await anext(sender))
            node.kill()  # SIGKILL: every instance loses its connection and its writes wait
            node.start()  # same port, same store: JetStream recovers the stream
            for _ in range(80):
                agent.credits.release()
            rest, from_b = await asyncio.gather(collect(sender), collect(on_b))
            from_sender += rest
            for frames in (from_sender, from_b):
                artifacts = [f for f in frames if f.WhichOneof("payload") == "artifact_update"]
                ids = [f.artifact_update.artifact.artifact_id for f in artifacts]
                assert ids == [f"chunk-{i}" for i in range(120)], "each once, in order"
                assert last_state(frames) == S.TASK_STATE_COMPLETED
            stored = await b.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
            assert stored.status.state == S.TASK_STATE_COMPLETED
            assert len(stored.artifacts) == 120


async def test_a_relaying_instance_killed_leaves_the_task_and_its_other_streams_whole(
    nats_url: str,
) -> None:
    relay = await start("--nats", nats_url, "--lease", str(LEASE))
    relay_client = GrpcTransport(grpc.aio.insecure_channel(relay.grpc_addr), None)
    agent = GatedPerTask()
    try:
        async with (
            asyncio.timeout(20),
            instances(agent, [nats_url], names=("A",), lease=LEASE) as (a,),
        ):
            sender = a.client.send_message_streaming(send_request("go"))
            task_id = (await anext(sender)).task.id
            await agent.working(task_id).wait()
            relayed = relay_client.subscribe(SubscribeToTaskRequest(id=task_id))
            await anext(relayed)
            relay.proc.kill()  # SIGKILL the instance relaying the task
            await relay.proc.wait()
            with pytest.raises(A2AClientError):
                await collect(relayed)  # its client learns the stream broke (not an outcome)
            # The owner is unaffected: its streams end with the outcome, the store agrees.
            agent.release(task_id)
            assert last_state(await collect(sender)) == S.TASK_STATE_COMPLETED
            stored = await a.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
            assert stored.status.state == S.TASK_STATE_COMPLETED
            assert a.service.engine.tasks.count == 0
    finally:
        await relay_client.close()
        if relay.proc.returncode is None:
            relay.proc.kill()
            await relay.proc.wait()


async def test_a_long_sweep_never_holds_up_the_survivors_heartbeat(nats_url: str) -> None:
    async with (
        owner_process(nats_url, SWEEP_LEASE) as (owner, client),
        asyncio.timeout(30),
        instances(GatedPerTask(), [nats_url], names=("B", "C"), lease=SWEEP_LEASE) as (b, c),
    ):
        sender = client.send_message_streaming(send_request("go"))
        await anext(sender)
        await anext(sender)  # WORKING: the task is recorded
        lease = b.cluster.lease
        assert lease is not None
        claiming, gate = asyncio.Event(), asyncio.Event()
        real_claim = lease._claim

        async def slow_claim(task_id: str, owner: str, text: str) -> int:
            # A stand-in for a sweep with thousands of tasks to claim.
            claiming.set()
            await gate.wait()
            return await real_claim(task_id, owner, text)

        lease._claim = slow_claim  # type: ignore[method-assign]
        owner.proc.kill()
        await owner.proc.wait()
        await claiming.wait()  # B's sweep is under way, and stays so
        # Without a heartbeat for a lease, C would take B for lost.
        await asyncio.sleep(1.5 * SWEEP_LEASE)  # sync-ok: time passing is what is tested
        c_lease = c.cluster.lease
        assert c_lease is not None
        assert b.instance_id in c_lease.live(), "B kept heartbeating while it swept"
        gate.set()

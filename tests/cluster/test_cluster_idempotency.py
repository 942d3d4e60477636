"""Idempotent SendMessage across a cluster on a real nats-server: a retry through another
instance runs nothing again (the message id is claimed in JetStream), blocking and
streaming, and a reused id with another body is refused there too."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from a2a.types.a2a_pb2 import StreamResponse, TaskState

from a2a_grpc_server._internal.model import generation
from tests.support.agents import CountingAgent, HeldFollowUpAgent, InputAgent
from tests.support.clusterharness import instances
from tests.support.harness import KEYED, copy, rich_status, send_request

S = TaskState


async def test_a_send_retried_through_another_instance_runs_once(nats_url: str) -> None:
    agent = CountingAgent()
    async with asyncio.timeout(30), instances(agent, [nats_url]) as (a, b):
        request = send_request("book it")
        cut = a.stub.SendMessage(copy(request), metadata=KEYED)
        await agent.started.wait()
        cut.cancel()  # the first attempt's connection broke; the mesh retries elsewhere
        with pytest.raises(asyncio.CancelledError):
            await cut
        retry = asyncio.ensure_future(b.stub.SendMessage(copy(request), metadata=KEYED))
        stream = b.stub.SendStreamingMessage(copy(request), metadata=KEYED)
        first: StreamResponse = await stream.read()
        agent.gate.set()
        task = (await retry).task
        assert task.status.state == S.TASK_STATE_COMPLETED and first.task.id == task.id
        frames = []
        while (frame := await stream.read()) is not grpc.aio.EOF:
            assert isinstance(frame, StreamResponse)
            frames.append(frame)
        assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        assert agent.runs == [request.message.message_id]
        other = copy(request)
        other.message.parts[0].text = "something else"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await a.stub.SendMessage(other, metadata=KEYED)
        assert rich_status(caught.value)[1].reason == "MESSAGE_ID_REUSED"


async def test_a_follow_up_retried_through_another_instance_is_run_once(nats_url: str) -> None:
    async with asyncio.timeout(30), instances(InputAgent(), [nats_url]) as (a, b):
        task = (await a.stub.SendMessage(send_request("hi"), metadata=KEYED)).task
        follow_up = send_request("ada", task_id=task.id)
        done = (await b.stub.SendMessage(copy(follow_up), metadata=KEYED)).task
        again = (await a.stub.SendMessage(copy(follow_up), metadata=KEYED)).task
        assert done.status.state == again.status.state == S.TASK_STATE_COMPLETED
        ids = [m.message_id for m in again.history]
        assert ids.count(follow_up.message.message_id) == 1


async def test_a_routed_follow_up_retried_before_its_run_says_anything_waits_for_it(
    nats_url: str,
) -> None:
    """The retry finds the message recorded and the task still waiting from before it: it
    waits for the message's outcome instead of answering the stale INPUT_REQUIRED."""
    agent = HeldFollowUpAgent()
    async with asyncio.timeout(30), instances(agent, [nats_url]) as (a, b):
        task = (await a.stub.SendMessage(send_request("hi"), metadata=KEYED)).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        follow_up = send_request("held", task_id=task.id)
        first = asyncio.ensure_future(b.stub.SendMessage(copy(follow_up), metadata=KEYED))
        await agent.holding.wait()  # (its message recorded, its run silent)
        retry = asyncio.ensure_future(b.stub.SendMessage(copy(follow_up), metadata=KEYED))
        stream = b.stub.SendStreamingMessage(copy(follow_up), metadata=KEYED)
        snapshot: StreamResponse = await stream.read()
        assert snapshot.task.id == task.id
        agent.go.set()
        answers = [(await first).task, (await retry).task]
        assert [t.status.state for t in answers] == [S.TASK_STATE_COMPLETED] * 2
        last = None
        while (frame := await stream.read()) is not grpc.aio.EOF:
            assert isinstance(frame, StreamResponse)
            last = frame
        assert last is not None and last.status_update.status.state == S.TASK_STATE_COMPLETED


async def test_a_generation_mismatch_through_another_instance_is_aborted_with_its_facts(
    nats_url: str,
) -> None:
    async with asyncio.timeout(30), instances(InputAgent(), [nats_url]) as (a, b):
        task = (await a.stub.SendMessage(send_request("hi"), metadata=KEYED)).task
        current = generation.generation_of(task)
        assert current is not None
        follow_up = send_request("ada", task_id=task.id)
        follow_up.configuration.MergeFromString(bytes([5 << 3]) + bytes([current + 5]))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await b.stub.SendMessage(follow_up, metadata=KEYED)  # (routed to its owner, a)
        assert caught.value.code() == grpc.StatusCode.ABORTED
        info = rich_status(caught.value)[1]
        assert info.reason == "TASK_GENERATION_MISMATCH"
        assert info.metadata["currentGeneration"] == str(current)
        assert info.metadata["expectedGeneration"] == str(current + 5)

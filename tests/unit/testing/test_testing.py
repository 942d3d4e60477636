"""The public ``a2a_grpc_server.testing`` module, used as an embedder's tests would."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
from a2a.types.a2a_pb2 import GetTaskRequest, TaskState

from a2a_grpc_server.agents.echo import EchoAgent
from a2a_grpc_server.testing import (
    assert_nothing_left,
    leftover_tasks,
    nats_server,
    running_server,
)
from tests.support.agents import GatedAgent
from tests.support.harness import send_request


async def test_running_server_serves_the_agent_and_leaves_nothing() -> None:
    async with asyncio.timeout(20), running_server(EchoAgent(), http=True) as server:
        answer = await server.stub.SendMessage(send_request("hello"), metadata=server.metadata)
        assert answer.task.status.state == TaskState.TASK_STATE_COMPLETED
        got = await server.stub.GetTask(GetTaskRequest(id=answer.task.id), metadata=server.metadata)
        assert got.id == answer.task.id
        assert server.card_url is not None
        async with aiohttp.ClientSession() as session, session.get(server.card_url) as card:
            assert (await card.json())["supportedInterfaces"][0]["url"] == server.address
    assert not leftover_tasks(), "nothing of the server outlives the block"


async def test_two_running_servers_share_a_local_nats_server() -> None:
    with nats_server() as nats:
        async with (
            asyncio.timeout(40),
            running_server(EchoAgent(), nats_url=nats.urls[0]) as a,
            running_server(EchoAgent(), nats_url=nats.urls[0]) as b,
        ):
            answer = await a.stub.SendMessage(send_request("hi"), metadata=a.metadata)
            got = await b.stub.GetTask(GetTaskRequest(id=answer.task.id), metadata=b.metadata)
            assert got.status.state == TaskState.TASK_STATE_COMPLETED


async def test_the_leak_check_names_a_stream_left_open_and_passes_once_it_ended() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(20), running_server(agent) as server:
        stream = server.stub.SendStreamingMessage(send_request("go"), metadata=server.metadata)
        await stream.read()  # the task: its run and this stream are alive now
        with pytest.raises(AssertionError, match="coroutines of ours still alive"):
            assert_nothing_left()
        assert leftover_tasks(), "the run and the stream are ours"
        agent.release.set()
        while await stream.read() is not grpc.aio.EOF:
            pass
        await server.server.service.wait_idle()
        assert_nothing_left()

"""The public ``a2a_grpc_server.testing`` module, used as an embedder's tests would."""

from __future__ import annotations

import asyncio

import aiohttp
from a2a.types.a2a_pb2 import GetTaskRequest, TaskState

from a2a_grpc_server.agents.echo import EchoAgent
from a2a_grpc_server.testing import nats_server, running_server

from .harness import our_tasks, send_request


async def test_running_server_serves_the_agent_and_leaves_nothing() -> None:
    async with asyncio.timeout(20), running_server(EchoAgent(), http=True) as server:
        answer = await server.stub.SendMessage(send_request("hello"), metadata=server.metadata)
        assert answer.task.status.state == TaskState.TASK_STATE_COMPLETED
        got = await server.stub.GetTask(GetTaskRequest(id=answer.task.id), metadata=server.metadata)
        assert got.id == answer.task.id
        assert server.card_url is not None
        async with aiohttp.ClientSession() as session, session.get(server.card_url) as card:
            assert (await card.json())["supportedInterfaces"][0]["url"] == server.address
    assert not our_tasks(), "nothing of the server outlives the block"


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

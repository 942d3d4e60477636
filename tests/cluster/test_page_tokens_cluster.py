"""ListTasks page tokens in a cluster on a real nats-server: every instance derives their
key from the cluster key, so a listing continues through another instance; another
caller's token is refused there too."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from a2a.types.a2a_pb2 import ListTasksRequest

from tests.support.agents import CountingAgent
from tests.support.clusterharness import instances
from tests.support.harness import V1, send_request


async def test_a_listing_continues_through_another_instance(nats_url: str) -> None:
    agent = CountingAgent()
    agent.gate.set()
    async with asyncio.timeout(30), instances(agent, [nats_url]) as (a, b):
        sent = set()
        for n in range(3):
            request = send_request(f"task {n}")
            request.tenant = "pages"
            sent.add((await a.stub.SendMessage(request, metadata=V1)).task.id)
        listed: list[str] = []
        token = ""
        for stub in (a.stub, b.stub, a.stub):  # (three pages of one task, alternating)
            page = await stub.ListTasks(
                ListTasksRequest(tenant="pages", page_size=1, page_token=token), metadata=V1
            )
            listed += [t.id for t in page.tasks]
            token = page.next_page_token
        assert set(listed) == sent and len(listed) == 3 and not token
        first = await b.stub.ListTasks(ListTasksRequest(tenant="pages", page_size=1), metadata=V1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # (another scope: another tenant)
            await a.stub.ListTasks(
                ListTasksRequest(tenant="other", page_size=1, page_token=first.next_page_token),
                metadata=V1,
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

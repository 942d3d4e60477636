"""ListTasks page tokens over gRPC: good for the caller they were issued to, on the server
that issued them; a changed one, another caller's, one of an unknown format, or one from
another process (its key is not this one's) is INVALID_ARGUMENT naming ``page_token``."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import grpc
import pytest
from a2a.types.a2a_pb2 import ListTasksRequest
from google.rpc import error_details_pb2

from tests.support.agents import CountingAgent
from tests.support.harness import ALICE, BOB, Harness, rich_status, send_request, serve, tokens


async def refused(h: Harness, token: str, metadata: tuple[tuple[str, str], ...]) -> str:
    """The message ListTasks with ``token`` is refused with (INVALID_ARGUMENT, page_token)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await h.stub.ListTasks(ListTasksRequest(page_size=1, page_token=token), metadata=metadata)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, info = rich_status(caught.value)
    bad = error_details_pb2.BadRequest()
    assert any(detail.Unpack(bad) for detail in status.details)
    assert info.reason == "INVALID_PARAMS" and bad.field_violations[0].field == "page_token"
    assert "omit page_token" in status.message, "it says what to do"
    return status.message


async def test_a_page_token_opens_for_its_caller_only_and_unchanged(tmp_path: Path) -> None:
    agent = CountingAgent()
    agent.gate.set()
    auth = tokens(tmp_path)
    async with asyncio.timeout(30), serve(agent, auth=auth) as h:
        for n in range(3):
            await h.stub.SendMessage(send_request(f"task {n}"), metadata=ALICE)
        first = await h.stub.ListTasks(ListTasksRequest(page_size=1), metadata=ALICE)
        token = first.next_page_token
        second = await h.stub.ListTasks(
            ListTasksRequest(page_size=1, page_token=token), metadata=ALICE
        )
        assert second.tasks[0].id != first.tasks[0].id
        assert "not issued" in await refused(h, token, BOB)
        data = bytearray(base64.urlsafe_b64decode(token))
        for at in (0, 1, 5, len(data) - 1):  # version, key id, nonce, tag
            changed = bytearray(data)
            changed[at] ^= 0x01
            await refused(h, base64.urlsafe_b64encode(changed).decode(), ALICE)
        async with serve(agent, auth=auth) as restarted:  # (another process: another key)
            await refused(restarted, token, ALICE)

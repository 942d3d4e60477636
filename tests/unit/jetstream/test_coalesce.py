"""Writes to NATS coalesced under load (``jetstream.coalesce``), on a real nats-server.

A request published while ``AWAITED`` replies or more are awaited for requests already
written waits for the next reply (or ``HOLD``) and goes out with whatever else was
published meanwhile; otherwise it goes out at once. Nothing is lost or reordered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from nats.aio.msg import Msg

from a2a_grpc_server.jetstream.coalesce import AWAITED, CoalescingClient
from a2a_grpc_server.jetstream.requests import EXPECT, JetStreamRequests
from tests.support import natsserver

STREAM = "COALESCE"


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[tuple[CoalescingClient, JetStreamRequests]]:
    """A coalescing client and its requests; a stream on ``co.>``, deleted after."""
    nc = CoalescingClient()
    await nc.connect(servers=[nats_url])
    js = nc.jetstream()
    await js.add_stream(name=STREAM, subjects=["co.>"])
    requests = JetStreamRequests(nc)
    await requests.start()
    try:
        yield nc, requests
    finally:
        await requests.close()
        await js.delete_stream(STREAM)
        await nc.close()


def count_writes(nc: CoalescingClient) -> list[int]:
    """A counter of the socket writes nats-py's flusher makes from now on."""
    writes = [0]
    transport: Any = nc._transport
    write = transport.writelines

    def counted(payload: Any) -> None:
        writes[0] += 1
        write(payload)

    transport.writelines = counted
    return writes


async def test_a_lone_request_is_written_at_once(
    client: tuple[CoalescingClient, JetStreamRequests],
) -> None:
    nc, requests = client
    async with asyncio.timeout(5):
        assert await requests.publish("co.lone", b"x", {}, 5.0) == 1
        assert await requests.publish("co.lone", b"y", {EXPECT: "1"}, 5.0) == 2
    assert nc.held == 0


async def test_requests_made_while_others_await_replies_go_out_together(
    client: tuple[CoalescingClient, JetStreamRequests],
) -> None:
    nc, requests = client
    writers, each = 16, 25
    writes = count_writes(nc)

    async def writer(w: int) -> None:
        # Each publish a compare-and-set on the last one: a reordered or lost
        # message would fail the next.
        for i in range(each):
            seq = await requests.publish(f"co.w{w}", str(i).encode(), {EXPECT: last[w]}, 5.0)
            last[w] = str(seq)

    last = ["0"] * writers
    async with asyncio.timeout(20):
        await asyncio.gather(*(writer(w) for w in range(writers)))
    info = await nc.jetstream().stream_info(STREAM)
    assert info.state.messages == writers * each
    assert nc.held > 0
    assert writes[0] < writers * each  # (one write per message without coalescing)


async def test_a_write_waiting_for_a_reply_that_does_not_come_goes_out_after_the_hold(
    client: tuple[CoalescingClient, JetStreamRequests],
) -> None:
    nc, requests = client
    received: asyncio.Queue[Msg] = asyncio.Queue()

    async def silent(msg: Msg) -> None:  # (a responder that never answers)
        received.put_nowait(msg)

    sub = await nc.subscribe("silent.request", cb=silent)
    unanswered = [
        asyncio.ensure_future(requests.publish("silent.request", b"?", {}, 30.0))
        for _ in range(AWAITED)
    ]
    try:
        async with asyncio.timeout(5):
            for _ in unanswered:
                await received.get()  # (written, and awaited from now on)
            assert await requests.publish("co.after", b"x", {}, 5.0) == 1
        assert nc.held == 1
        assert not any(request.done() for request in unanswered)
    finally:
        for request in unanswered:
            request.cancel()
        for request in unanswered:
            with pytest.raises(asyncio.CancelledError):
                await request
        await sub.unsubscribe()


async def test_a_write_waits_for_no_company_while_fewer_replies_are_awaited(
    client: tuple[CoalescingClient, JetStreamRequests],
) -> None:
    nc, requests = client
    received: asyncio.Queue[Msg] = asyncio.Queue()

    async def silent(msg: Msg) -> None:
        received.put_nowait(msg)

    sub = await nc.subscribe("silent.request", cb=silent)
    unanswered = [
        asyncio.ensure_future(requests.publish("silent.request", b"?", {}, 30.0))
        for _ in range(AWAITED - 1)
    ]
    try:
        async with asyncio.timeout(5):
            for _ in unanswered:
                await received.get()
            assert await requests.publish("co.alone", b"x", {}, 5.0) == 1
        assert nc.held == 0
    finally:
        for request in unanswered:
            request.cancel()
        for request in unanswered:
            with pytest.raises(asyncio.CancelledError):
                await request
        await sub.unsubscribe()

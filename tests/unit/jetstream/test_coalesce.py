"""Writes to NATS coalesced under load (``jetstream.coalesce``), on a real nats-server.

A publish made while ``AWAITED`` requests or more are written and unanswered waits in
the client's buffer for the next reply (or ``HOLD``) and goes out with whatever else was
published meanwhile; otherwise it goes out at once, as does anything a PING follows.
The requests here are answered by a responder on a second connection, told when to.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from a2a_grpc_server.jetstream import coalesce
from a2a_grpc_server.jetstream.coalesce import AWAITED, CoalescingClient
from a2a_grpc_server.jetstream.requests import EXPECT, JetStreamRequests
from a2a_grpc_server.testing.nats import Cluster
from tests.support import natsserver

STREAM = "COALESCE"
WITHIN = 10.0


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with natsserver.running(1) as nats:
        yield nats


@dataclass
class Setup:
    """The client under test, its requests, and a responder and probe on another connection."""

    nc: CoalescingClient
    requests: JetStreamRequests
    other: Client
    asked: asyncio.Queue[Msg] = field(default_factory=asyncio.Queue)
    probed: asyncio.Queue[Msg] = field(default_factory=asyncio.Queue)
    reconnected: asyncio.Event = field(default_factory=asyncio.Event)

    def ask(self, count: int) -> list[asyncio.Future[int]]:
        """``count`` requests the responder holds until answered (``answer``)."""
        return [
            asyncio.ensure_future(self.requests.publish("ask", b"?", {}, 30.0))
            for _ in range(count)
        ]

    async def asked_all(self, count: int) -> list[Msg]:
        """The responder's ``count`` requests, once they reached it (written, unanswered)."""
        return [await self.asked.get() for _ in range(count)]

    @contextlib.asynccontextmanager
    async def unanswered(
        self, count: int
    ) -> AsyncIterator[tuple[list[asyncio.Future[int]], list[Msg]]]:
        """``count`` requests written and held unanswered (and the responder's copies),
        cancelled after."""
        requests = self.ask(count)
        try:
            async with asyncio.timeout(WITHIN):
                asked = await self.asked_all(count)
            yield requests, asked
        finally:
            await finish(requests)

    async def answer(self, msg: Msg) -> None:
        """Answer one request as JetStream answers a publish."""
        await self.other.publish(msg.reply, b'{"stream":"COALESCE","seq":1}')


@pytest.fixture
async def setup(cluster: Cluster) -> AsyncIterator[Setup]:
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    async def on_error(exc: Exception) -> None:  # (the reconnect test's disconnection)
        pass

    nc = CoalescingClient()
    await nc.connect(
        servers=cluster.urls,
        reconnect_time_wait=1,  # (with max_reconnect_attempts, never more than one)
        max_reconnect_attempts=-1,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )
    other = Client()
    await other.connect(servers=cluster.urls, max_reconnect_attempts=-1, error_cb=on_error)
    await nc.jetstream().add_stream(name=STREAM, subjects=["co.>"])
    requests = JetStreamRequests(nc)
    await requests.start()
    s = Setup(nc, requests, other, reconnected=reconnected)

    async def asked(msg: Msg) -> None:
        s.asked.put_nowait(msg)

    async def probed(msg: Msg) -> None:
        s.probed.put_nowait(msg)

    await other.subscribe("ask", cb=asked)
    await other.subscribe("probe", cb=probed)
    await other.flush()
    try:
        yield s
    finally:
        await requests.close()
        await other.close()
        await nc.close()


def record_writes(nc: CoalescingClient) -> list[bytes]:
    """What nats-py writes to the socket from now on, one item per write."""
    writes: list[bytes] = []
    transport: Any = nc._transport
    write, writelines = transport.write, transport.writelines

    def one(payload: bytes) -> None:
        writes.append(bytes(payload))
        write(payload)

    def several(payload: list[bytes]) -> None:
        writes.append(b"".join(payload))
        writelines(payload)

    transport.write, transport.writelines = one, several
    return writes


async def finish(requests: list[asyncio.Future[int]]) -> None:
    for request in requests:
        request.cancel()
    await asyncio.gather(*requests, return_exceptions=True)


async def test_a_lone_request_is_written_at_once(setup: Setup) -> None:
    async with asyncio.timeout(WITHIN):
        assert await setup.requests.publish("co.lone", b"x", {}, 5.0) == 1
        assert await setup.requests.publish("co.lone", b"y", {EXPECT: "1"}, 5.0) == 2
    assert setup.nc.held == 0
    assert (setup.nc.unanswered, setup.nc.queued) == (0, 0)


async def test_a_write_waits_for_the_next_reply_and_what_its_requester_sends_next(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coalesce, "HOLD", WITHIN)  # (only a reply ends this hold)
    nc = setup.nc
    writes = record_writes(nc)

    async def then_more() -> int:
        seq = await setup.requests.publish("ask", b"?", {}, 30.0)
        await nc.publish("probe", b"next")  # (what the reply's requester sends next)
        return seq

    requests = [asyncio.ensure_future(then_more()), *setup.ask(AWAITED - 1)]
    try:
        async with asyncio.timeout(WITHIN):
            asked = await setup.asked_all(AWAITED)
            await nc.publish("probe", b"held")
            assert nc.held == 1
            assert nc._pending_data_size > 0  # (still in the client's buffer)
            await setup.answer(asked[0])  # (then_more's: published, so written, first)
            assert [(await setup.probed.get()).data for _ in range(2)] == [b"held", b"next"]
            assert await requests[0] == 1
        assert nc.joined == 1  # (the reply ended the hold, not the timer)
        assert sum(b"held" in w for w in writes) == 1
        assert any(b"held" in w and b"next" in w for w in writes)  # (one write for both)
    finally:
        await finish(requests)


async def test_a_write_goes_out_after_the_hold_if_no_reply_comes(setup: Setup) -> None:
    nc = setup.nc
    async with setup.unanswered(AWAITED) as (requests, _):
        await nc.publish("probe", b"held")
        async with asyncio.timeout(WITHIN):
            assert (await setup.probed.get()).data == b"held"
        assert (nc.held, nc.joined) == (1, 0)
        assert not any(request.done() for request in requests)


async def test_a_write_waits_for_nothing_while_fewer_requests_are_unanswered(
    setup: Setup,
) -> None:
    async with setup.unanswered(AWAITED - 1):
        await setup.nc.publish("probe", b"at once")
        async with asyncio.timeout(WITHIN):
            assert (await setup.probed.get()).data == b"at once"
        assert setup.nc.held == 0


async def test_a_reply_counts_when_it_comes_not_when_its_requester_resumes(
    setup: Setup,
) -> None:
    # Replies read together wake their requesters in a later pass of the loop: counted
    # unanswered until then, they held the requesters' next writes for nothing.
    nc = setup.nc
    seen: list[tuple[int, bool]] = []
    answered = nc.answered
    async with setup.unanswered(AWAITED) as (requests, asked):

        def counting() -> None:
            answered()
            seen.append((nc.unanswered, any(request.done() for request in requests)))

        nc.answered = counting  # type: ignore[method-assign]
        async with asyncio.timeout(WITHIN):
            for msg in asked:
                await setup.answer(msg)
            await asyncio.gather(*requests)
        assert seen[-1] == (0, False)


async def test_flush_writes_what_is_held_before_its_ping(setup: Setup) -> None:
    nc = setup.nc
    async with setup.unanswered(AWAITED):
        writes = record_writes(nc)
        await nc.publish("probe", b"before the ping")
        assert nc.held == 1
        async with asyncio.timeout(WITHIN):
            await nc.flush()
            assert (await setup.probed.get()).data == b"before the ping"
        held = next(i for i, w in enumerate(writes) if b"before the ping" in w)
        ping = next(i for i, w in enumerate(writes) if w.startswith(b"PING"))
        assert held < ping  # (so the PONG answers after the server read it)


async def test_nothing_is_held_for_requests_written_before_a_reconnect(
    setup: Setup, cluster: Cluster
) -> None:
    nc = setup.nc
    async with setup.unanswered(AWAITED) as (requests, _):  # (never to be answered)
        node = cluster.nodes[0]
        node.kill()
        node.start()
        async with asyncio.timeout(WITHIN):
            await setup.reconnected.wait()
            assert await setup.requests.publish("co.after", b"x", {}, 5.0) >= 1
        assert nc.held == 0
        assert not any(request.done() for request in requests)


async def test_a_held_write_goes_out_even_if_the_flusher_is_gone(setup: Setup) -> None:
    nc = setup.nc
    async with setup.unanswered(AWAITED):
        flusher = nc._flusher_task
        assert flusher is not None
        flusher.cancel()
        await asyncio.gather(flusher, return_exceptions=True)
        await nc.publish("probe", b"inline")
        async with asyncio.timeout(WITHIN):
            assert (await setup.probed.get()).data == b"inline"


async def test_writers_in_step_lose_and_reorder_nothing(setup: Setup) -> None:
    writers, each = 16, 25
    last = ["0"] * writers

    async def writer(w: int) -> None:
        # Each publish a compare-and-set on the last: a reordered or lost one fails the next.
        for i in range(each):
            seq = await setup.requests.publish(f"co.w{w}", str(i).encode(), {EXPECT: last[w]}, 5.0)
            last[w] = str(seq)

    async with asyncio.timeout(WITHIN * 2):
        await asyncio.gather(*(writer(w) for w in range(writers)))
    info = await setup.nc.jetstream().stream_info(STREAM)
    assert info.state.messages == writers * each
    assert (setup.nc.unanswered, setup.nc.queued) == (0, 0)


def test_the_installed_nats_py_has_every_hook_it_overrides() -> None:
    assert coalesce.why_not() is None
    for name in coalesce.HOOKS:
        assert name in vars(CoalescingClient)  # (each one it overrides is checked)


@pytest.mark.parametrize("version", ["2.15.0", "2.17.0", "3.0.1", "next"])
def test_a_nats_py_outside_the_tested_range_is_not_coalesced(version: str) -> None:
    why = coalesce.why_not(version)
    assert why is not None and version in why


def test_the_client_is_plain_when_asked_or_when_nats_py_lacks_a_hook(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from a2a_grpc_server.jetstream import conn
    from a2a_grpc_server.jetstream.natsconfig import NatsConfig

    assert type(conn._client(NatsConfig())) is CoalescingClient
    assert type(conn._client(NatsConfig(coalesce_writes=False))) is Client
    assert not caplog.records
    # (a nats-py without one of the hooks cannot be installed beside this one: hidden)
    monkeypatch.delattr(Client, "_send_ping")
    assert type(conn._client(NatsConfig())) is Client
    [warning] = caplog.records
    assert warning.levelname == "WARNING" and "_send_ping" in warning.getMessage()

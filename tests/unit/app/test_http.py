"""The HTTP side (aiohttp) under slow, oversized and too many connections: others are served."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from a2a_grpc_server._internal.app.http import Fixed, HttpServer, Live, Route

ROUTES: dict[str, Route] = {
    "/card": Fixed(b'{"name": "x"}', "application/json"),
    "/metrics": Live(lambda: b"up 1\n", "text/plain; version=0.0.4"),
}


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[HttpServer]:
    options = getattr(request, "param", {})
    running = HttpServer(ROUTES, "127.0.0.1", 0, **options)
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


async def get(port: int, head: str) -> tuple[int, bytes]:
    """Send ``head`` on a new connection; the status and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode())
        raw = await reader.read()
    finally:
        writer.close()
    if not raw:
        return 0, b""  # closed without an answer
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def request(path: str, method: str = "GET", extra: str = "") -> str:
    return f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{extra}\r\n"


async def test_documents_methods_and_paths(server: HttpServer) -> None:
    async with asyncio.timeout(10):
        assert await get(server.port, request("/card")) == (200, b'{"name": "x"}')
        assert await get(server.port, request("/card", "HEAD")) == (200, b"")
        assert await get(server.port, request("/metrics")) == (200, b"up 1\n")
        assert (await get(server.port, request("/nope")))[0] == 404
        assert (await get(server.port, request("/card", "POST")))[0] == 405


@pytest.mark.parametrize("server", [{"request_timeout": 0.5}], indirect=True)
async def test_a_slow_request_costs_only_its_connection(server: HttpServer) -> None:
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /card HTTP/1.1\r\nHost: t\r\n")  # ... and never the end of the head
        assert await get(server.port, request("/card")) == (200, b'{"name": "x"}')
        assert await reader.read() == b"", "closed once its time for a request head ran out"
        writer.close()


async def test_oversized_heads_are_refused_and_others_served(server: HttpServer) -> None:
    async with asyncio.timeout(10):
        huge = "X-Big: " + "b" * 20_000 + "\r\n"
        assert (await get(server.port, request("/card", extra=huge)))[0] == 400
        many = "".join(f"X-H{i}: v\r\n" for i in range(200))
        assert (await get(server.port, request("/card", extra=many)))[0] in (400, 431)
        assert (await get(server.port, "GET /" + "p" * 20_000 + " HTTP/1.1\r\n\r\n"))[0] in (
            400,
            414,
        )
        assert await get(server.port, request("/card")) == (200, b'{"name": "x"}')


@pytest.mark.parametrize("server", [{"max_connections": 3}], indirect=True)
async def test_at_the_budget_the_quietest_connection_makes_room(server: HttpServer) -> None:
    # One client holding idle connections used to lock everyone else out (issue 22).
    async with asyncio.timeout(10):
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        assert await get(server.port, request("/card")) == (200, b'{"name": "x"}')
        reads = [asyncio.ensure_future(r.read()) for r, _ in idle]
        done, pending = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
        assert reads[0] in done and reads[0].result() == b"", "the quietest one made room"
        for read in pending:
            read.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for _, w in idle:
            w.close()


@pytest.mark.parametrize("server", [{"max_per_peer": 3}], indirect=True)
async def test_one_peer_holds_at_most_its_share_of_connections(server: HttpServer) -> None:
    async with asyncio.timeout(10):
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await reader.read() == b"", "the peer's fourth connection is closed at once"
        writer.close()
        _, first = held.pop()
        first.close()
        await first.wait_closed()
        # The server learns of the close as its loop reads it; each attempt is a round trip.
        statuses = []
        for _ in range(20):
            statuses.append((await get(server.port, request("/card")))[0])
            if statuses[-1] == 200:
                break
        assert statuses[-1] == 200 and set(statuses) <= {0, 200}, statuses
        for _, w in held:
            w.close()


async def test_malformed_requests_do_not_flood_the_log(
    server: HttpServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with asyncio.timeout(10):
        for _ in range(20):
            assert (await get(server.port, "NOT HTTP AT ALL\r\n\r\n"))[0] in (0, 400)
        assert await get(server.port, request("/card")) == (200, b'{"name": "x"}')
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [], [r.getMessage() for r in errors]
    lines = [r for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    assert len(lines) <= 1, "at most one line per 10 s"

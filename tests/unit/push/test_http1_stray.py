"""A stray answer on a kept webhook connection is never read as the next request's (issue 42, 6).

HTTP/1.1 answers carry no request id: an answer that arrives on a kept connection with no
request outstanding would be taken for the answer to whatever is sent on it next, which may
be another config's frame on the same host:port. Real TCP peers on 127.0.0.1 send one.
"""

from __future__ import annotations

import asyncio

from tests.unit.push.test_http1 import OK, Peer, peer, pool, post, read_request

BUSY = b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n"


async def test_a_stray_answer_that_came_while_idle_is_not_the_next_requests_answer() -> None:
    go, written = asyncio.Event(), asyncio.Event()

    async def stray_after_the_first(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer
    ) -> None:
        await read_request(reader, p)
        if len(p.requests) == 1:
            writer.write(OK)
            await writer.drain()
            await go.wait()
            writer.write(OK)  # an answer to nothing
            await writer.drain()
            written.set()
            await read_request(reader, p)
        writer.write(BUSY)  # (every later request is refused)
        await writer.drain()

    client = pool()
    async with peer(stray_after_the_first) as seen:
        assert await post(client, seen) == 204
        go.set()
        await written.wait()
        # The stray is on the socket; the client's loop has not read it yet.
        assert await post(client, seen, "/other") == 503, "the stray 204 was taken for its answer"
        client.close()


async def test_a_connection_that_answered_an_error_is_not_kept() -> None:
    # A stray sent after an error answer can arrive after the next request went out on the
    # same connection: indistinguishable then. Such a connection carries nothing more.
    second = asyncio.Event()

    async def busy_then_stray(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer
    ) -> None:
        await read_request(reader, p)
        writer.write(BUSY)
        await writer.drain()
        await read_request(reader, p)  # only if the connection was kept
        second.set()
        writer.write(OK + BUSY)  # the stray arrives first, then the real answer

    client = pool()
    async with peer(busy_then_stray) as seen:
        assert await post(client, seen) == 503
        assert await post(client, seen, "/other") == 503
        assert seen.connections == 2 and not second.is_set()
        client.close()

"""The webhook client (``push.http1``) against real TCP peers on 127.0.0.1 that answer byte
for byte what each test scripts: what it sends, which answers keep the connection and which
close it, every malformed answer refused with the connection closed, the stale kept
connection retried once, and the pool's bounds (connections open, idle time)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from a2a_grpc_server._internal.push.http1 import (
    MAX_BODY,
    MAX_HEAD,
    MAX_HEADER_LINES,
    MAX_INFORMATIONAL,
    Http1Pool,
    Key,
    ProtocolError,
)
from tests.support.webhook import bare_http

Speak = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Peer"], Awaitable[None]]


@dataclass
class Peer:
    """What the scripted server saw."""

    port: int = 0
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set each time a connection's client side closed it (EOF seen)."""

    @property
    def key(self) -> Key:
        return ("127.0.0.1", self.port, None)


async def read_request(reader: asyncio.StreamReader, peer: Peer) -> bytes:
    """One request, head and body; recorded."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    request = head + await reader.readexactly(length)
    peer.requests.append(request)
    return request


@contextlib.asynccontextmanager
async def peer(speak: Speak) -> AsyncIterator[Peer]:
    """A TCP server on 127.0.0.1 whose connections ``speak`` serves (``bare_http``)."""
    seen = Peer()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        seen.open_now += 1
        seen.most_open = max(seen.most_open, seen.open_now)
        try:
            await speak(reader, writer, seen)
            await reader.read()  # (until the client closes)
        finally:
            seen.open_now -= 1
            seen.closed.set()

    async with bare_http(serve) as port:
        seen.port = port
        async with asyncio.timeout(20):
            yield seen


async def until(seen: Peer, done: Callable[[], bool]) -> None:
    """Wait until ``done()`` holds, checked each time one of ``seen``'s connections closes."""
    async with asyncio.timeout(5):
        while not done():
            seen.closed.clear()
            if done():
                break
            await seen.closed.wait()


def answering(*answers: bytes) -> Speak:
    """Each request on a connection gets the next answer (the same list per connection)."""

    async def speak(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Peer) -> None:
        for answer in answers:
            await read_request(reader, seen)
            writer.write(answer)
            await writer.drain()

    return speak


def pool(max_connections: int = 4, idle_for: float = 15.0) -> Http1Pool:
    return Http1Pool(ssl.create_default_context(), max_connections, "test/1", idle_for)


async def post(client: Http1Pool, seen: Peer, path: str = "/hook") -> int:
    answer = await client.post(seen.key, f"127.0.0.1:{seen.port}", path, {"X-A": "1"}, b"{}")
    return answer.status


OK = b"HTTP/1.1 204 No Content\r\n\r\n"


async def test_a_post_is_one_plain_request_and_kept_answers_reuse_one_connection() -> None:
    answers = (
        OK,
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 503 Busy\r\nRetry-After: 7\r\ncontent-length: 0\r\n\r\n",
    )
    client = pool()
    async with peer(answering(*answers)) as seen:
        assert await post(client, seen) == 204
        answer = await client.post(seen.key, "h.example:8443", "/a/b?c=1", {}, b"x" * 10)
        assert answer.status == 200
        assert await post(client, seen) == 200
        assert (client.open, client.idle) == (1, 1)
        answer = await client.post(seen.key, "h", "/", {}, b"")
        assert (answer.status, answer.retry_after) == (503, "7")
        assert seen.connections == 1
        assert (client.open, client.idle) == (0, 0), "an answer that is not 2xx is not kept"
        assert seen.requests[0] == (
            b"POST /hook HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUser-Agent: test/1\r\nX-A: 1\r\n"
            b"Content-Length: 2\r\n\r\n{}" % seen.port
        )
        assert seen.requests[1].startswith(b"POST /a/b?c=1 HTTP/1.1\r\nHost: h.example:8443\r\n")
        assert seen.requests[1].endswith(b"Content-Length: 10\r\n\r\n" + b"x" * 10)
        client.close()
        async with asyncio.timeout(5):
            await seen.closed.wait()
        assert (client.open, client.idle) == (0, 0)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\nread until close",
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1),
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA",
    ],
    ids=["chunked", "until-close", "past-max-body", "connection-close", "http-1.0", "extra"],
)
async def test_an_answer_whose_end_is_not_a_short_length_is_decided_by_its_head_then_closed(
    answer: bytes,
) -> None:
    client = pool()
    async with peer(answering(answer, answer)) as seen:
        assert await post(client, seen) == 200
        async with asyncio.timeout(5):
            await seen.closed.wait()  # the client closed it, the body unread
        assert (client.open, client.idle) == (0, 0)
        assert await post(client, seen) == 200
        assert seen.connections == 2


async def test_informational_answers_are_skipped_and_an_answer_may_come_a_byte_at_a_time() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + OK

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer) -> None:
        for _ in range(2):
            await read_request(reader, p)
            for byte in answer:
                writer.write(bytes([byte]))
                await writer.drain()

    client = pool()
    async with peer(trickle) as seen:
        assert await post(client, seen) == 204
        assert await post(client, seen) == 204
        assert seen.connections == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X-Pad: y\r\n" * (MAX_HEADER_LINES + 1) + b"\r\n",
        b"HTTP/1.1 200 OK\r\nX-Pad: " + b"y" * MAX_HEAD + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Pad: " + b"y" * (MAX_HEAD + 10),  # (no end in sight)
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" * (MAX_INFORMATIONAL + 1) + OK,
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",  # (bare LF line ends)
        # (a bare LF, a bare CR, a NUL in a value: "Connection: close" hidden in one)
        b"HTTP/1.1 200 OK\r\nX: a\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\rb\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 0\r\n\r\n",
    ],
)
async def test_a_malformed_answer_is_a_protocol_error_and_its_connection_is_closed(
    answer: bytes,
) -> None:
    client = pool()
    async with peer(answering(answer)) as seen:
        with pytest.raises(ProtocolError):
            await post(client, seen)
        async with asyncio.timeout(5):
            await seen.closed.wait()
        assert (client.open, client.idle) == (0, 0)


async def test_an_answer_with_no_request_outstanding_closes_the_idle_connection() -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer) -> None:
        await read_request(reader, p)
        writer.write(OK + OK)  # one answer too many

    client = pool()
    async with peer(chatty) as seen:
        assert await post(client, seen) == 204
        async with asyncio.timeout(5):
            await seen.closed.wait()
        assert (client.open, client.idle) == (0, 0)


async def test_a_kept_connection_closed_before_any_answer_is_retried_once_on_a_new_one() -> None:
    async def then_silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer
    ) -> None:
        await read_request(reader, p)
        if p.connections == 1:
            writer.write(OK)
            await writer.drain()
            await read_request(reader, p)  # the second request: closed unanswered
            writer.transport.abort()
        else:
            writer.write(OK)

    client = pool()
    async with peer(then_silent) as seen:
        assert await post(client, seen) == 204
        assert await post(client, seen) == 204
        assert seen.connections == 2
        assert len(seen.requests) == 3, "the unanswered request was sent again (at least once)"


async def test_a_new_connection_closed_before_any_answer_is_an_error_not_retried() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer) -> None:
        await read_request(reader, p)
        writer.transport.abort()

    client = pool()
    async with peer(silent) as seen:
        with pytest.raises(ConnectionError):
            await post(client, seen)
        assert seen.connections == 1
        assert (client.open, client.idle) == (0, 0)


async def test_a_post_cut_short_closes_its_connection() -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer) -> None:
        await read_request(reader, p)
        writer.write(b"HTTP/1.1 200 OK\r\n")  # and no more

    client = pool()
    async with peer(hold) as seen:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await post(client, seen)
        async with asyncio.timeout(5):
            await seen.closed.wait()
        assert (client.open, client.idle) == (0, 0)


async def test_connections_open_at_once_are_bounded_and_the_oldest_idle_one_makes_room() -> None:
    release, both_in = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer) -> None:
        while True:
            await read_request(reader, p)
            if len(p.requests) == 2:
                both_in.set()
            await release.wait()
            writer.write(OK)
            await writer.drain()

    client = pool(max_connections=2)
    async with peer(slow) as seen, peer(answering(OK)) as other:
        posts = [asyncio.ensure_future(post(client, seen)) for _ in range(6)]
        await both_in.wait()
        assert (seen.connections, client.open) == (2, 2), "the other four wait for a connection"
        release.set()
        assert await asyncio.gather(*posts) == [204] * 6
        assert (seen.most_open, client.open, client.idle) == (2, 2, 2)
        assert await post(client, other) == 204  # another peer: an idle one closes first
        assert client.open == 2
        await until(seen, lambda: seen.open_now == 1)


async def test_an_idle_connection_is_closed_after_its_idle_time() -> None:
    client = pool(idle_for=0.2)
    async with peer(answering(OK)) as seen:
        assert await post(client, seen) == 204
        assert client.idle == 1
        async with asyncio.timeout(5):
            await seen.closed.wait()  # the pool closed it, idle too long
        assert (client.open, client.idle) == (0, 0)


async def test_a_connection_its_peer_closed_is_not_used_again() -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer) -> None:
        await read_request(reader, p)
        writer.write(OK)
        await writer.drain()
        writer.close()

    client = pool()
    async with peer(once) as seen:
        assert await post(client, seen) == 204
        await until(seen, lambda: seen.open_now == 0)
        assert await post(client, seen) == 204  # (noticed, or found stale and retried)
        assert (seen.connections, len(seen.requests)) == (2, 2)
        assert client.open <= 1, "(the second, closed as it answered, may be noticed at once)"


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/a b", {}),
        ("/a\r\nX-Evil: 1", {}),
        ("no-slash", {}),
        ("/ok", {"X-A2A-Notification-Token": "t\r\nX-Evil: 1"}),
        ("/ok", {"Authorization": "Bearer a\nb"}),
        ("/ok", {"X-A": "nul\x00"}),
    ],
)
async def test_a_request_that_would_split_is_refused_before_anything_is_sent(
    path: str, headers: dict[str, str]
) -> None:
    client = pool()
    async with peer(answering(OK)) as seen:
        with pytest.raises(ValueError, match=r"request target|header holds"):
            await client.post(seen.key, "h", path, headers, b"{}")
        assert seen.connections == 0


async def test_a_closed_pool_refuses_and_keeps_nothing() -> None:
    client = pool()
    async with peer(answering(OK, OK)) as seen:
        assert await post(client, seen) == 204
        client.close()
        with pytest.raises(RuntimeError):
            await post(client, seen)
        assert (client.open, client.idle) == (0, 0)


def test_the_client_runs_on_uvloop_too() -> None:
    """``serve`` runs on uvloop where it is installed (its transports are not asyncio's)."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        client = pool()
        async with peer(answering(OK, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")) as seen:
            assert await post(client, seen) == 204
            assert await post(client, seen) == 200
            assert (seen.connections, client.open, client.idle) == (1, 1, 1)
        async with peer(answering(b"SSH-2.0-x\r\n\r\n")) as seen:
            with pytest.raises(ProtocolError):
                await post(client, seen)
        client.close()

    uvloop.run(scenario())


@contextlib.asynccontextmanager
async def narrow_peer(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[Key]:
    """A TCP server on 127.0.0.1 whose connections take 4 KiB at a time; yields its key."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    server = await asyncio.start_server(serve, sock=listener)
    try:
        yield ("127.0.0.1", listener.getsockname()[1], None)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_post_cut_short_with_its_body_unsent_leaves_no_socket_behind() -> None:
    """A receiver that stopped reading a large request: the socket of the POST cut short goes
    at once, not once the rest of the body is written (never, if the receiver never reads)."""
    body = b"x" * (8 * 1024 * 1024)
    resume: asyncio.Event = asyncio.Event()
    ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        total = 0
        try:
            await reader.readuntil(b"\r\n\r\n")
            await resume.wait()  # reads nothing more until the client gave up
            while chunk := await reader.read(1 << 16):
                total += len(chunk)
        except ConnectionError:
            pass
        finally:
            ended.set_result(total)
            writer.close()

    client = pool()
    async with narrow_peer(serve) as key:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await client.post(key, "h", "/", {}, body)
        assert client.open == 0
        resume.set()
        async with asyncio.timeout(10):
            received = await ended
        assert received < len(body), "the rest of the body was not sent after the cut"


async def test_an_answer_that_comes_before_the_whole_request_was_sent_does_not_keep_it() -> None:
    """The rest of the request would go out ahead of the next one on that connection."""
    body = b"x" * (8 * 1024 * 1024)
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")  # before the body
            await writer.drain()
            while await reader.read(1 << 16):
                pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    client = pool()
    async with narrow_peer(serve) as key, asyncio.timeout(10):
        assert (await client.post(key, "h", "/", {}, body)).status == 200
        assert (client.open, client.idle) == (0, 0), "not kept with its body unsent"
        assert (await client.post(key, "h", "/", {}, b"{}")).status == 200
        client.close()
    assert connections == 2


async def test_closing_the_pool_stops_the_requests_waiting_for_a_connection() -> None:
    release, first_in = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Peer) -> None:
        await read_request(reader, p)
        first_in.set()
        await release.wait()
        writer.write(OK)
        await writer.drain()

    client = pool(max_connections=1)
    async with peer(slow) as seen:
        first = asyncio.ensure_future(post(client, seen))
        await first_in.wait()
        waiting = asyncio.ensure_future(post(client, seen))
        await asyncio.sleep(0)  # sync-ok: lets the second request reach the pool's queue
        client.close()
        release.set()
        assert await first == 204
        with pytest.raises(RuntimeError, match="closed"):
            await waiting
        assert (seen.connections, client.open) == (1, 0)

"""A lean HTTP/1.1 client for webhook POSTs, on an ``asyncio.Protocol``, with a bounded pool.

A webhook POST needs little of HTTP: one request, then the answer's status
and ``Retry-After``. aiohttp's client spent 134 to 141 us of this process's
CPU per POST here (its request and response objects, a task per request
body, its connector's bookkeeping); this client does the same POST for about
60 % of that, most of the rest being the socket write itself (``python -m
bench.posts``; docs/decisions/0003-own-http1-webhook-client.md).

What it sends: ``POST <path> HTTP/1.1``, the caller's headers, ``Content-Length``,
then the body, in one write.

What it reads, strictly (a receiver's answer is untrusted input):

* a status line ``HTTP/1.0`` or ``HTTP/1.1``, a three-digit status, a reason;
* header lines ``name: value``, CRLF-terminated (no bare CR or LF, no NUL in
  a value), at most ``MAX_HEAD`` bytes and ``MAX_HEADER_LINES`` lines in all;
  informational (1xx) answers before the real one are skipped, at most
  ``MAX_INFORMATIONAL`` of them;
* the body only when the answer says its length (one ``Content-Length``, equal
  values if repeated) and it is at most ``MAX_BODY`` bytes: it is read and
  dropped, and the connection is kept (a 2xx answer, HTTP/1.1, no
  ``Connection: close``). A 2xx answer with no body (204) is kept too. Any
  other answer (a chunked or close-delimited body, a longer one) is decided by
  its status line and headers and its connection closed unread.

A stray answer, one with no request outstanding, must never be read as the
answer to the next request sent on its connection (HTTP/1.1 answers carry no
request id, and that request may be another webhook's on the same host and
port). So a connection is kept only after a 2xx answer (one that is not 2xx
closes it: a stray after it cannot arrive once its next request went out), and
a kept connection is used again only if nothing arrived on its socket
meanwhile (one ``poll`` just before the request is written: the event loop
may not have read a stray yet). A stray that reaches a kept connection after
its next request was written is not told apart; docs/how-to/push.md says so.

Anything else (not HTTP, a head past its bounds, a malformed header line,
lengths that disagree, data with no request outstanding) raises
``ProtocolError`` and closes the connection.

The pool keys connections by address, port and TLS server name. It holds at
most ``max_connections`` open, busy and idle together (a new one closes the
least recently used idle one first); an idle connection is closed after
``IDLE_FOR`` seconds (``idle_for``), or as soon as its peer closes it. A request on a kept
connection that the peer closed before any byte of the answer arrived is
sent once more on a new connection (a receiver drops a repeated sequence
number: delivery is at least once anyway).

Who runs what: everything runs on the event loop of the first request (a
pool serves one loop); ``data_received`` and ``connection_lost`` only parse
and wake the request waiting on the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import select
import ssl
from collections import OrderedDict
from dataclasses import dataclass
from typing import cast

MAX_HEAD = 16 * 1024
"""Most bytes of an answer's status line and headers (each answer, 1xx ones too)."""
MAX_HEADER_LINES = 100
"""Most header lines of one answer."""
MAX_BODY = 64 * 1024
"""Longest answer body read (and dropped) to keep the connection; a longer one closes it."""
MAX_INFORMATIONAL = 8
"""Most informational (1xx) answers skipped before the real one."""
IDLE_FOR = 15.0
"""Seconds an idle connection is kept."""

_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_FORBIDDEN_IN_HEADER = re.compile(r"[\r\n\x00]")
_FORBIDDEN_IN_ANSWER = re.compile(rb"[\r\n\x00]")
"""What no line of an answer's head may hold (RFC 9110 5.5: a bare CR or LF, a NUL)."""
_REQUEST_TARGET = re.compile(r"/[\x21-\x7e]*")


class ProtocolError(Exception):
    """The peer's answer is not HTTP/1.x this client reads (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What a POST was answered.

    Attributes:
        status: The HTTP status.
        retry_after: The ``Retry-After`` header's value (None: absent).
    """

    status: int
    retry_after: str | None


Key = tuple[str, int, str | None]
"""(address, port, TLS server name or None for http)."""


class Http1Pool:
    """POSTs over kept HTTP/1.1 connections (see the module docstring).

    Args:
        tls: The TLS context for https (certificate and host name verified).
        max_connections: Most connections open at once, busy and idle together.
        user_agent: The ``User-Agent`` header.
        idle_for: Seconds an idle connection is kept.
    """

    def __init__(
        self,
        tls: ssl.SSLContext,
        max_connections: int,
        user_agent: str,
        idle_for: float = IDLE_FOR,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._tls = tls
        self._idle_for = idle_for
        self._max = max_connections
        self._user_agent = _header_line("User-Agent", user_agent)
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: OrderedDict[_Connection, None] = OrderedDict()
        """Idle connections, least recently used first."""
        self._idle_by_key: dict[Key, list[_Connection]] = {}
        self._open = 0
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def open(self) -> int:
        """Connections open (busy and idle)."""
        return self._open

    @property
    def idle(self) -> int:
        """Idle connections kept."""
        return len(self._idle)

    async def post(
        self,
        key: Key,
        host: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
    ) -> Answer:
        """POST ``body`` to ``path`` at ``key``'s address; return the answer's status.

        Not bounded in time here: the caller bounds the whole call (its
        ``asyncio.timeout``), and a call cut short closes its connection.

        Args:
            key: Address, port and TLS server name (None: plain http).
            host: The ``Host`` header.
            path: The request target (``/...``, visible ASCII).
            headers: More headers (their values must not hold CR, LF or NUL).
            body: The request body.

        Raises:
            ValueError: A header or the path the request cannot carry (not worth retrying).
            ProtocolError: The answer is not HTTP this client reads.
            OSError: Connecting, TLS, or the connection failed (``ConnectionError``
                when it closed before the answer ended).
            RuntimeError: The pool is closed.
        """
        if _REQUEST_TARGET.fullmatch(path) is None:
            raise ValueError(f"the request target {path[:80]!r} is not /-rooted visible ASCII")
        lines = [f"POST {path} HTTP/1.1\r\n".encode(), _header_line("Host", host), self._user_agent]
        lines += [_header_line(name, value) for name, value in headers.items()]
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        request = b"".join(lines) + body
        self._bind()
        async with self._slots:
            if self._closed:
                raise RuntimeError("the webhook client is closed")
            connection = self._take(key)
            if connection is not None:
                try:
                    return await self._exchange(connection, request)
                except ConnectionError:
                    if connection.got_bytes:
                        raise
                    # The peer closed the kept connection before answering: try a new one.
            connection = await self._connect(key)
            return await self._exchange(connection, request)

    async def _exchange(self, connection: _Connection, request: bytes) -> Answer:
        try:
            answer = await connection.send(request)
        except BaseException:
            self._drop(connection)  # (cut short, or failed: its state is unknown)
            raise
        if connection.reusable and not self._closed and connection.loop is self._loop:
            self._keep(connection)
        else:
            self._drop(connection)
        return answer

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("the webhook client is closed")
        if self._loop is not loop:  # (a pool serves one loop: the last one's idle sockets go)
            for connection in self._idle:
                with contextlib.suppress(RuntimeError):  # (its loop may be closed)
                    connection.close()
            self._loop = loop
            self._slots = asyncio.Semaphore(self._max)
            self._idle.clear()
            self._idle_by_key.clear()
            self._open = 0
            self._sweep = None

    def _take(self, key: Key) -> _Connection | None:
        """An idle connection to ``key``, the most recently used, or None."""
        kept = self._idle_by_key.get(key)
        while kept:
            connection = kept.pop()
            del self._idle[connection]
            if not kept:
                del self._idle_by_key[key]
            if connection.usable:
                return connection
            self._drop(connection)
        return None

    async def _connect(self, key: Key) -> _Connection:
        while self._open >= self._max and self._idle:  # make room: the least recently used goes
            oldest = next(iter(self._idle))
            self._forget_idle(oldest)
            self._drop(oldest)
        address, port, server_name = key
        loop = asyncio.get_running_loop()
        connection = _Connection(self, key, loop)
        self._open += 1
        connection.counted = True
        try:
            if server_name is None:
                await loop.create_connection(lambda: connection, address, port)
            else:
                await loop.create_connection(
                    lambda: connection, address, port, ssl=self._tls, server_hostname=server_name
                )
        except BaseException:
            self._drop(connection)
            raise
        return connection

    def _keep(self, connection: _Connection) -> None:
        loop = asyncio.get_running_loop()
        connection.idle_since = loop.time()
        self._idle[connection] = None
        self._idle_by_key.setdefault(connection.key, []).append(connection)
        if self._sweep is None:
            self._sweep = loop.call_later(self._idle_for, self._expire)

    def _forget_idle(self, connection: _Connection) -> None:
        if connection in self._idle:
            del self._idle[connection]
            kept = self._idle_by_key[connection.key]
            kept.remove(connection)
            if not kept:
                del self._idle_by_key[connection.key]

    def _drop(self, connection: _Connection) -> None:
        """Close a connection not (or no longer) in the idle set."""
        connection.close()
        if connection.counted:
            connection.counted = False
            self._open -= 1

    def lost_idle(self, connection: _Connection) -> None:
        """The peer closed an idle connection: it leaves the pool."""
        if connection in self._idle:
            self._forget_idle(connection)
            self._drop(connection)

    def _expire(self) -> None:
        self._sweep = None
        loop = self._loop
        if loop is None or self._closed:
            return
        old = loop.time() - self._idle_for
        for connection in list(self._idle):
            if connection.idle_since > old:
                break  # (least recently used first: the rest are younger)
            self._forget_idle(connection)
            self._drop(connection)
        if self._idle:
            first = next(iter(self._idle))
            self._sweep = loop.call_at(first.idle_since + self._idle_for, self._expire)

    def close(self) -> None:
        """Close every idle connection; busy ones close as their requests end."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._idle):
            self._forget_idle(connection)
            self._drop(connection)


def _header_line(name: str, value: str) -> bytes:
    """One header line, CRLF-terminated, UTF-8.

    Raises:
        ValueError: The value holds CR, LF or NUL (it would split the request).
    """
    if _FORBIDDEN_IN_HEADER.search(value) is not None:
        raise ValueError(f"the {name} header holds a line break or NUL")
    return f"{name}: {value}\r\n".encode()


def _readable(transport: asyncio.BaseTransport) -> bool:
    """Whether the connection's socket has bytes (or its end) the event loop has not read."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


_HEAD, _BODY, _DONE = 0, 1, 2


class _Connection(asyncio.Protocol):
    """One connection: one request at a time, its answer parsed as it arrives."""

    def __init__(self, pool: Http1Pool, key: Key, loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.key, self.loop = pool, key, loop
        self.transport: asyncio.Transport | None = None
        self.counted = False
        """Counted in the pool's open connections."""
        self.idle_since = 0.0
        self.got_bytes = False
        """Some of the current answer arrived."""
        self.reusable = False
        """The last answer ended cleanly and the connection may carry another request."""
        self._lost = False
        self._waiter: asyncio.Future[Answer] | None = None
        self._buffer = bytearray()
        self._state = _DONE
        self._remaining = 0
        self._scanned = 0
        """Bytes of the buffer already searched for the head's end."""
        self._keep_after = False
        """Whether the connection is kept once the body is read."""
        self._informational = 0
        self._answer: Answer | None = None

    @property
    def usable(self) -> bool:
        """Whether it may carry a request.

        It is open, nothing of the last request is left unsent, and nothing
        arrived on it unasked (see the module docstring).
        """
        transport = self.transport
        return (
            not self._lost
            and transport is not None
            and not transport.is_closing()
            and not transport.get_write_buffer_size()
            and not _readable(transport)
        )

    async def send(self, request: bytes) -> Answer:
        """Write one request and wait for its answer."""
        transport = self.transport
        if transport is None or self._lost:
            raise ConnectionError("the connection is closed")
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        self._buffer.clear()
        self._scanned = 0
        self._state = _HEAD
        self._informational = 0
        self.got_bytes = False
        self.reusable = False
        transport.write(request)
        try:
            return await waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        """Close the connection at once (a pending request fails).

        Aborted, not closed gently: a gentle close waits until unsent bytes are
        written (forever, if the peer stopped reading) or, for TLS, for the
        peer's shutdown, and the socket would outlive the pool's count of it.
        """
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport instances, but behave as one)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done() or self._state == _DONE:
            self._fail(ProtocolError("the peer sent data with no request outstanding"))
            return
        self.got_bytes = True
        try:
            if self._state == _BODY:
                self._body(data)
            else:
                self._buffer += data
                self._head()
        except ProtocolError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # (close: a half-closed connection carries no more answers)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.reusable = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            error = ConnectionError(
                "the connection closed before the answer ended"
                + (f" ({type(exc).__name__}: {exc})" if exc is not None else "")
            )
            waiter.set_exception(error)
        elif self._waiter is None:
            self.pool.lost_idle(self)

    # parsing

    def _head(self) -> None:
        while self._state == _HEAD:
            buffer = self._buffer
            start = max(0, self._scanned - 3)  # (only what came since the last look)
            end = buffer.find(b"\r\n\r\n", start)
            if end < 0:
                if len(buffer) > MAX_HEAD:
                    raise ProtocolError(f"an answer's head is longer than {MAX_HEAD} bytes")
                if buffer.find(b"\n\n", start) >= 0:  # (never in a head of CRLF lines)
                    raise ProtocolError("an answer's head has lines that do not end in CRLF")
                self._scanned = len(buffer)
                return
            self._scanned = 0
            if end > MAX_HEAD:
                raise ProtocolError(f"an answer's head is longer than {MAX_HEAD} bytes")
            head = bytes(buffer[:end])
            del buffer[: end + 4]
            self._parse(head)
        if self._state == _BODY and self._buffer:
            rest = bytes(self._buffer)
            self._buffer.clear()
            self._body(rest)
        elif self._state == _DONE and self._buffer:
            self.reusable = False  # (more than one answer: not this connection's to keep)

    def _parse(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status_line = _STATUS_LINE.fullmatch(lines[0])
        if status_line is None:
            raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        if len(lines) - 1 > MAX_HEADER_LINES:
            raise ProtocolError(f"an answer has more than {MAX_HEADER_LINES} header lines")
        status = int(status_line[2])
        length: bytes | None = None
        chunked = close = False
        retry_after: str | None = None
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or _TOKEN.fullmatch(name) is None or _FORBIDDEN_IN_ANSWER.search(value):
                raise ProtocolError(f"a malformed header line: {line[:80]!r}")
            value = value.strip(b" \t")
            lowered = name.lower()
            if lowered == b"content-length":
                for each in value.split(b","):
                    each = each.strip(b" \t")
                    if _DIGITS.fullmatch(each) is None or (length is not None and each != length):
                        raise ProtocolError(f"a bad or conflicting Content-Length: {value[:40]!r}")
                    length = each
            elif lowered == b"transfer-encoding":
                chunked = True  # (whatever it names, the body's end is not a length)
            elif lowered == b"connection":
                close = close or any(t.strip().lower() == b"close" for t in value.split(b","))
            elif lowered == b"retry-after":
                retry_after = value.decode("latin-1")
        if 100 <= status < 200:
            if status == 101:
                raise ProtocolError("the peer switched protocols, which was not asked")
            self._informational += 1
            if self._informational > MAX_INFORMATIONAL:
                raise ProtocolError(f"more than {MAX_INFORMATIONAL} informational answers")
            return  # (the real answer follows)
        # (not 2xx: not kept, so no stray answer after it is read as another request's)
        keep = status_line[1] == b"1" and not close and 200 <= status < 300
        self._answer = Answer(status, retry_after)
        if status in (204, 304):
            self._finish(keep)
        elif chunked or length is None or int(length) > MAX_BODY:
            self._finish(False)  # (its end is not known or too far: decided by the head)
        else:
            self._remaining = int(length)
            self._state = _BODY
            self._keep_after = keep
            if not self._remaining:
                self._finish(keep)

    def _body(self, data: bytes) -> None:
        if len(data) > self._remaining:
            self._remaining = 0
            self._keep_after = False  # (bytes past the answer: not this connection's to keep)
        else:
            self._remaining -= len(data)
        if not self._remaining:
            self._finish(self._keep_after)

    def _finish(self, keep: bool) -> None:
        self._state = _DONE
        # (an answer that came before the whole request was written: not kept, as the
        # rest of the request would go out ahead of the next one)
        self.reusable = keep and self.usable
        waiter, answer = self._waiter, self._answer
        if waiter is not None and not waiter.done() and answer is not None:
            waiter.set_result(answer)

    def _fail(self, exc: Exception) -> None:
        self._state = _DONE
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

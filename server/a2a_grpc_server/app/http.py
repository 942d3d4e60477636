"""The HTTP side beside the gRPC service, on aiohttp: the agent card and the metrics.

Serves GET/HEAD of fixed paths: the agent card at
``/.well-known/agent-card.json`` (``Cache-Control``, ``Last-Modified``,
``ETag``; 304 on ``If-None-Match`` / ``If-Modified-Since``) and the metrics
at ``/metrics`` (never cached). Anything else is 404, other methods 405.

Bounds: at most ``MAX_CONNECTIONS`` connections, and ``MAX_PER_PEER`` of
one peer (an IPv4 address, or an IPv6 /64: one host's addresses; its next
connection is closed at once); at the budget, a new connection makes an
idle one close (no request in progress: the quietest idle connection of the
peer holding the most), so no client holding connections open can lock the
others out of the card and the metrics; with none idle, the new one is
closed. A connection gets
``REQUEST_TIMEOUT`` seconds to send its first request head and may stay idle
that long between requests; request lines and headers are limited by
aiohttp (8 KiB each, 128 headers: 400 past them); no request may carry a
body. A slow or oversized request costs its own connection only, and a
malformed one a DEBUG line at most every 10 s (aiohttp's own ERROR line with
a traceback, per request, is held back: any client could flood the log).

Who runs what: aiohttp runs one task per connection on the server's event
loop; ``stop()`` closes the listener and the open connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate, parsedate_to_datetime
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..errors import RateLimitedLog

MAX_CONNECTIONS = 256
MAX_PER_PEER = 32
"""Connections one peer address may hold open at once."""
REQUEST_TIMEOUT = 10.0

logger = logging.getLogger(__name__)
_malformed_log = RateLimitedLog(logger, logging.DEBUG, period=10.0)


class _HoldBackRequestErrors(logging.Filter):
    """Each unparsable request: a rate-limited DEBUG line, not aiohttp's ERROR and traceback.

    A handler's own error (a bug) is left alone: it stays an ERROR.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):  # (a handler's own error stays an ERROR)
            _malformed_log.log("malformed HTTP request: %s", exc)
            return False
        return True


_HOLD_BACK = _HoldBackRequestErrors()


@dataclass(slots=True)
class _Connection:
    peer: str
    timer: asyncio.TimerHandle | None
    """Closes it unless its first request head arrives in time (None once it did)."""
    last: float
    """When it last received data (monotonic)."""
    busy: bool = False
    """A request is in progress on it (from its first bytes to its handler's end)."""


@dataclass(frozen=True, slots=True)
class Fixed:
    """A document that never changes while the server runs (cacheable)."""

    body: bytes
    content_type: str
    max_age: int = 300


@dataclass(frozen=True, slots=True)
class Live:
    """A document rendered on every request (not cacheable)."""

    render: Callable[[], bytes]
    content_type: str


Route = Fixed | Live
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpServer:
    """Serves ``routes`` (path -> document) on one address.

    Args:
        routes: The documents, by path.
        host: Address to bind.
        port: Port to bind (0 for any free port).
        tls: Serve https with this context.
        max_connections: Most connections open at once.
        request_timeout: Seconds a connection gets for its first request head,
            and may stay idle between requests.
        max_per_peer: Most connections of one peer address.
    """

    def __init__(
        self,
        routes: dict[str, Route],
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
        max_per_peer: int = MAX_PER_PEER,
    ) -> None:
        self._host, self._port, self._tls = host, port, tls
        self._most, self._timeout, self._per_peer_most = (
            max_connections,
            request_timeout,
            max_per_peer,
        )
        logging.getLogger("aiohttp.server").addFilter(_HOLD_BACK)  # (once: filters are a set)
        self._modified = int(time.time())
        app = web.Application(client_max_size=1024, middlewares=[self._started])
        for path, doc in routes.items():
            app.router.add_get(path, self._fixed(doc) if isinstance(doc, Fixed) else _live(doc))
        self._runner = web.AppRunner(
            app, access_log=None, keepalive_timeout=request_timeout, handle_signals=False
        )
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.BaseTransport, _Connection] = {}
        self._per_peer: Counter[str] = Counter()

    @property
    def port(self) -> int:
        """The bound port (after ``start``)."""
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        """Bind and start serving.

        Raises:
            OSError: The address could not be bound.
        """
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._protocol,
                self._host,
                self._port,
                ssl=self._tls,
                # A handshake is not a connection yet (see _Bounded): bound it too.
                ssl_handshake_timeout=self._timeout if self._tls is not None else None,
            )
        except OSError:
            await self._runner.cleanup()
            raise

    async def stop(self) -> None:
        """Stop listening and end open connections."""
        if self._server is None:
            return
        self._server.close()
        for transport in list(self._connections):
            transport.close()
        await self._runner.cleanup()
        with contextlib.suppress(TimeoutError):  # a TLS peer that never answers the close
            async with asyncio.timeout(1.0):
                await self._server.wait_closed()

    def _protocol(self) -> asyncio.BaseProtocol:
        """A connection's protocol: aiohttp's, bounded (see the module docstring)."""
        handler: Any = self._runner.server
        assert handler is not None
        return _Bounded(handler(), self)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Count a new connection in, shedding the quietest one at the budget; or refuse it."""
        peer = _peer(transport)
        if self._per_peer[peer] >= self._per_peer_most:
            return False
        if len(self._connections) >= self._most:
            shed = self._idlest()
            if shed is None:
                return False
            if isinstance(shed, asyncio.WriteTransport):
                shed.abort()  # (not close: a peer that never reads would keep it open)
            else:
                shed.close()
            self.forget(shed)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self._timeout, transport.close)
        self._connections[transport] = _Connection(peer, timer, loop.time())
        self._per_peer[peer] += 1
        return True

    def _idlest(self) -> asyncio.BaseTransport | None:
        """The connection to shed for a new one: the quietest idle one of the busiest peer."""
        idle = [(t, c) for t, c in self._connections.items() if not c.busy]
        if not idle:
            return None
        transport, _ = min(idle, key=lambda tc: (-self._per_peer[tc[1].peer], tc[1].last))
        return transport

    def heard(self, transport: asyncio.BaseTransport) -> None:
        """Data arrived on a connection (a request is in progress)."""
        known = self._connections.get(transport)
        if known is not None:
            known.last = asyncio.get_running_loop().time()
            known.busy = True

    def forget(self, transport: asyncio.BaseTransport) -> None:
        """A connection closed (or was shed)."""
        known = self._connections.pop(transport, None)
        if known is None:
            return
        if known.timer is not None:
            known.timer.cancel()
        self._per_peer[known.peer] -= 1
        if not self._per_peer[known.peer]:
            del self._per_peer[known.peer]

    @web.middleware
    async def _started(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A request head arrived in time: its connection's first-request deadline is off."""
        known = self._connections.get(request.transport) if request.transport else None
        if known is not None and known.timer is not None:
            known.timer.cancel()
            known.timer = None
        try:
            return await handler(request)
        finally:
            if known is not None:
                known.busy = False  # (its answer is written right after: a small window)

    def _fixed(self, doc: Fixed) -> Handler:
        etag = '"' + hashlib.sha256(doc.body).hexdigest()[:32] + '"'
        modified = self._modified

        async def serve(request: web.Request) -> web.StreamResponse:
            headers = {
                "Cache-Control": f"public, max-age={doc.max_age}",
                "Last-Modified": formatdate(modified, usegmt=True),
                "ETag": etag,
            }
            if request.headers.get("If-None-Match") == etag or _not_modified_since(
                request, modified
            ):
                return web.Response(status=304, headers=headers)
            return web.Response(body=doc.body, content_type=_mime(doc), headers=headers)

        return serve


def _live(doc: Live) -> Handler:
    async def serve(request: web.Request) -> web.StreamResponse:
        headers = {"Cache-Control": "no-store", "Content-Type": doc.content_type}
        return web.Response(body=doc.render(), headers=headers)

    return serve


def _mime(doc: Fixed) -> str:
    return doc.content_type.split(";", 1)[0]


def _not_modified_since(request: web.Request, modified: int) -> bool:
    since = request.headers.get("If-Modified-Since")
    if not since or "If-None-Match" in request.headers:
        return False
    try:
        return int(parsedate_to_datetime(since).timestamp()) >= modified
    except (TypeError, ValueError):
        return False


def _peer(transport: asyncio.BaseTransport) -> str:
    """Who a connection comes from: its IPv4 address, or its IPv6 address's /64."""
    peername = transport.get_extra_info("peername")
    host = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return (
        str(address.ipv4_mapped or address) if isinstance(address, ipaddress.IPv6Address) else host
    )


class _Bounded(asyncio.Protocol):
    """aiohttp's protocol of one connection, behind the connection bounds.

    Args:
        inner: aiohttp's protocol.
        server: The server, which counts its connections (``HttpServer.admit``).
    """

    def __init__(self, inner: Any, server: HttpServer) -> None:
        self._inner: Any = inner
        self._server = server
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._server.admit(transport):
            self._inner = None  # aiohttp never sees it
            transport.close()
            return
        self._transport = transport
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            if self._transport is not None:
                self._server.heard(self._transport)
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._server.forget(self._transport)
        if self._inner is not None:
            self._inner.connection_lost(exc)

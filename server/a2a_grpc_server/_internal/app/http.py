"""The HTTP side beside the gRPC service, on aiohttp: the agent card and the metrics.

Serves GET/HEAD of fixed paths: the agent card at
``/.well-known/agent-card.json`` (``Cache-Control``, ``Last-Modified``,
``ETag``; 304 on ``If-None-Match`` / ``If-Modified-Since``) and the metrics
at ``/metrics`` (never cached). Anything else is 404, other methods 405.

Bounds: at most ``MAX_CONNECTIONS`` connections, and ``MAX_PER_PEER`` of
one peer (an IPv4 address, or an IPv6 /64: one host's addresses; its next
connection is closed at once). A connection counts from the moment it is
accepted: its TLS handshake included. At the budget, a new connection makes
an idle one close (no request being handled: one still in its handshake or
sending its request head counts as idle; the quietest idle connection of the
peer holding the most), so no client holding connections open, or trickling
its requests, can lock the others out of the card and the metrics; with
none idle, the new one is closed. A connection gets
``REQUEST_TIMEOUT`` seconds to send its first request head (its handshake
included) and may stay idle that long between requests; request lines and
headers are limited by aiohttp (8 KiB each, 128 headers: 400 past them); no
request may carry a body. A slow or oversized request costs its own
connection only, and a malformed one a DEBUG line at most every 10 s
(aiohttp's own ERROR line with a traceback, per request, is held back: any
client could flood the log).

Behind a proxy (``trusted_proxies``): a connection from a listed address is
not held to the per-peer bound, since many clients share it. Each request on
it names its client in ``X-Forwarded-For``: the right-most entry that is not
a trusted proxy (the one the nearest proxy appended; entries further left
are what the client sent, and may be forged). From then on the connection
counts as that client's; a client over its share makes its quietest idle
connection close, or is answered 429 (``Connection: close``) when none is
idle. A request without the header stays the proxy's own. Anyone else's
``X-Forwarded-For`` is ignored.

Who runs what: aiohttp runs one task per connection on the server's event
loop. With TLS, this module accepts connections itself (one task per
listening socket, ``loop.sock_accept``), so a connection is counted before
its handshake; one task per connection then runs the handshake
(``loop.connect_accepted_socket``) and hands the connection to aiohttp.
``stop()`` closes the listeners and the open connections, handshakes
included, and waits for those tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from email.utils import formatdate, parsedate_to_datetime
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..errors import RateLimitedLog
from ..model.names import TASK_PREFIX
from .peers import address_of, forwarded_client, host_of, networks, share_of

MAX_CONNECTIONS = 256
MAX_PER_PEER = 32
"""Connections one peer address may hold open at once."""
REQUEST_TIMEOUT = 10.0
BACKLOG = 100
"""Connections the kernel queues before they are accepted (asyncio's default)."""
ACCEPT_RETRY = 1.0
"""Seconds before accepting again after accepting failed (asyncio's own loop waits 1 s)."""

logger = logging.getLogger(__name__.replace("._internal", ""))
_malformed_log = RateLimitedLog(logger, logging.DEBUG, period=10.0)
_accept_log = RateLimitedLog(logger, logging.WARNING, period=10.0)


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
    """Whose share it counts in (for a proxy's connection, its last request's client)."""
    timer: asyncio.TimerHandle | None
    """Closes it unless its first request head arrives in time (None once it did)."""
    last: float
    """When it last received data (monotonic)."""
    proxied: bool = False
    """It comes from a trusted proxy (``X-Forwarded-For`` names its clients)."""
    busy: bool = False
    """A request is being handled on it (from its handler's start to its end)."""


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
        trusted_proxies: Addresses and networks (CIDR) of proxies whose
            ``X-Forwarded-For`` names the client (see the module docstring).

    Raises:
        ValueError: An entry of ``trusted_proxies`` is not an address or a network.
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
        trusted_proxies: Sequence[str] = (),
    ) -> None:
        self._host, self._port, self._tls = host, port, tls
        self._trusted = networks(tuple(trusted_proxies))
        for net in self._trusted:
            if net.prefixlen == 0:
                logger.warning(
                    "http_trusted_proxies lists %s: every client may then name any address "
                    "in X-Forwarded-For and take another's share; list only your proxies",
                    net,
                )
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
        self._listeners: list[socket.socket] = []
        """With TLS: the listening sockets (accepted here, see the module docstring)."""
        self._connections: dict[asyncio.BaseTransport, _Connection] = {}
        self._per_peer: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        """With TLS: the accept loops and the handshakes."""

    @property
    def port(self) -> int:
        """The bound port (after ``start``)."""
        if self._listeners:
            return int(self._listeners[0].getsockname()[1])
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
            if self._tls is None:
                self._server = await loop.create_server(self._protocol, self._host, self._port)
                return
            self._listeners = await _listen(self._host, self._port)
        except OSError:
            await self._runner.cleanup()
            raise
        for listener in self._listeners:
            self._run(self._accept(listener), "http-accept")

    async def stop(self) -> None:
        """Stop listening and end open connections."""
        if self._server is None and not self._listeners:
            return
        if self._server is not None:
            self._server.close()
        for transport in list(self._connections):
            transport.close()  # (a handshake's: its socket is shut down, the handshake fails)
        for task in list(self._tasks):
            if task.get_name().endswith(":http-accept"):
                task.cancel()
        with contextlib.suppress(TimeoutError):  # handshakes end on their own, at once
            async with asyncio.timeout(1.0):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for listener in self._listeners:
            listener.close()
        self._listeners = []
        await self._runner.cleanup()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()

    def _run(self, work: Coroutine[Any, Any, None], what: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=f"{TASK_PREFIX}:{what}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket) -> None:
        """Accept TLS connections: each counted (``admit``) before its handshake runs."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # (out of descriptors, say: as asyncio's own loop does)
                _accept_log.log("accepting a connection failed: %s", exc)
                await asyncio.sleep(ACCEPT_RETRY)  # sync-ok: a pause before accepting again
                continue
            pending = _Handshake(sock)
            if not self.admit(pending):
                sock.close()
                continue
            self._run(self._handshake(pending), "http-tls")

    async def _handshake(self, pending: _Handshake) -> None:
        """Run a connection's TLS handshake; aiohttp then has it (``_Bounded.connection_made``)."""
        assert self._tls is not None
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(
                lambda: _Bounded(self._inner(), self, pending),
                pending.sock,
                ssl=self._tls,
                ssl_handshake_timeout=self._timeout,
            )
        except OSError:  # (a failed handshake: the socket is closed)
            pass
        finally:
            self.forget(pending)  # (if it never became a connection)
            if not pending.made:
                pending.sock.close()

    def _protocol(self) -> asyncio.BaseProtocol:
        """A connection's protocol: aiohttp's, bounded (see the module docstring)."""
        return _Bounded(self._inner(), self)

    def _inner(self) -> Any:
        handler: Any = self._runner.server
        assert handler is not None
        return handler()

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Count a new connection in, shedding the quietest one at the budget; or refuse it."""
        address = address_of(transport)
        peer = share_of(address) if address is not None else host_of(transport)
        proxied = address is not None and any(address in net for net in self._trusted)
        if not proxied and self._per_peer[peer] >= self._per_peer_most:
            return False
        if len(self._connections) >= self._most:
            shed = self._idlest()
            if shed is None:
                return False
            self._shed(shed)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self._timeout, transport.close)
        self._connections[transport] = _Connection(peer, timer, loop.time(), proxied)
        self._per_peer[peer] += 1
        return True

    def _idlest(
        self, peer: str | None = None, but: asyncio.BaseTransport | None = None
    ) -> asyncio.BaseTransport | None:
        """The connection to shed for a new one: the quietest idle one of the busiest peer.

        With ``peer``: the quietest idle one of that peer, other than ``but``.
        """
        idle = [
            (t, c)
            for t, c in self._connections.items()
            if not c.busy and t is not but and (peer is None or c.peer == peer)
        ]
        if not idle:
            return None
        transport, _ = min(idle, key=lambda tc: (-self._per_peer[tc[1].peer], tc[1].last))
        return transport

    def _shed(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.WriteTransport):
            transport.abort()  # (not close: a peer that never reads would keep it open)
        else:
            transport.close()
        self.forget(transport)

    def attribute(self, transport: asyncio.BaseTransport, client: str) -> bool:
        """Count a proxy's connection as ``client``'s, shedding that client's quietest idle one.

        Returns:
            False if ``client`` is at its share with every connection busy (the
            connection stays counted as it was).
        """
        known = self._connections.get(transport)
        if known is None or known.peer == client:
            return True
        if self._per_peer[client] >= self._per_peer_most:
            shed = self._idlest(client, but=transport)
            if shed is None:
                return False
            self._shed(shed)
        self._uncount(known.peer)
        known.peer = client
        self._per_peer[client] += 1
        return True

    def upgraded(self, pending: _Handshake, transport: asyncio.BaseTransport) -> bool:
        """A connection's TLS handshake ended: it goes on as ``transport``.

        Returns:
            False if it was shed or timed out meanwhile.
        """
        known = self._connections.pop(pending, None)
        if known is None:
            return False
        pending.made = True
        if known.timer is not None:  # (its socket is the transport's now: closed through it)
            known.timer.cancel()
            known.timer = asyncio.get_running_loop().call_at(known.timer.when(), transport.close)
        self._connections[transport] = known
        return True

    def heard(self, transport: asyncio.BaseTransport) -> None:
        """Data arrived on a connection."""
        known = self._connections.get(transport)
        if known is not None:
            known.last = asyncio.get_running_loop().time()

    def forget(self, transport: asyncio.BaseTransport) -> None:
        """A connection closed (or was shed)."""
        known = self._connections.pop(transport, None)
        if known is None:
            return
        if known.timer is not None:
            known.timer.cancel()
        self._uncount(known.peer)

    def _uncount(self, peer: str) -> None:
        self._per_peer[peer] -= 1
        if not self._per_peer[peer]:
            del self._per_peer[peer]

    @web.middleware
    async def _started(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A request head arrived in time: its connection's first-request deadline is off.

        On a trusted proxy's connection the request's client takes it over first
        (see the module docstring).
        """
        transport = request.transport
        known = self._connections.get(transport) if transport is not None else None
        if known is None or transport is None:
            return await handler(request)
        if known.timer is not None:
            known.timer.cancel()
            known.timer = None
        if known.proxied:
            client = forwarded_client(request.headers.getall("X-Forwarded-For", []), self._trusted)
            if client is not None and not self.attribute(transport, client):
                refused = web.Response(
                    status=429,
                    text="too many connections from this client\n",
                    headers={"Retry-After": "1"},
                )
                refused.force_close()
                return refused
        known.busy = True
        try:
            return await handler(request)
        finally:
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


class _Handshake(asyncio.BaseTransport):
    """An accepted connection still in its TLS handshake, as the bounds count it.

    Closing it shuts its socket down: the handshake then fails at once and
    its task closes the socket (a socket is closed by whoever holds it).
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.made = False
        """The handshake ended: a transport holds the socket."""
        try:
            self._peername: Any = sock.getpeername()
        except OSError:
            self._peername = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._peername if name == "peername" else default

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def is_closing(self) -> bool:
        return False


class _Bounded(asyncio.Protocol):
    """aiohttp's protocol of one connection, behind the connection bounds.

    Args:
        inner: aiohttp's protocol.
        server: The server, which counts its connections (``HttpServer.admit``).
        pending: With TLS: the connection as counted during its handshake.
    """

    def __init__(self, inner: Any, server: HttpServer, pending: _Handshake | None = None) -> None:
        self._inner: Any = inner
        self._server = server
        self._pending = pending
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pending = self._pending
        admitted = (
            self._server.admit(transport)
            if pending is None
            else self._server.upgraded(pending, transport)
        )
        if not admitted:
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


async def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address ``host`` names, as ``loop.create_server`` binds.

    Raises:
        OSError: An address could not be bound.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    made: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            made.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in made:
            sock.close()
        raise
    return made

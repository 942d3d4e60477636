"""A small HTTP/1.1 server for the few documents beside the gRPC service.

Serves GET/HEAD of fixed paths: the agent card at
``/.well-known/agent-card.json`` (``Cache-Control``, ``Last-Modified``,
``ETag``; 304 on ``If-None-Match`` / ``If-Modified-Since``) and the metrics
at ``/metrics`` (never cached). Anything else is 404; one request per
connection; a client gets 10 s to send its request head.

Who runs what: ``asyncio.start_server`` runs one task per connection;
``stop()`` closes the listener and cancels the connection tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_REQUEST_HEAD = 16 * 1024
REQUEST_TIMEOUT = 10.0


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


class HttpServer:
    """Serves ``routes`` (path -> document) on one address.

    Args:
        routes: The documents, by path.
        host: Address to bind.
        port: Port to bind (0 for any free port).
        tls: Serve https with this context.
    """

    def __init__(
        self,
        routes: dict[str, Route],
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._routes = routes
        self._tls = tls
        self._etags = {
            path: '"' + hashlib.sha256(doc.body).hexdigest()[:32] + '"'
            for path, doc in routes.items()
            if isinstance(doc, Fixed)
        }
        self._modified = int(time.time())
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()

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
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, ssl=self._tls
        )

    async def stop(self) -> None:
        """Stop listening and end open connections."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._clients):
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > MAX_REQUEST_HEAD:
                return
            writer.write(self._respond(head.decode("latin-1")))
            await writer.drain()
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
        ):
            pass  # a client that sends garbage or nothing just loses its connection
        finally:
            self._clients.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _respond(self, head: str) -> bytes:
        lines = head.split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(":") for line in lines[1:] if line)
        }
        doc = self._routes.get(path)
        if doc is None:
            return _response(404, b"not found\n", "text/plain")
        if method not in ("GET", "HEAD"):
            return _response(405, b"method not allowed\n", "text/plain", {"Allow": "GET, HEAD"})
        if isinstance(doc, Live):
            body = doc.render()
            extra = {"Cache-Control": "no-store"}
            return _response(200, body, doc.content_type, extra, head_only=method == "HEAD")
        etag = self._etags[path]
        cache = {
            "Cache-Control": f"public, max-age={doc.max_age}",
            "Last-Modified": email.utils.formatdate(self._modified, usegmt=True),
            "ETag": etag,
        }
        if headers.get("if-none-match") == etag or self._not_modified_since(headers):
            return _response(304, b"", None, cache)
        return _response(200, doc.body, doc.content_type, cache, head_only=method == "HEAD")

    def _not_modified_since(self, headers: dict[str, str]) -> bool:
        since = headers.get("if-modified-since")
        if not since or "if-none-match" in headers:
            return False
        try:
            parsed = email.utils.parsedate_to_datetime(since)
        except (TypeError, ValueError):
            return False
        return int(parsed.timestamp()) >= self._modified


_REASONS = {200: "OK", 304: "Not Modified", 404: "Not Found", 405: "Method Not Allowed"}


def _response(
    status: int,
    body: bytes,
    content_type: str | None,
    extra: dict[str, str] | None = None,
    *,
    head_only: bool = False,
) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", "Connection: close"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if status != 304:
        lines.append(f"Content-Length: {len(body)}")
    lines.extend(f"{k}: {v}" for k, v in (extra or {}).items())
    payload = b"" if head_only or status == 304 else body
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload

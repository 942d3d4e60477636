"""The agent card, and the small HTTP server that publishes it.

Clients (and the conformance kit) fetch ``/.well-known/agent-card.json`` to
find the gRPC endpoint. The HTTP side serves that one document, with
``Cache-Control``, ``Last-Modified`` and ``ETag``, and answers
``If-None-Match`` / ``If-Modified-Since`` with 304. Anything else is 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import logging
import time

from a2a.types.a2a_pb2 import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from google.protobuf import json_format

logger = logging.getLogger(__name__)

WELL_KNOWN_PATH = "/.well-known/agent-card.json"
PROTOCOL_VERSION = "1.0"
MAX_REQUEST_HEAD = 16 * 1024


def default_card(name: str = "A2A agent") -> AgentCard:
    """A card for an agent whose module gave none: streaming, no push, one skill."""
    return AgentCard(
        name=name,
        description="An A2A agent served over gRPC by a2a-grpc-server.",
        version="0.1.0",
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[
            AgentSkill(
                id="default",
                name="Default",
                description="Whatever the agent does with a text message.",
                tags=["general"],
            )
        ],
    )


def with_grpc_endpoint(card: AgentCard, address: str) -> AgentCard:
    """Return a copy of ``card`` whose first interface is our gRPC endpoint.

    Args:
        card: The agent's card.
        address: ``host:port`` the gRPC server is bound to.
    """
    result = AgentCard()
    result.CopyFrom(card)
    kept = [i for i in card.supported_interfaces if i.protocol_binding != "GRPC"]
    del result.supported_interfaces[:]
    result.supported_interfaces.append(
        AgentInterface(url=address, protocol_binding="GRPC", protocol_version=PROTOCOL_VERSION)
    )
    result.supported_interfaces.extend(kept)
    return result


class CardServer:
    """Serves the agent card over HTTP/1.1 on one address.

    Args:
        card: The card to publish.
        host: Address to bind.
        port: Port to bind (0 for any free port).
    """

    def __init__(self, card: AgentCard, host: str, port: int) -> None:
        self._body = json_format.MessageToJson(card, indent=2).encode()
        self._etag = '"' + hashlib.sha256(self._body).hexdigest()[:32] + '"'
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
        """Bind and start serving."""
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

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
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > MAX_REQUEST_HEAD:
                raise ValueError("request head too large")
            writer.write(self._respond(head.decode("latin-1")))
            await writer.drain()
        except (
            TimeoutError,
            ValueError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
        ):
            pass
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
        if path != WELL_KNOWN_PATH:
            return _response(404, b"not found\n", "text/plain")
        if method not in ("GET", "HEAD"):
            return _response(
                405, b"method not allowed\n", "text/plain", extra={"Allow": "GET, HEAD"}
            )
        cache = {
            "Cache-Control": "public, max-age=300",
            "Last-Modified": email.utils.formatdate(self._modified, usegmt=True),
            "ETag": self._etag,
        }
        if headers.get("if-none-match") == self._etag or self._not_modified_since(headers):
            return _response(304, b"", None, extra=cache)
        body = self._body if method == "GET" else b""
        return _response(200, body, "application/json", extra=cache, length=len(self._body))

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
    *,
    extra: dict[str, str] | None = None,
    length: int | None = None,
) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", "Connection: close"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if status != 304:
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    lines.extend(f"{k}: {v}" for k, v in (extra or {}).items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

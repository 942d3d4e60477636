"""The HTTP side's connection bounds behind a proxy and during TLS handshakes (issue 42, 5).

Real sockets on loopback addresses: 127.0.0.1 is a client, 127.0.0.2 and 127.0.0.3 are
proxies (or other clients), all reaching a server bound to 127.0.0.1. A connection still in
its TLS handshake counts against the bounds; a connection that has not finished a request
head may make room for a new one; from a trusted proxy, the client named by
``X-Forwarded-For`` gets its own share.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from a2a_grpc_server import A2AServer, ServerConfig
from a2a_grpc_server._internal.app.card import WELL_KNOWN_PATH
from a2a_grpc_server._internal.app.http import MAX_PER_PEER, HttpServer
from a2a_grpc_server._internal.app.peers import forwarded_client, networks
from a2a_grpc_server.agents.echo import EchoAgent
from tests.support.certs import issue
from tests.unit.app.test_http import ROUTES, get, request

CARD = (200, b'{"name": "x"}')
PARTIAL = b"GET /card HTTP/1.1\r\nHost: t\r\n"
"""A request head that never ends (a client trickling it)."""

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def serving(tls: ssl.SSLContext | None = None, **options: object) -> AsyncIterator[int]:
    server = HttpServer(ROUTES, "127.0.0.1", 0, tls=tls, **options)  # type: ignore[arg-type]
    await server.start()
    try:
        async with asyncio.timeout(15):
            yield server.port
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def held(
    port: int, source: str, count: int, send: bytes = b""
) -> AsyncIterator[list[Connection]]:
    """``count`` connections from ``source``, each having sent ``send``; closed on exit."""
    connections: list[Connection] = []
    try:
        for _ in range(count):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
            writer.write(send)
            connections.append((reader, writer))
        yield connections
    finally:
        for _, writer in connections:
            writer.close()


async def closed(connection: Connection) -> bool:
    """Whether the server closed (or reset) the connection, read to its end."""
    with contextlib.suppress(ConnectionResetError):
        await connection[0].read()
    return True


async def answer(connection: Connection, head: str) -> int:
    """Send a keep-alive request on ``connection``; its answer's status (0: closed)."""
    reader, writer = connection
    writer.write(head.encode())
    try:
        status_line = await reader.readline()
        if not status_line:
            return 0
        headers = await reader.readuntil(b"\r\n\r\n")
    except (ConnectionResetError, asyncio.IncompleteReadError):
        return 0
    length = next(
        int(line.split(b":", 1)[1])
        for line in headers.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return int(status_line.split()[1])


def forwarded(path: str, chain: str) -> str:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\nX-Forwarded-For: {chain}\r\n\r\n"


@pytest.fixture
def tls(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(the server's context, a client's context trusting it)."""
    files = issue(tmp_path, ips=("127.0.0.1",))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(files.cert, files.key)
    return server, ssl.create_default_context(cafile=str(files.ca))


async def tls_get(port: int, client: ssl.SSLContext) -> int:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client, server_hostname="127.0.0.1"
    )
    try:
        writer.write(request("/card").encode())
        status_line = await reader.readline()
    finally:
        writer.transport.abort()
    return int(status_line.split()[1]) if status_line else 0


async def test_connections_still_in_their_tls_handshake_count_against_a_peers_share(
    tls: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    # One peer used to hold 2,000 descriptors for 10 s this way.
    server_tls, client_tls = tls
    async with (
        serving(server_tls, max_per_peer=3, request_timeout=8.0) as port,
        held(port, "127.0.0.2", 3),
        held(port, "127.0.0.2", 1) as [fourth],
    ):
        async with asyncio.timeout(2):  # (well before the handshake's own time runs out)
            assert await closed(fourth), "the peer's fourth handshake is closed at once"
        assert await tls_get(port, client_tls) == 200, "another peer is served"


async def test_connections_still_in_their_tls_handshake_count_against_the_total(
    tls: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    server_tls, client_tls = tls
    async with (
        serving(server_tls, max_connections=3, request_timeout=8.0) as port,
        held(port, "127.0.0.2", 3) as silent,
    ):
        assert await tls_get(port, client_tls) == 200
        async with asyncio.timeout(2):
            assert await closed(silent[0]), "the quietest handshake made room"


async def test_trickling_heads_from_a_few_peers_do_not_lock_another_out() -> None:
    # 8 addresses x 32 trickling connections used to hold all 256 slots.
    async with (
        serving(max_connections=4, max_per_peer=2) as port,
        held(port, "127.0.0.2", 2, PARTIAL),
        held(port, "127.0.0.3", 2, PARTIAL),
    ):
        assert await get(port, request("/card")) == CARD


async def test_clients_behind_a_trusted_proxy_get_a_share_each() -> None:
    # Behind NAT, Envoy or Istio every caller used to be one peer: 3 connections of one
    # client locked everyone out. Two proxies in a chain, both trusted (127.0.0.2/31).
    alice = "198.51.100.9, 203.0.113.7, 127.0.0.3"  # (the left entry is the client's own)
    async with (
        serving(max_per_peer=3, trusted_proxies=("127.0.0.2/31",)) as port,
        held(port, "127.0.0.2", 6, PARTIAL),  # trickling: the proxy's, each may make room
        held(port, "127.0.0.2", 6) as alices,
    ):
        for i, connection in enumerate(alices):  # each answered, then held open idle
            spoofed = f"192.0.2.{i}, {alice}"
            assert await answer(connection, forwarded("/card", spoofed)) == 200
        async with asyncio.timeout(5):
            for connection in alices[:3]:
                assert await closed(connection), "alice keeps no more than her share"
        bob = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        try:
            assert await answer(bob, forwarded("/metrics", "203.0.113.8")) == 200
        finally:
            bob[1].close()


async def test_a_client_at_her_share_makes_room_from_her_own_idle_connections() -> None:
    async with (
        serving(max_per_peer=1, trusted_proxies=("127.0.0.2",)) as port,
        held(port, "127.0.0.2", 2) as [first, second],
    ):
        assert await answer(first, forwarded("/card", "203.0.113.7")) == 200
        assert await answer(second, forwarded("/card", "203.0.113.7")) == 200
        async with asyncio.timeout(5):
            assert await closed(first), "her idle one made room"


async def test_an_untrusted_peers_forwarded_for_is_ignored() -> None:
    async with (
        serving(max_per_peer=2, trusted_proxies=("127.0.0.2",)) as port,
        held(port, "127.0.0.1", 3) as connections,
    ):
        statuses = [
            await answer(c, forwarded("/card", f"203.0.113.{i}")) for i, c in enumerate(connections)
        ]
        assert statuses == [200, 200, 0], "127.0.0.1 is one peer whatever it says"


async def test_the_server_setting_reaches_the_http_side() -> None:
    config = ServerConfig(http_trusted_proxies=("127.0.0.2",))
    server = A2AServer(EchoAgent(), host="127.0.0.1", port=0, http_port=0, config=config)
    await server.start()
    try:
        assert server.http_port is not None
        port = server.http_port
        async with asyncio.timeout(15), held(port, "127.0.0.2", MAX_PER_PEER) as alices:
            for connection in alices:  # the proxy's share, were it one client
                assert await answer(connection, forwarded(WELL_KNOWN_PATH, "203.0.113.7")) == 200
            async with held(port, "127.0.0.2", 1) as [bob]:
                assert await answer(bob, forwarded(WELL_KNOWN_PATH, "203.0.113.8")) == 200
    finally:
        await server.stop(grace=0)


@pytest.mark.parametrize(
    ("chain", "client"),
    [
        (["203.0.113.7"], "203.0.113.7"),
        (["198.51.100.1, 203.0.113.7", "10.0.0.5"], "203.0.113.7"),  # (two header lines)
        (["203.0.113.7:4711, 10.0.0.5"], "203.0.113.7"),
        (["[2001:db8::1]:443"], "2001:db8::/64"),
        (["2001:db8::1, ::ffff:10.0.0.9"], "2001:db8::/64"),
        (["203.0.113.7,, "], "203.0.113.7"),
        (["unknown"], "unknown"),
        (["10.0.0.5, 10.0.0.6"], None),  # (the proxies' own request)
        ([], None),
    ],
)
def test_the_client_is_the_right_most_entry_that_is_not_a_trusted_proxy(
    chain: list[str], client: str | None
) -> None:
    trusted = (ipaddress.ip_network("10.0.0.0/8"),)
    assert forwarded_client(chain, trusted) == client


def test_a_proxy_listed_ipv4_mapped_matches_as_ipv4() -> None:
    # Addresses are read IPv4-mapped as IPv4: a proxy listed as ::ffff:10.0.0.0/104 was
    # never matched, so its clients all shared its one share.
    trusted = networks(["::ffff:10.0.0.0/104", "::ffff:192.0.2.7", "2001:db8::/32"])
    assert trusted == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("192.0.2.7/32"),
        ipaddress.ip_network("2001:db8::/32"),
    )
    assert forwarded_client(["203.0.113.7, ::ffff:10.1.2.3"], trusted) == "203.0.113.7"


def test_trusting_every_address_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    HttpServer(ROUTES, "127.0.0.1", 0, trusted_proxies=("0.0.0.0/0",))
    warned = [r for r in caplog.records if "every client may then name any address" in r.message]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"
    caplog.clear()
    HttpServer(ROUTES, "127.0.0.1", 0, trusted_proxies=("10.0.0.0/8",))
    assert not caplog.records

"""TLS and mTLS on both ports, with certificates made in the test; rotation without a restart."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import TaskState

from a2a_grpc_server import A2AServer
from a2a_grpc_server._internal.app.tls import TlsFiles
from a2a_grpc_server.agents.echo import EchoAgent
from tests.support.certs import Issued, issue
from tests.support.harness import V1, send_request
from tests.support.serveproc import refusal

S = TaskState


@contextlib.asynccontextmanager
async def tls_server(files: TlsFiles) -> AsyncIterator[A2AServer]:
    server = A2AServer(EchoAgent(), host="127.0.0.1", port=0, http_port=0, tls=files)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0)


def credentials(ca: Path, client: Issued | None = None) -> grpc.ChannelCredentials:
    made: grpc.ChannelCredentials = grpc.ssl_channel_credentials(  # type: ignore[no-untyped-call]
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )
    return made


async def echo(address: str, creds: grpc.ChannelCredentials | None) -> TaskState:
    """One SendMessage over a new connection; its task's state."""
    channel = (
        grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
    )
    async with channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        reply = await stub.SendMessage(send_request("hi"), metadata=V1, timeout=5)
        state: TaskState = reply.task.status.state
        return state


async def refused(address: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await echo(address, creds)
    return caught.value.code()


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def server_certs(directory: Path) -> Issued:
    directory.mkdir()
    return issue(directory, dns=("localhost",), ips=("127.0.0.1",))


async def test_tls_on_both_ports_and_plaintext_refused(tmp_path: Path) -> None:
    issued = server_certs(tmp_path / "server")
    async with asyncio.timeout(20), tls_server(TlsFiles(issued.cert, issued.key)) as server:
        address = server.grpc_address
        assert await echo(address, credentials(issued.ca)) == S.TASK_STATE_COMPLETED
        assert await refused(address, None) == grpc.StatusCode.UNAVAILABLE
        other = server_certs(tmp_path / "other")  # a client that trusts another CA
        assert await refused(address, credentials(other.ca)) == grpc.StatusCode.UNAVAILABLE
        async with httpx.AsyncClient(verify=trusting(issued.ca), trust_env=False) as http:
            card = await http.get(
                f"https://127.0.0.1:{server.http_port}/.well-known/agent-card.json"
            )
        assert card.status_code == 200 and card.json()["name"]


async def test_mtls_accepts_only_clients_its_ca_signed(tmp_path: Path) -> None:
    issued = server_certs(tmp_path / "server")
    clients = server_certs(tmp_path / "clients")  # its CA signs the clients we accept
    stranger = server_certs(tmp_path / "stranger")  # a client certificate from another CA
    files = TlsFiles(issued.cert, issued.key, clients.ca)
    async with asyncio.timeout(20), tls_server(files) as server:
        address = server.grpc_address
        assert await echo(address, credentials(issued.ca, clients)) == S.TASK_STATE_COMPLETED
        assert await refused(address, credentials(issued.ca)) == grpc.StatusCode.UNAVAILABLE
        assert (
            await refused(address, credentials(issued.ca, stranger)) == grpc.StatusCode.UNAVAILABLE
        )


async def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(
    tmp_path: Path,
) -> None:
    first = server_certs(tmp_path / "first")
    second = server_certs(tmp_path / "second")  # issued by another CA
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "cert.pem", live / "key.pem"
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    async with asyncio.timeout(20), tls_server(TlsFiles(cert, key)) as server:
        address = server.grpc_address
        assert await echo(address, credentials(first.ca)) == S.TASK_STATE_COMPLETED
        shutil.copy(second.key, key)  # the rotation: new files in place
        shutil.copy(second.cert, cert)
        assert await echo(address, credentials(second.ca)) == S.TASK_STATE_COMPLETED
        assert await refused(address, credentials(first.ca)) == grpc.StatusCode.UNAVAILABLE
        assert server.certificates is not None and server.certificates.reloads == 1
        async with httpx.AsyncClient(verify=trusting(second.ca), trust_env=False) as http:
            url = f"https://127.0.0.1:{server.http_port}/.well-known/agent-card.json"
            assert (await http.get(url)).status_code == 200


def test_serve_refuses_incomplete_or_unusable_tls_flags(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    for args, says in (
        (["--tls-cert", str(empty)], "go together"),
        (["--tls-cert", str(empty), "--tls-key", str(tmp_path / "nope.pem")], "does not exist"),
        (["--tls-cert", str(empty), "--tls-key", str(empty)], "cannot be used"),
    ):
        said = refusal(*args)
        assert says in said, (args, said[-300:])

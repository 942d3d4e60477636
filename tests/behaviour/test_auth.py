"""Authentication with a tokens file: refused calls run nothing, the executor sees its principal,
a revoked token stops working as soon as the file changes, health stays open."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from a2a.server.agent_execution import AgentExecutor
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import AgentCard, GetExtendedAgentCardRequest, GetTaskRequest, TaskState
from grpc_health.v1 import health_pb2, health_pb2_grpc

from a2a_grpc_server import A2AServer, A2AService
from a2a_grpc_server._internal.app.tls import TlsFiles
from a2a_grpc_server._internal.rpc.auth import ClientCertificate, TokenFile, TrustedHeader
from tests.support.agents import WhoAgent
from tests.support.certs import Issued, issue
from tests.support.harness import V1, expose, rich_status, send_request
from tests.support.serveproc import refusal

S = TaskState


@contextlib.asynccontextmanager
async def guarded(agent: AgentExecutor, tokens: Path) -> AsyncIterator[grpc.aio.Channel]:
    server = A2AServer(agent, host="127.0.0.1", port=0, http_port=None, auth=TokenFile(tokens))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            yield channel
    finally:
        await server.stop(grace=0)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (*V1, ("authorization", f"Bearer {token}"))


async def test_calls_without_a_valid_token_run_nothing_and_say_why(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# principal:token\nalice:a-secret-1\nbob: b-secret-2 \n")
    agent = WhoAgent()
    async with asyncio.timeout(20), guarded(agent, tokens) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        for metadata, says in (
            (V1, "bearer token"),
            ((*V1, ("authorization", "Basic YTpi")), "bearer token"),
            (bearer("a-secret-X"), "not valid"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SendMessage(send_request("hi"), metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert rich_status(caught.value)[1].reason == "UNAUTHENTICATED"
            assert says in (caught.value.details() or "")
            assert "secret" not in (caught.value.details() or "")
        call = stub.SendStreamingMessage(send_request("hi"), metadata=V1)  # streams too
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert agent.users == [], "no executor ran"
        health = health_pb2_grpc.HealthStub(channel)  # open without a token
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        for token, name in (("a-secret-1", "alice"), ("b-secret-2", "bob")):
            task = (await stub.SendMessage(send_request("hi"), metadata=bearer(token))).task
            assert task.status.state == S.TASK_STATE_COMPLETED
            got = await stub.GetTask(GetTaskRequest(id=task.id), metadata=bearer(token))
            assert got.id == task.id
            assert agent.users[-1] == (name, True)


async def test_a_revoked_token_stops_working_when_the_file_changes(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a-secret-1\nbob:b-secret-2\n")
    async with asyncio.timeout(20), guarded(WhoAgent(), tokens) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        await stub.SendMessage(send_request("hi"), metadata=bearer("b-secret-2"))
        tokens.write_text("alice:a-secret-1\n")  # bob revoked
        stat = tokens.stat()  # (a new mtime even within the filesystem's clock tick)
        os.utime(tokens, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SendMessage(send_request("hi"), metadata=bearer("b-secret-2"))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await stub.SendMessage(send_request("hi"), metadata=bearer("a-secret-1"))


def test_a_malformed_tokens_file_is_refused_saying_where(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a\nno-colon-here\n")
    with pytest.raises(ValueError, match=r"tokens:2"):
        TokenFile(tokens)
    with pytest.raises(ValueError, match="cannot be read"):
        TokenFile(tmp_path / "missing")


async def test_the_card_declares_the_scheme_it_enforces(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a\n")
    server = A2AServer(WhoAgent(), port=0, http_port=None, auth=TokenFile(tokens))
    card = server.service.card
    assert card.security_schemes["bearer"].http_auth_security_scheme.scheme == "Bearer"
    assert "bearer" in card.security_requirements[0].schemes
    assert not card.capabilities.extended_agent_card
    for auth, name, kind in (
        (ClientCertificate(), "mtls", "mtls_security_scheme"),
        (TrustedHeader("x-principal"), "mesh", "mtls_security_scheme"),
    ):
        card = A2AServer(WhoAgent(), port=0, http_port=None, auth=auth).service.card
        assert card.security_schemes[name].WhichOneof("scheme") == kind
        assert list(card.security_requirements[0].schemes) == [name]


async def test_the_extended_card_is_for_authenticated_callers_only(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a-secret-1\n")
    extended = AgentCard(name="extended", description="for callers we know")
    server = A2AServer(
        WhoAgent(),
        host="127.0.0.1",
        port=0,
        http_port=None,
        auth=TokenFile(tokens),
        extended_card=extended,
    )
    assert server.service.card.capabilities.extended_agent_card
    await server.start()
    try:
        async with (
            asyncio.timeout(20),
            grpc.aio.insecure_channel(server.grpc_address) as channel,
        ):
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.GetExtendedAgentCard(GetExtendedAgentCardRequest(), metadata=V1)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            got = await stub.GetExtendedAgentCard(
                GetExtendedAgentCardRequest(), metadata=bearer("a-secret-1")
            )
            assert got.name == "extended"
    finally:
        await server.stop(grace=0)
    # Embedded without an authenticator, nobody is authenticated: nobody gets it.
    async with asyncio.timeout(20), serve_unguarded(extended) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetExtendedAgentCard(GetExtendedAgentCardRequest(), metadata=V1)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authenticated callers" in (caught.value.details() or "")


@contextlib.asynccontextmanager
async def serve_unguarded(extended: AgentCard) -> AsyncIterator[a2a_pb2_grpc.A2AServiceStub]:
    service = A2AService(WhoAgent(), extended_card=extended)
    h = await expose(service)
    try:
        yield h.stub
    finally:
        await service.shutdown(grace=0)
        await h.client.close()
        await h.channel.close()
        await h.server.stop(grace=None)


def test_serve_refuses_an_extended_card_without_authentication_or_unreadable(
    tmp_path: Path,
) -> None:
    card = tmp_path / "card.json"
    card.write_text('{"name": "extended"}')
    assert "is for authenticated callers" in refusal("--extended-card", str(card))
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a\n")
    card.write_text('{"name": ')
    said = refusal("--auth-tokens", str(tokens), "--extended-card", str(card))
    assert "not a readable AgentCard" in said


def test_quota_and_transport_flags_reach_the_settings() -> None:
    from a2a_grpc_server._internal.app import settings
    from a2a_grpc_server._internal.app.cli import build_parser, resolve

    args = build_parser().parse_args(
        ["serve", "--quota-streams", "7", "--grpc-max-connection-age", "1800"]
    )
    config = settings.server_config(resolve(args, {}))
    assert (config.quota_streams, config.quota_subscribers) == (7, 256)  # 256: the default
    assert config.grpc_max_connection_age == 1800.0
    assert "must not be negative" in refusal("--quota-streams", "-1")


async def test_the_client_certificate_names_the_caller(tmp_path: Path) -> None:
    def certs(name: str, **names: Any) -> Issued:
        (tmp_path / name).mkdir()
        return issue(tmp_path / name, **names)

    server_side = certs("server", dns=("localhost",), ips=("127.0.0.1",))
    spiffe = certs("spiffe", dns=("svc-a",), uris=("spiffe://mesh.example/ns/a/sa/agent",))
    plain = certs("plain", dns=("svc-b",))
    # The server trusts the two clients' CAs, and names each by its certificate.
    bundle = tmp_path / "client-cas.pem"
    bundle.write_bytes(spiffe.ca.read_bytes() + plain.ca.read_bytes())
    agent = WhoAgent()
    server = A2AServer(
        agent,
        host="127.0.0.1",
        port=0,
        http_port=None,
        tls=TlsFiles(server_side.cert, server_side.key, bundle),
        auth=ClientCertificate(),
    )
    await server.start()
    try:
        async with asyncio.timeout(20):
            for client, name in (
                (spiffe, "spiffe://mesh.example/ns/a/sa/agent"),
                (plain, "svc-b"),
            ):
                creds = grpc.ssl_channel_credentials(  # type: ignore[no-untyped-call]
                    root_certificates=server_side.ca.read_bytes(),
                    private_key=client.key.read_bytes(),
                    certificate_chain=client.cert.read_bytes(),
                )
                async with grpc.aio.secure_channel(server.grpc_address, creds) as channel:
                    stub = a2a_pb2_grpc.A2AServiceStub(channel)
                    await stub.SendMessage(send_request("hi"), metadata=V1)
                assert agent.users[-1] == (name, True)
    finally:
        await server.stop(grace=0)


async def test_a_trusted_header_names_the_caller_and_is_required(tmp_path: Path) -> None:
    agent = WhoAgent()
    server = A2AServer(
        agent, host="127.0.0.1", port=0, http_port=None, auth=TrustedHeader("X-Principal")
    )
    await server.start()
    try:
        async with asyncio.timeout(20), grpc.aio.insecure_channel(server.grpc_address) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SendMessage(send_request("hi"), metadata=V1)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await stub.SendMessage(send_request("hi"), metadata=(*V1, ("x-principal", "carol")))
            assert agent.users == [("carol", True)]
    finally:
        await server.stop(grace=0)


def test_serve_refuses_conflicting_or_incomplete_auth_flags(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a\n")
    for args, says in (
        (["--auth-mtls"], "needs --tls-client-ca"),
        (["--auth-tokens", str(tokens), "--auth-trusted-header", "x-p"], "choose one"),
        (["--auth-tokens", str(tmp_path / "missing")], "cannot be read"),
    ):
        said = refusal(*args)
        assert says in said, (args, said[-300:])

"""Credentials read exactly (issue 22): tokens files parsed to the letter and failing closed,
SPIFFE IDs from URI SANs only, a trusted header sent once, printable principal names.

Each case is one a hostile caller broke on the earlier parsing; each test talks to a real
grpc.aio server over a real channel (TLS with real certificates for the mTLS cases).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from a2a.types import a2a_pb2_grpc

from a2a_grpc_server import A2AServer
from a2a_grpc_server._internal.app.tls import TlsFiles
from a2a_grpc_server._internal.rpc.auth import (
    Authenticator,
    ClientCertificate,
    Credentials,
    Principal,
    TokenFile,
    TrustedHeader,
)
from tests.support.agents import WhoAgent
from tests.support.certs import Issued, issue
from tests.support.harness import V1, rich_status, send_request


@contextlib.asynccontextmanager
async def serving(
    auth: Authenticator, tls: TlsFiles | None = None
) -> AsyncIterator[tuple[A2AServer, WhoAgent]]:
    agent = WhoAgent()
    server = A2AServer(agent, host="127.0.0.1", port=0, http_port=None, tls=tls, auth=auth)
    await server.start()
    try:
        async with asyncio.timeout(20):
            yield server, agent
    finally:
        await server.stop(grace=0)


async def answer(stub: a2a_pb2_grpc.A2AServiceStub, *metadata: tuple[str, str]) -> str:
    """'OK', or the refusal's details (asserted UNAUTHENTICATED with ErrorInfo)."""
    refusal: grpc.aio.AioRpcError | None = None
    try:
        await stub.SendMessage(send_request("hi"), metadata=(*V1, *metadata))
    except grpc.aio.AioRpcError as err:
        refusal = err
    if refusal is None:
        return "OK"
    assert refusal.code() == grpc.StatusCode.UNAUTHENTICATED, refusal
    assert rich_status(refusal)[1].reason == "UNAUTHENTICATED"
    return refusal.details() or ""


def touch(path: Path) -> None:
    """A new modification time, even within the filesystem's clock tick."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def bearer(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")


async def test_a_hash_is_part_of_the_token_not_a_comment(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# alice's token has a hash in it\nalice:ab#cdef-123\n")
    async with (
        serving(TokenFile(tokens)) as (server, agent),
        grpc.aio.insecure_channel(server.grpc_address) as channel,
    ):
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        assert "not valid" in await answer(stub, bearer("ab")), "a prefix is not the token"
        assert await answer(stub, bearer("ab#cdef-123")) == "OK"
        assert agent.users == [("alice", True)]


def test_a_token_on_two_lines_is_refused_naming_both(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:same-secret\n\nbob:same-secret\n")
    with pytest.raises(ValueError, match=r"tokens:3: the token of line 1 again"):
        TokenFile(tokens)


def test_principal_names_with_control_characters_are_refused_in_the_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("ali\x00ce:s-1\n")
    with pytest.raises(ValueError, match=r"tokens:1: holds a control character"):
        TokenFile(tokens)


async def test_a_tokens_file_that_goes_missing_or_breaks_revokes_every_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a-secret-1\n")
    auth = TokenFile(tokens)
    async with (
        serving(auth) as (server, _),
        grpc.aio.insecure_channel(server.grpc_address) as channel,
    ):
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        assert await answer(stub, bearer("a-secret-1")) == "OK"
        tokens.write_text("alice:a-secret-1\nthis line is malformed\n")
        touch(tokens)
        for _ in range(3):  # refused every time, logged once
            assert "not valid" in await answer(stub, bearer("a-secret-1"))
        assert (auth.credentials, auth.reload_failures) == (0, 1)
        tokens.unlink()
        assert "not valid" in await answer(stub, bearer("a-secret-1"))
        assert auth.reload_failures == 2
        tokens.write_text("alice:a-secret-1\n")  # reads well again: tokens are back
        assert await answer(stub, bearer("a-secret-1")) == "OK"
        assert auth.credentials == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and all("every token is revoked" in e for e in errors), errors
    assert not any("a-secret-1" in e for e in errors), "the secret is never logged"


async def test_an_authorization_header_sent_twice_is_refused(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:a-secret-1\n")
    async with (
        serving(TokenFile(tokens)) as (server, agent),
        grpc.aio.insecure_channel(server.grpc_address) as channel,
    ):
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        said = await answer(stub, bearer("wrong"), bearer("a-secret-1"))
        assert "more than once" in said
        assert agent.users == []


async def test_a_trusted_header_sent_twice_is_refused() -> None:
    async with (
        serving(TrustedHeader("x-principal")) as (server, agent),
        grpc.aio.insecure_channel(server.grpc_address) as channel,
    ):
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        said = await answer(stub, ("x-principal", "mallory"), ("x-principal", "alice"))
        assert "more than once" in said
        assert agent.users == []
        assert await answer(stub, ("x-principal", "alice")) == "OK"
        assert agent.users == [("alice", True)]


class Named:
    """An embedder's authenticator that names the caller after its 'x-name' header, as
    given (a JWT's ``sub`` claim, say, may hold any JSON string)."""

    def authenticate(self, credentials: Credentials) -> Principal:
        return Principal(json.loads(credentials.single("x-name")))


async def test_a_principal_name_with_a_control_character_is_refused_whoever_names_it() -> None:
    async with (
        serving(Named()) as (server, agent),
        grpc.aio.insecure_channel(server.grpc_address) as channel,
    ):
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        for forged in ("alice\nadmin", "ali\u0000ce", "alice\u2028admin", "alice\u0085"):
            said = await answer(stub, ("x-name", json.dumps(forged)))
            assert "control character" in said, forged
        assert "characters" in await answer(stub, ("x-name", json.dumps("")))
        assert agent.users == []
        assert await answer(stub, ("x-name", json.dumps("Ada Lovelace"))) == "OK"
        assert agent.users == [("Ada Lovelace", True)]


async def test_spiffe_ids_come_from_one_uri_san_only(tmp_path: Path) -> None:
    def certs(name: str, **names: tuple[str, ...] | str) -> Issued:
        (tmp_path / name).mkdir()
        return issue(tmp_path / name, **names)  # type: ignore[arg-type]

    alice = "spiffe://trust.test/ns/prod/sa/alice"
    server_side = certs("server", dns=("localhost",), ips=("127.0.0.1",))
    clients = {
        "uri": certs("uri", uris=(alice,), common="svc-alice"),
        "cn": certs("cn", common=alice),  # the CA signed a CN that reads like alice's ID
        "dns": certs("dns", dns=(alice,), common="svc-dns"),
        "two": certs("two", uris=(alice, "spiffe://trust.test/ns/prod/sa/bob")),
        "plain": certs("plain", common="svc-b"),
    }
    bundle = tmp_path / "client-cas.pem"
    bundle.write_bytes(b"".join(c.ca.read_bytes() for c in clients.values()))
    tls = TlsFiles(server_side.cert, server_side.key, bundle)
    said: dict[str, str] = {}
    async with serving(ClientCertificate(), tls) as (server, agent):
        for name, client in clients.items():
            creds = grpc.ssl_channel_credentials(  # type: ignore[no-untyped-call]
                root_certificates=server_side.ca.read_bytes(),
                private_key=client.key.read_bytes(),
                certificate_chain=client.cert.read_bytes(),
            )
            async with grpc.aio.secure_channel(server.grpc_address, creds) as channel:
                said[name] = await answer(a2a_pb2_grpc.A2AServiceStub(channel))
    assert said["uri"] == "OK" and said["plain"] == "OK"
    assert "looks like a SPIFFE ID" in said["cn"]
    assert "2 SPIFFE IDs" in said["two"]
    # A DNS SAN is not a SPIFFE ID: that caller is named by its common name.
    assert said["dns"] == "OK"
    assert agent.users == [(alice, True), ("svc-dns", True), ("svc-b", True)]

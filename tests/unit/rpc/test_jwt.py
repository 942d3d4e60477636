"""JWT bearer tokens against a JWKS file: valid, expired, wrong audience or issuer, unknown key,
and a rotated JWKS picked up when a token names its new key."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from a2a.types import a2a_pb2_grpc
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from a2a_grpc_server import A2AServer
from a2a_grpc_server._internal.rpc.jwtauth import REFRESH_EVERY, JwtAuthenticator
from tests.support.agents import WhoAgent
from tests.support.harness import V1, rich_status, send_request

ISSUER, AUDIENCE = "https://issuer.example", "a2a-agent"


def keypair(kid: str) -> tuple[ec.EllipticCurvePrivateKey, dict[str, Any]]:
    private = ec.generate_private_key(ec.SECP256R1())
    public: dict[str, Any] = json.loads(ECAlgorithm.to_jwk(private.public_key()))
    public |= {"kid": kid, "alg": "ES256", "use": "sig"}
    return private, public


def token(key: ec.EllipticCurvePrivateKey, kid: str, **claims: Any) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "iat": now, "exp": now + 600}
    return jwt.encode(body | claims, key, algorithm="ES256", headers={"kid": kid})


@contextlib.asynccontextmanager
async def jwt_server(
    agent: WhoAgent, jwks: Path | str
) -> AsyncIterator[a2a_pb2_grpc.A2AServiceStub]:
    auth = JwtAuthenticator(str(jwks), ISSUER, AUDIENCE, allow_http_loopback=True)
    server = A2AServer(agent, host="127.0.0.1", port=0, http_port=None, auth=auth)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            yield a2a_pb2_grpc.A2AServiceStub(channel)
    finally:
        await server.stop(grace=0)


async def call(stub: a2a_pb2_grpc.A2AServiceStub, jwt_token: str) -> None:
    metadata = (*V1, ("authorization", f"Bearer {jwt_token}"))
    await stub.SendMessage(send_request("hi"), metadata=metadata)


async def test_jwts_are_verified_and_name_the_caller(tmp_path: Path) -> None:
    key, public = keypair("k1")
    stranger, _ = keypair("k9")
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [public]}))
    agent = WhoAgent()
    async with asyncio.timeout(20), jwt_server(agent, jwks) as stub:
        await call(stub, token(key, "k1"))
        assert agent.users == [("alice", True)]
        for bad, says in (
            (token(key, "k1", exp=int(time.time()) - 3600), "expired"),
            (token(key, "k1", aud="someone-else"), "not for audience"),
            (token(key, "k1", iss="https://evil.example"), "not issued by"),
            (token(stranger, "k9"), "does not know"),
            (token(stranger, "k1"), "not valid"),  # the right kid, the wrong signature
            ("not-a-jwt", "not a JWT"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(stub, bad)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, says
            assert rich_status(caught.value)[1].reason == "UNAUTHENTICATED"
            assert says in (caught.value.details() or ""), (says, caught.value.details())
        assert len(agent.users) == 1, "no refused call ran the executor"


async def test_a_rotated_jwks_is_read_when_a_token_names_its_new_key(tmp_path: Path) -> None:
    old, old_public = keypair("k1")
    new, new_public = keypair("k2")
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [old_public]}))
    agent = WhoAgent()
    async with asyncio.timeout(20), jwt_server(agent, jwks) as stub:
        await call(stub, token(old, "k1", sub="before"))
        jwks.write_text(json.dumps({"keys": [new_public]}))  # the issuer rotated its key
        await call(stub, token(new, "k2", sub="after"))
        assert agent.users == [("before", True), ("after", True)]


def test_a_jwks_without_a_usable_key_is_refused(tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{"kty": "nope"}]}))
    with pytest.raises(ValueError, match="no usable key"):
        JwtAuthenticator(str(jwks), ISSUER, AUDIENCE)
    with pytest.raises(ValueError, match="cannot be read"):
        JwtAuthenticator(str(tmp_path / "missing.json"), ISSUER, AUDIENCE)


@contextlib.contextmanager
def jwks_endpoint(
    document: dict[str, Any] | None, *, status: int | list[int] = 200, delay: float = 0.0
) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on 127.0.0.1 answering ``status`` at /jwks (a list: one per request in
    turn, the last one repeated), with ``document`` (None: no body) after ``delay`` seconds;
    yields its URL and the paths of the requests it received."""
    seen: list[str] = []
    body = json.dumps(document).encode() if document is not None else b""
    statuses = status if isinstance(status, list) else [status]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            if delay:
                time.sleep(delay)  # sync-ok: a slow endpoint, so concurrent calls overlap it
            self.send_response(statuses[min(len(seen), len(statuses)) - 1])
            if body:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/jwks", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


async def test_a_jwks_url_is_fetched_and_not_hammered_by_unknown_key_ids() -> None:
    key, public = keypair("k1")
    stranger, _ = keypair("k9")
    agent = WhoAgent()
    with jwks_endpoint({"keys": [public]}) as (url, seen):
        async with asyncio.timeout(20), jwt_server(agent, url) as stub:
            await call(stub, token(key, "k1"))
            assert seen == ["/jwks"], "read at the first call"
            for _ in range(5):  # a flood of tokens naming keys the JWKS lacks
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(stub, token(stranger, "k9"))
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(seen) == 1, f"read again at most once per {REFRESH_EVERY} s"
            await call(stub, token(key, "k1"))
    assert agent.users == [("alice", True), ("alice", True)]


async def test_a_failing_jwks_endpoint_is_read_once_however_many_calls_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key, _ = keypair("k1")
    with jwks_endpoint(None, status=503, delay=0.2) as (url, seen):
        clock = Clock()  # (still: the call after them comes before any retry is due)
        auth = JwtAuthenticator(url, ISSUER, AUDIENCE, allow_http_loopback=True, clock=clock)
        agent = WhoAgent()
        server = A2AServer(agent, host="127.0.0.1", port=0, http_port=None, auth=auth)
        await server.start()
        try:
            async with asyncio.timeout(20), grpc.aio.insecure_channel(server.grpc_address) as ch:
                stub = a2a_pb2_grpc.A2AServiceStub(ch)
                calls = [call(stub, token(key, "k1")) for _ in range(40)]
                refused = await asyncio.gather(*calls, return_exceptions=True)
                again = await asyncio.gather(call(stub, token(key, "k1")), return_exceptions=True)
        finally:
            await server.stop(grace=0)
    for err in [*refused, *again]:
        assert isinstance(err, grpc.aio.AioRpcError), err
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert seen == ["/jwks"], f"one read for 40 calls, none again within {REFRESH_EVERY} s"
    warnings = [r for r in caplog.records if "JWKS" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert agent.users == []


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def jwks_url_server(
    agent: WhoAgent, url: str, clock: Clock
) -> AsyncIterator[a2a_pb2_grpc.A2AServiceStub]:
    auth = JwtAuthenticator(url, ISSUER, AUDIENCE, allow_http_loopback=True, clock=clock)
    server = A2AServer(agent, host="127.0.0.1", port=0, http_port=None, auth=auth)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            yield a2a_pb2_grpc.A2AServiceStub(channel)
    finally:
        await server.stop(grace=0)


async def refused(stub: a2a_pb2_grpc.A2AServiceStub, jwt_token: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(stub, jwt_token)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_until_a_first_jwks_read_succeeds_a_failed_read_is_retried_sooner() -> None:
    # The first failed read meant REFRESH_EVERY (30 s) of UNAUTHENTICATED for everyone, even
    # when the endpoint was back a moment later (issue 22). With no key held, a failed read is
    # retried after 1 s, then 2 s, ... (less up to a fifth of jitter), still one at a time.
    key, public = keypair("k1")
    stranger, _ = keypair("k9")
    agent, clock = WhoAgent(), Clock()
    with jwks_endpoint({"keys": [public]}, status=[503, 503, 200], delay=0.1) as (url, seen):
        async with asyncio.timeout(20), jwks_url_server(agent, url, clock) as stub:
            await asyncio.gather(*(refused(stub, token(key, "k1")) for _ in range(20)))
            assert len(seen) == 1, "concurrent calls share one read"
            for elapsed, reads in ((0.7, 1), (1.0, 2), (2.5, 2)):  # retries at >=0.8 and >=1.6
                clock.now = 1000.0 + elapsed
                await refused(stub, token(key, "k1"))
                assert len(seen) == reads, elapsed
            clock.now = 1000.0 + 3.0  # the endpoint is back
            await call(stub, token(key, "k1"))
            assert len(seen) == 3
            clock.now += REFRESH_EVERY - 1  # once keys are held, unknown ones wait the bound
            await refused(stub, token(stranger, "k9"))
            assert len(seen) == 3
    assert agent.users == [("alice", True)]


async def test_a_jwks_endpoint_down_from_the_start_is_read_a_bounded_number_of_times() -> None:
    key, _ = keypair("k1")
    agent, clock = WhoAgent(), Clock()
    with jwks_endpoint(None, status=503) as (url, seen):
        async with asyncio.timeout(30), jwks_url_server(agent, url, clock) as stub:
            for _ in range(120):  # a call a second for two minutes
                await refused(stub, token(key, "k1"))
                clock.now += 1.0
    # Reads at 0, 1, 3, 7, then ever further apart, up to REFRESH_EVERY: at most 9.
    assert 6 <= len(seen) <= 9, len(seen)
    assert agent.users == []


def test_a_jwks_url_must_be_https_unless_loopback_http_is_allowed() -> None:
    with pytest.raises(ValueError, match="is not https"):
        JwtAuthenticator("http://keys.example/jwks", ISSUER, AUDIENCE)
    with pytest.raises(ValueError, match="is not https"):
        JwtAuthenticator("http://127.0.0.1:9/jwks", ISSUER, AUDIENCE)
    with pytest.raises(ValueError, match="is not https"):  # allowed for loopback only
        JwtAuthenticator("http://keys.example/jwks", ISSUER, AUDIENCE, allow_http_loopback=True)
    for url in ("http://127.0.0.1:9/jwks", "http://[::1]:9/jwks", "https://keys.example/j"):
        JwtAuthenticator(url, ISSUER, AUDIENCE, allow_http_loopback=True)  # (read at first call)

"""Deploys as Kubernetes makes them (issue 21): the shipped manifest's environment with the
service-link variables Kubernetes injects, the advertised address, ports, the drain on
SIGTERM, ``--version``, and settings that are not settings."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import AgentCapabilities, AgentCard, GetTaskRequest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from a2a_grpc_server import A2AServer, A2AService, ServerConfig
from a2a_grpc_server._internal.app import settings
from a2a_grpc_server._internal.app.settings import SettingError
from a2a_grpc_server._internal.jetstream import formats
from a2a_grpc_server.agents.echo import EchoAgent
from tests.support import ROOT
from tests.support.certs import issue
from tests.support.harness import V1, error_of, rich_status, send_request, serve
from tests.support.serveproc import start

SERVICE_LINKS = {
    # What Kubernetes puts in every pod of the namespace for the Service named
    # a2a-grpc-server in examples/kubernetes.yaml (ports grpc 50051 and http 8080).
    "A2A_GRPC_SERVER_SERVICE_HOST": "10.96.14.7",
    "A2A_GRPC_SERVER_SERVICE_PORT": "50051",
    "A2A_GRPC_SERVER_SERVICE_PORT_GRPC": "50051",
    "A2A_GRPC_SERVER_SERVICE_PORT_HTTP": "8080",
    "A2A_GRPC_SERVER_PORT": "tcp://10.96.14.7:50051",
    "A2A_GRPC_SERVER_PORT_50051_TCP": "tcp://10.96.14.7:50051",
    "A2A_GRPC_SERVER_PORT_50051_TCP_PROTO": "tcp",
    "A2A_GRPC_SERVER_PORT_50051_TCP_PORT": "50051",
    "A2A_GRPC_SERVER_PORT_50051_TCP_ADDR": "10.96.14.7",
    "A2A_GRPC_SERVER_PORT_8080_TCP": "tcp://10.96.14.7:8080",
    "A2A_GRPC_SERVER_PORT_8080_TCP_PROTO": "tcp",
    "A2A_GRPC_SERVER_PORT_8080_TCP_PORT": "8080",
    "A2A_GRPC_SERVER_PORT_8080_TCP_ADDR": "10.96.14.7",
}
ENV_LINE = re.compile(r"- \{name: (A2A_GRPC_SERVER_\w+), value: \"?([^\"}]*)\"?\}")


def manifest_env() -> dict[str, str]:
    """The server container's environment in examples/kubernetes.yaml."""
    text = (ROOT / "examples" / "kubernetes.yaml").read_text()
    found = dict(ENV_LINE.findall(text))
    assert "A2A_GRPC_SERVER_NATS" in found and "A2A_GRPC_SERVER_ADVERTISE" in found
    return found


def check_config(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("A2A_GRPC_SERVER_")}
    return subprocess.run(
        [sys.executable, "-m", "a2a_grpc_server.cli", "check-config", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_shipped_manifest_starts_with_the_service_links_kubernetes_injects(
    tmp_path: Path,
) -> None:
    env = {**manifest_env(), **SERVICE_LINKS}
    tokens = tmp_path / "tokens"  # (the manifest mounts its Secret there)
    tokens.write_text("billing-agent:replace-me-with-a-long-random-token\n")
    env["A2A_GRPC_SERVER_AUTH_TOKENS"] = str(tokens)
    key = tmp_path / "cluster.key"  # (from the same Secret, once replaced: see below)
    key.write_text("replace-me-with-the-output-of-openssl-rand-hex-32\n")
    assert (
        "placeholder" in check_config(env={**env, "A2A_GRPC_SERVER_NATS_KEY_FILE": str(key)}).stderr
    )
    key.write_text(secrets.token_hex(32))
    assert env["A2A_GRPC_SERVER_NATS_KEY_FILE"] == "/etc/a2a/cluster.key"
    env["A2A_GRPC_SERVER_NATS_KEY_FILE"] = str(key)
    done = check_config(env=env)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^port = 50051\b", done.stdout, re.M), "the link's tcp:// is no port"
    assert 'advertise = "a2a-grpc-server:50051"' in done.stdout
    assert re.search(r"^shutdown_drain = 5\.0\b", done.stdout, re.M)
    assert "SERVICE_HOST" not in done.stdout


def test_service_link_variables_are_told_from_settings() -> None:
    for name, value in SERVICE_LINKS.items():
        assert settings.service_link(name, value), name
    assert not settings.service_link("A2A_GRPC_SERVER_PORT", "50052"), "a real setting"
    assert not settings.service_link("A2A_GRPC_SERVER_SERVICE_HOSTS", "x")
    values = settings.resolve({}, {**SERVICE_LINKS, "A2A_GRPC_SERVER_PORT": "50052"}, None)
    assert values["port"] == (50052, "env A2A_GRPC_SERVER_PORT")


def test_a_misspelt_setting_names_the_one_it_probably_meant() -> None:
    with pytest.raises(SettingError) as refused:
        settings.resolve({}, {"A2A_GRPC_SERVER_CANCEL_TIMOUT": "3"}, None)
    assert str(refused.value).startswith(
        "A2A_GRPC_SERVER_CANCEL_TIMOUT (did you mean A2A_GRPC_SERVER_CANCEL_TIMEOUT?) "
        "is not a setting"
    )


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (("--port", "70000"), {}, "--port = 70000: not a port"),
        (("--http-port", "70000"), {}, "--http-port = 70000: not a port"),
        (("--port", "-1"), {}, "--port = -1: not a port"),
        ((), {"A2A_GRPC_SERVER_PORT": "65536"}, "A2A_GRPC_SERVER_PORT = 65536: not a port"),
        (("--advertise", "0.0.0.0:50051"), {}, "not an address clients can reach"),
        (("--advertise", "agents.example"), {}, "not HOST:PORT"),
        (("--advertise", "agents.example:0"), {}, "not HOST:PORT"),
    ],
)
def test_ports_and_the_advertised_address_are_checked_before_serving(
    args: tuple[str, ...], env: dict[str, str], said: str
) -> None:
    done = check_config(*args, env=env)
    assert done.returncode == 2, done.stdout
    assert said in done.stderr
    assert "Traceback" not in done.stderr


def test_version_says_the_version_and_the_formats_it_reads() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "a2a_grpc_server.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    )
    assert done.stdout.strip() == f"a2a-grpc-server {formats.version()} (formats read: [1, 2, 3])"


async def test_the_card_gives_the_advertised_address_not_the_bind_address() -> None:
    async with asyncio.timeout(20):
        server = A2AServer(EchoAgent(), port=0, http_port=0, advertise="agents.example:443")
        await server.start()
        try:
            url = f"http://127.0.0.1:{server.http_port}/.well-known/agent-card.json"
            async with aiohttp.ClientSession() as session, session.get(url) as reply:
                card = await reply.json()
            assert [i["url"] for i in card["supportedInterfaces"]] == ["agents.example:443"]
            assert server.grpc_address.startswith("127.0.0.1:"), "bound where it was told"
        finally:
            await server.stop(grace=0)
    wildcard = A2AServer(EchoAgent(), host="0.0.0.0", port=0, http_port=None)  # (never started)
    assert not wildcard.advertised_address.startswith(("0.0.0.0", "[::]"))


async def test_sigterm_says_not_serving_at_once_and_accepts_for_the_drain_delay() -> None:
    server = await start("--shutdown-drain", "3")
    try:
        async with asyncio.timeout(30), grpc.aio.insecure_channel(server.grpc_addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service="lf.a2a.v1.A2AService"))
            first = await anext(aiter(watch))
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            server.proc.send_signal(signal.SIGTERM)
            changed = await anext(aiter(watch))
            assert changed.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Still accepting: a load balancer that has not noticed yet loses nothing.
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            answer = await stub.SendMessage(send_request("still here"), metadata=V1, timeout=5)
            assert answer.task.status.state == 3  # TASK_STATE_COMPLETED (the echo agent)
            watch.cancel()
            assert await server.proc.wait() == 0
    finally:
        if server.proc.returncode is None:
            server.proc.kill()
            await server.proc.wait()


async def probe(*args: str, env: dict[str, str] | None = None) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("A2A_GRPC_SERVER_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "a2a_grpc_server.healthcheck",
        *args,
        cwd=ROOT,
        env={**clean, **(env or {})},
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await proc.wait()


async def test_the_health_probe_speaks_tls_and_reads_the_settings_serve_reads(
    tmp_path: Path,
) -> None:
    issued = issue(tmp_path, dns=("localhost",))
    (tmp_path / "other").mkdir()
    tls = ("--tls-cert", str(issued.cert), "--tls-key", str(issued.key))
    server = await start(*tls)
    port = server.grpc_addr.rsplit(":", 1)[1]
    try:
        async with asyncio.timeout(60):
            assert await probe("--port", port, *tls, "--ca", str(issued.ca)) == 0
            as_variables = {
                "A2A_GRPC_SERVER_PORT": port,
                "A2A_GRPC_SERVER_TLS_CERT": str(issued.cert),
                "A2A_GRPC_SERVER_TLS_KEY": str(issued.key),
            }
            assert await probe("--ca", str(issued.ca), env=as_variables) == 0
            assert await probe("--port", port) == 1, "plaintext to a TLS server: not serving"
            assert await probe("--port", port, *tls) == 0, "its own certificate, pinned"
            other = issue(tmp_path / "other", dns=("localhost",))
            mismatched = ("--tls-cert", str(other.cert), "--tls-key", str(other.key))
            assert await probe("--port", port, *mismatched) == 1, "not the server's certificate"
            unreadable = ("--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(issued.key))
            assert await probe("--port", port, *unreadable) == 2, "a setting it cannot read"
    finally:
        server.proc.send_signal(signal.SIGTERM)
        await server.proc.wait()


async def test_reflection_is_served_as_v1_and_v1alpha() -> None:
    async with asyncio.timeout(20):
        server = A2AServer(EchoAgent(), port=0, http_port=None)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.grpc_address) as channel:
                for version in ("v1", "v1alpha"):
                    call = channel.stream_stream(
                        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                    )
                    asks = [
                        reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(
                            file_containing_symbol="lf.a2a.v1.A2AService"
                        ),
                    ]
                    answers = [answer async for answer in call(iter(asks))]
                    names = {s.name for s in answers[0].list_services_response.service}
                    assert {"lf.a2a.v1.A2AService", "grpc.reflection.v1.ServerReflection"} <= names
                    assert answers[1].file_descriptor_response.file_descriptor_proto, version
        finally:
            await server.stop(grace=0)


def test_push_follows_an_agent_card_that_says_it_sends_none() -> None:
    says_no = AgentCard(name="quiet", capabilities=AgentCapabilities(push_notifications=False))
    service = A2AService(EchoAgent(), says_no)
    assert service.push is None and not service.card.capabilities.push_notifications
    silent = AgentCard(name="silent", capabilities=AgentCapabilities(streaming=True))
    service = A2AService(EchoAgent(), silent)
    assert service.push is not None and service.card.capabilities.push_notifications
    service = A2AService(EchoAgent(), silent, config=ServerConfig(push=False))
    assert service.push is None and not service.card.capabilities.push_notifications


def test_links_of_other_services_named_after_ours_and_stray_names_get_no_wild_guess() -> None:
    metrics_links = {
        "A2A_GRPC_SERVER_METRICS_SERVICE_HOST": "10.96.14.8",
        "A2A_GRPC_SERVER_METRICS_SERVICE_PORT": "9090",
        "A2A_GRPC_SERVER_METRICS_PORT": "tcp://10.96.14.8:9090",
        "A2A_GRPC_SERVER_METRICS_PORT_9090_TCP_ADDR": "10.96.14.8",
    }
    assert settings.resolve({}, metrics_links, None)["port"] == (50051, "default")
    with pytest.raises(SettingError) as refused:
        settings.resolve({}, {"A2A_GRPC_SERVER_FOO": "1"}, None)
    assert "did you mean" not in str(refused.value)
    with pytest.raises(SettingError, match="not a port"):
        settings.resolve({}, {"A2A_GRPC_SERVER_HTTP_PORT": "99999"}, None)


async def test_a_server_stopped_under_load_cuts_no_call_cancelled() -> None:
    # Callers keep calling over their connection as the server stops (a Service balances
    # connections, not calls). grpc core cuts CANCELLED every call it received and the
    # application had not taken when the server stops: a bare grpc.aio server cuts about
    # one per caller here. Ours holds new calls while its GOAWAY goes out, then refuses
    # them UNAVAILABLE (retryable).
    server = await start("--shutdown-drain", "0.2")
    codes: dict[str, int] = {}

    async def caller(stub: a2a_pb2_grpc.A2AServiceStub) -> None:
        """Call until the first error (the server is going); count every answer."""
        for _ in range(3000):
            try:
                await stub.SendMessage(send_request("hi"), metadata=V1, timeout=5)
            except grpc.aio.AioRpcError as err:
                codes[err.code().name] = codes.get(err.code().name, 0) + 1
                return
            codes["OK"] = codes.get("OK", 0) + 1
        raise AssertionError("3000 calls answered: the server never went")

    try:
        async with asyncio.timeout(60), grpc.aio.insecure_channel(server.grpc_addr) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            await stub.SendMessage(send_request("warm"), metadata=V1, timeout=5)
            callers = [asyncio.ensure_future(caller(stub)) for _ in range(16)]
            server.proc.send_signal(signal.SIGTERM)
            assert await server.proc.wait() == 0
            await asyncio.gather(*callers)
    finally:
        if server.proc.returncode is None:
            server.proc.kill()
            await server.proc.wait()
    assert codes.get("OK", 0) > 16, codes
    assert "CANCELLED" not in codes, codes
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes


async def test_a_call_held_by_a_closing_server_is_refused_before_its_deadline() -> None:
    async with serve(EchoAgent()) as harness:
        harness.service.closing.begin()
        stub = a2a_pb2_grpc.A2AServiceStub(harness.channel)
        async with asyncio.timeout(5):
            err = await error_of(stub.SendMessage(send_request("late"), metadata=V1, timeout=0.5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, "refused, not run out of time"
        _, info = rich_status(err)
        assert info.reason == "SHUTTING_DOWN"
        harness.service.closing.release()
        err = await error_of(stub.GetTask(GetTaskRequest(id="any"), metadata=V1, timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, "after the release: refused at once"

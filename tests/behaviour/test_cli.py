"""``a2a-grpc-server serve`` as a real process: card over HTTP, health, reflection, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import grpc
import pytest
from a2a.client.transports.grpc import GrpcTransport
from a2a.types.a2a_pb2 import AgentCard, SubscribeToTaskRequest, TaskState
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from a2a_grpc_server._internal.app.cli import AgentLoadError, load_agent
from a2a_grpc_server.agents.echo import EchoAgent
from tests.support import ROOT, cluster_key_file
from tests.support.harness import samples, send_request
from tests.support.serveproc import Process, start


@pytest.fixture
async def countdown() -> AsyncIterator[Process]:
    server = await start(
        "--agent", "examples.countdown_agent:CountdownAgent", "--shutdown-grace", "0.2"
    )
    try:
        yield server
    finally:
        if server.proc.returncode is None:
            server.proc.kill()
        await server.proc.wait()


async def http_get(
    address: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    request = f"GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n{extra}\r\n"
    writer.write(request.encode())
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, hdrs, body


async def test_agent_card_is_served_with_cache_headers_and_names_the_grpc_endpoint(
    countdown: Process,
) -> None:
    async with asyncio.timeout(10):
        status, headers, body = await http_get(countdown.http_addr, "/.well-known/agent-card.json")
        assert status == 200
        assert headers["content-type"] == "application/json"
        assert "max-age" in headers["cache-control"]
        assert headers["last-modified"].endswith("GMT")
        card = json_format.Parse(body, AgentCard())
        assert card.name == "Countdown"
        grpc_iface = card.supported_interfaces[0]
        assert (grpc_iface.url, grpc_iface.protocol_binding, grpc_iface.protocol_version) == (
            countdown.grpc_addr,
            "GRPC",
            "1.0",
        )
        again, _, empty = await http_get(
            countdown.http_addr, "/.well-known/agent-card.json", {"If-None-Match": headers["etag"]}
        )
        assert (again, empty) == (304, b"")
        missing, _, _ = await http_get(countdown.http_addr, "/nope")
        assert missing == 404


async def test_metrics_are_served_in_prometheus_text_format(countdown: Process) -> None:
    async with asyncio.timeout(10):
        client = GrpcTransport(grpc.aio.insecure_channel(countdown.grpc_addr), None)
        frames = [f async for f in client.send_message_streaming(send_request("2"))]
        assert frames[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED
        await client.close()
        status, headers, body = await http_get(countdown.http_addr, "/metrics")
        assert status == 200
        assert headers["content-type"].startswith("text/plain")
        assert headers["cache-control"] == "no-store"
        found = samples(body.decode())
        assert found[("a2a_tasks_started_total", ())] == 1
        assert found[("a2a_tasks_ended_total", (("state", "TASK_STATE_COMPLETED"),))] == 1
        assert found[("a2a_log_bytes", ())] == 0, "nobody reads the ended task's frames"
        assert found[("process_cpu_seconds_total", ())] > 0


async def test_health_and_reflection_are_served(countdown: Process) -> None:
    async with asyncio.timeout(10), grpc.aio.insecure_channel(countdown.grpc_addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="lf.a2a.v1.A2AService"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        names: list[str] = []
        async for resp in refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        ):
            names.extend(s.name for s in resp.list_services_response.service)
        assert "lf.a2a.v1.A2AService" in names


async def test_sigterm_ends_running_streams_failed_and_the_process_exits_cleanly(
    countdown: Process,
) -> None:
    async with asyncio.timeout(20):
        client = GrpcTransport(grpc.aio.insecure_channel(countdown.grpc_addr), None)
        stream = client.send_message_streaming(send_request("1000"))
        first = await anext(stream)
        watcher = client.subscribe(SubscribeToTaskRequest(id=first.task.id))
        await anext(watcher)
        countdown.proc.send_signal(signal.SIGTERM)
        for frames in ([f async for f in stream], [f async for f in watcher]):
            last = frames[-1].status_update.status
            assert last.state == TaskState.TASK_STATE_FAILED
            assert "shutting down" in last.message.parts[0].text
        assert await countdown.proc.wait() == 0
        await client.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_second_sigterm_ends_every_task_at_once_with_its_final_frame(loop: str) -> None:
    server = await start(
        "--agent", "tests.support.agents:Hanging", "--shutdown-grace", "60", "--loop", loop
    )
    assert server.proc.stderr is not None
    try:
        async with asyncio.timeout(20):
            client = GrpcTransport(grpc.aio.insecure_channel(server.grpc_addr), None)
            stream = client.send_message_streaming(send_request("hang"))
            await anext(stream)
            server.proc.send_signal(signal.SIGTERM)
            while b"draining" not in await server.proc.stderr.readline():
                pass
            # Draining with a 60 s grace: the task still runs until the second signal.
            server.proc.send_signal(signal.SIGTERM)
            frames = [f async for f in stream]
            last = frames[-1].status_update.status
            assert last.state == TaskState.TASK_STATE_FAILED
            assert "shutting down" in last.message.parts[0].text
            assert await server.proc.wait() == 3
            await client.close()
    finally:
        if server.proc.returncode is None:
            server.proc.kill()
        await server.proc.wait()


async def serve_until_exit(*args: str) -> tuple[int, bytes]:
    """Run ``serve`` expecting it to fail at start; its exit code and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "a2a_grpc_server.cli", "serve", *args,
        cwd=ROOT, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(20):
        _, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, err


async def test_a_bad_agent_reference_exits_2_with_a_message() -> None:
    code, err = await serve_until_exit(
        "--agent", "tests.support.agents:not_an_agent", "--port", "0", "--http-port", "0"
    )
    assert code == 2
    assert b"not an AgentExecutor" in err


@pytest.mark.parametrize("attr", ["instance", "factory", "EchoAgent"])
def test_agent_may_be_an_instance_a_factory_or_a_class(attr: str) -> None:
    module = "tests.support.agents" if attr != "EchoAgent" else "a2a_grpc_server.agents.echo"
    executor, _ = load_agent(f"{module}:{attr}")
    assert isinstance(executor, EchoAgent)


@pytest.mark.parametrize(
    "ref", ["nomodule", "no_such_module_xyz:X", "tests.support.agents:missing"]
)
def test_malformed_agent_references_are_refused_clearly(ref: str) -> None:
    with pytest.raises(AgentLoadError, match="--agent"):
        load_agent(ref)


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
async def test_a_port_in_use_exits_1_with_a_message(flag: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        other = "--http-port" if flag == "--port" else "--port"
        code, err = await serve_until_exit(flag, port, other, "0")
    assert code == 1
    assert f"127.0.0.1:{port}" in err.decode()
    assert f"choose another port with {flag} / A2A_GRPC_SERVER_" in err.decode()
    assert b"Traceback" not in err
    assert b"add_port" not in err, "our message alone, not grpc core's before it"


async def test_an_unreachable_nats_exits_1_with_a_message_not_a_retry_loop() -> None:
    from tests.support.natsserver import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    key = ("--nats-key-file", str(cluster_key_file()))
    code, err = await serve_until_exit("--nats", url, *key, "--port", "0", "--http-port", "0")
    assert code == 1
    assert f"cannot connect to NATS at {url}".encode() in err
    assert b"Traceback" not in err


async def ready_line(*args: str) -> str:
    """Start ``serve`` on free ports with ``args``; its ready line, once it stopped on SIGTERM."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "a2a_grpc_server.cli", "serve", "--port", "0", "--http-port", "0",
        *args, cwd=ROOT, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    said: list[str] = []
    try:
        async with asyncio.timeout(30):
            while "ready:" not in (line := (await proc.stderr.readline()).decode()):
                assert line, "exited before it was ready:\n" + "".join(said)
                said.append(line)
            card_url = urlsplit(line.split("agent card ")[1].split(",")[0])
            status, _, body = await http_get(card_url.netloc, card_url.path)
            assert status == 200, f"the card is at the URL the ready line gives: {line}"
            assert json_format.Parse(body, AgentCard()).name
            proc.send_signal(signal.SIGTERM)
            await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return "".join(said) + line


async def test_the_ready_line_gives_the_cards_whole_url_and_says_in_memory() -> None:
    said = await ready_line()
    last = said.splitlines()[-1]
    assert "/.well-known/agent-card.json, in-memory (one instance)" in last
    assert "cluster" not in last


async def test_in_cluster_mode_the_ready_line_names_nats_and_the_instance(nats_url: str) -> None:
    key = ("--nats-key-file", str(cluster_key_file()))
    said = await ready_line("--nats", nats_url, *key, "--instance-id", "first-hour-1")
    last = said.splitlines()[-1]
    assert f"cluster mode: NATS {nats_url}, instance first-hour-1" in last
    # The size note comes first, at INFO at the default sizes (nats-server's 1 MiB max_payload).
    [note] = [line for line in said.splitlines() if "max_payload" in line]
    assert " INFO " in note and "tasks are limited to 983040 bytes" in note

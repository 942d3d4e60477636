"""The load generator's scenarios: each drives one server process with real gRPC clients.

Every scenario is bounded in count and in time, and reports the server's and
this process's CPU over its wall time, so a saturated machine can be told
from a slow server.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)

ROOT = Path(__file__).resolve().parent.parent
V1 = (("a2a-version", "1.0"),)
TICK = os.sysconf("SC_CLK_TCK")
Result = dict[str, float]


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system, all its threads) process ``pid`` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


@dataclass
class Target:
    """One server process under test and clients of it."""

    kind: str
    proc: asyncio.subprocess.Process
    address: str
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    nats_pid: int | None = None
    """The nats-server it stores in, whose CPU is counted beside its own (None: none)."""

    def stub(self, i: int = 0) -> a2a_pb2_grpc.A2AServiceStub:
        """A stub on the ``i``-th channel (callers spread over a few connections)."""
        return a2a_pb2_grpc.A2AServiceStub(self.channels[i % len(self.channels)])

    def cpu(self) -> float:
        """CPU seconds the server process used so far."""
        return cpu_seconds(self.proc.pid)

    def nats_cpu(self) -> float:
        """CPU seconds its nats-server used so far (0.0 without one)."""
        return cpu_seconds(self.nats_pid) if self.nats_pid is not None else 0.0

    def rss(self) -> int:
        """The server's resident memory in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


async def start(
    kind: str,
    *,
    nats: str | None = None,
    nats_pid: int | None = None,
    uvloop: bool = False,
    extra: tuple[str, ...] = (),
    wrapper: tuple[str, ...] = (),
    ready_within: float = 30.0,
) -> Target:
    """Start ``python -m bench.servers kind``; return once it printed its port.

    A kind ending in ``+uvloop`` (e.g. ``ours+uvloop``) runs that server on uvloop;
    one ending in ``@DIR`` (e.g. ``ours@../before``) serves the server code of the
    checkout at DIR (its ``server/`` first on ``PYTHONPATH``; the benchmark's own
    code stays this checkout's). ``extra`` are more arguments for ``bench.servers``;
    ``wrapper`` the command it runs under (e.g. valgrind), ``ready_within`` how
    many seconds it may take to start.
    """
    named, _, code = kind.partition("@")
    base, _, loop = named.partition("+")
    uvloop = uvloop or loop == "uvloop"
    args = [*wrapper, sys.executable, "-m", "bench.servers", base, *extra]
    args += ["--nats", nats] if nats else []
    args += ["--uvloop"] if uvloop else []
    env = {**os.environ, "PYTHONPATH": _server_code(kind, code)} if code else None
    proc = await asyncio.create_subprocess_exec(
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(ready_within):
            line = (await proc.stdout.readline()).decode().split()
        if line[:1] != ["ready"]:
            raise RuntimeError(f"{kind} did not start")
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    address = f"127.0.0.1:{line[1]}"
    channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
    return Target(kind, proc, address, channels, nats_pid if nats else None)


def _server_code(kind: str, checkout: str) -> str:
    """The source root of ``checkout`` (for ``kind@checkout``)."""
    source = Path(checkout).resolve() / "server"
    if not (source / "a2a_grpc_server").is_dir():
        raise ValueError(f"{kind}: {source} holds no a2a_grpc_server package")
    return str(source)


async def stop(target: Target) -> None:
    """Stop the server and close the clients."""
    for channel in target.channels:
        await channel.close()
    if target.proc.returncode is None:
        target.proc.terminate()
        try:
            async with asyncio.timeout(10):
                await target.proc.wait()
        except TimeoutError:
            target.proc.kill()
            await target.proc.wait()


def request(
    text: str, *, immediately: bool = False, webhook: str | None = None
) -> SendMessageRequest:
    """A SendMessageRequest with one text part (and an inline push config for ``webhook``)."""
    configuration = SendMessageConfiguration(return_immediately=immediately)
    if webhook is not None:
        configuration.task_push_notification_config.url = webhook
    return SendMessageRequest(
        message=Message(
            message_id=os.urandom(8).hex(), role=Role.ROLE_USER, parts=[Part(text=text)]
        ),
        configuration=configuration,
    )


def pct(samples: list[float], q: float) -> float:
    """The ``q`` quantile of ``samples`` (nearest rank)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


async def measured(target: Target, body: Callable[[], Awaitable[Result]]) -> Result:
    """Run ``body`` and add wall time and server / client CPU use to its result.

    With ``units`` in the result (tasks or frames the server handled), also the
    server's CPU microseconds per unit, what noise moves least; ``units`` is
    then dropped.
    """
    cpu0, mine0, t0 = target.cpu(), time.process_time(), time.perf_counter()
    nats0 = target.nats_cpu()
    result = await body()
    wall = time.perf_counter() - t0
    server_cpu = target.cpu() - cpu0
    nats_cpu = target.nats_cpu() - nats0
    result["server_cpu_pct"] = 100 * server_cpu / wall
    result["client_cpu_pct"] = 100 * (time.process_time() - mine0) / wall
    if target.nats_pid is not None:
        result["nats_cpu_pct"] = 100 * nats_cpu / wall
    units = result.pop("units", 0)
    if units:
        result["server_cpu_us_per_unit"] = 1e6 * server_cpu / units
        if target.nats_pid is not None:
            result["nats_cpu_us_per_unit"] = 1e6 * nats_cpu / units
    return result


async def send_message(
    target: Target,
    callers: int,
    seconds: float,
    most: int,
    *,
    webhook: str | None = None,
    drained: Callable[[int], Awaitable[Result]] | None = None,
) -> Result:
    """Blocking SendMessage ("unary") from ``callers`` concurrent callers.

    With ``webhook``, each task carries an inline push config for it, and
    ``drained(tasks)`` waits until the webhook got every task's final frame
    (its result is merged; the server CPU then covers the deliveries too).
    """
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        stub = target.stub(i)
        while time.perf_counter() < deadline and len(latencies) < most:
            t = time.perf_counter()
            await stub.SendMessage(request("unary", webhook=webhook), metadata=V1)
            latencies.append((time.perf_counter() - t) * 1000)

    async def body() -> Result:
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        wall = time.perf_counter() - t0
        result = {
            "tasks_per_s": len(latencies) / wall,
            "p50_ms": statistics.median(latencies),
            "p99_ms": pct(latencies, 0.99),
            "n": len(latencies),
            "units": len(latencies),
        }
        if drained is not None:
            result |= await drained(len(latencies))
        return result

    return await measured(target, body)


async def streaming(target: Target, callers: int, seconds: float, most: int) -> Result:
    """SendStreamingMessage ("stream", 13 frames) from ``callers`` concurrent callers."""
    frames = 0
    streams = 0
    deadline = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        nonlocal frames, streams
        stub = target.stub(i)
        while time.perf_counter() < deadline and streams < most:
            async for _ in stub.SendStreamingMessage(request("stream"), metadata=V1):
                frames += 1
            streams += 1

    async def body() -> Result:
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        wall = time.perf_counter() - t0
        return {
            "streams_per_s": streams / wall,
            "frames_per_s": frames / wall,
            "n": streams,
            "units": frames,
        }

    return await measured(target, body)


async def subscribe(
    stub: a2a_pb2_grpc.A2AServiceStub, task_id: str
) -> AsyncIterator[StreamResponse]:
    """SubscribeToTask; returns once the snapshot frame arrived."""
    call = stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
    stream: AsyncIterator[StreamResponse] = aiter(call)
    first = await anext(stream)
    assert first.WhichOneof("payload") == "task"
    return stream


async def fan_out(
    target: Target,
    subscribers: int,
    count: int = 1000,
    *,
    webhook: str | None = None,
    within: float = 180.0,
) -> Result:
    """One task producing ``count`` updates to ``subscribers`` SubscribeToTask streams
    (and to ``webhook``, if given, as a push config of the task); frames not read
    ``within`` seconds count as missing."""
    delay_ms = 500 + 20 * subscribers
    started = await target.stub().SendMessage(
        request(f"fanout {count} {delay_ms}", immediately=True, webhook=webhook), metadata=V1
    )
    task_id = started.task.id
    attach_by = time.perf_counter() + delay_ms / 1000
    streams = [await subscribe(target.stub(i), task_id) for i in range(subscribers)]
    if time.perf_counter() > attach_by:
        raise RuntimeError("subscribers attached after the producer started; raise the delay")
    lags: list[float] = []
    first: list[float] = []
    last: list[float] = []
    got = 0
    finals = 0

    async def read(stream: AsyncIterator[StreamResponse]) -> None:
        nonlocal got, finals
        frame = None
        async for frame in stream:
            if frame.WhichOneof("payload") == "artifact_update":
                now = time.time_ns()
                if not first:
                    first.append(time.perf_counter())
                lags.append((now - int(frame.artifact_update.artifact.parts[0].text)) / 1e6)
                got += 1
        last.append(time.perf_counter())
        if frame is not None and frame.status_update.status.state == TaskState.TASK_STATE_COMPLETED:
            finals += 1

    async def body() -> Result:
        readers = [asyncio.ensure_future(read(s)) for s in streams]
        _, late = await asyncio.wait(readers, timeout=within)
        for reader in late:  # a server that stalled: what did not arrive counts as missing
            reader.cancel()
        await asyncio.wait(readers)
        if late:
            last.append(time.perf_counter())
        span = max(last) - first[0] if first else float("nan")
        return {
            "frames_per_s": got / span,
            "missing_frames": count * subscribers - got,
            "missing_final_frames": subscribers - finals,
            "units": got,
            "lag_p50_ms": statistics.median(lags) if lags else float("nan"),
            "lag_p99_ms": pct(lags, 0.99),
        }

    return await measured(target, body)


async def burst_unread(
    target: Target, tasks: int = 20, count: int = 5000, window: float = 4.0
) -> Result:
    """Other callers during a burst: ``tasks`` tasks each produce ``count`` updates to a
    subscriber that does not read; meanwhile a caller on its own connection sends a
    SendMessage every 10 ms for ``window`` seconds from the burst's start (its latency is
    what the burst costs everyone else); then the subscribers read everything.
    """
    delay_ms = 1000 + 50 * tasks  # (a2a-sdk, busy, took over 900 ms to attach 20)
    ids = []
    for i in range(tasks):
        reply = await target.stub(i).SendMessage(
            request(f"fanout {count} {delay_ms}", immediately=True), metadata=V1
        )
        ids.append(reply.task.id)
    attach_by = time.perf_counter() + delay_ms / 1000
    streams = [await subscribe(target.stub(i), task_id) for i, task_id in enumerate(ids)]
    if time.perf_counter() > attach_by:
        raise RuntimeError("subscribers attached after the producers started; raise the delay")
    probes: list[float] = []
    got = 0
    finals = 0

    async def read(stream: AsyncIterator[StreamResponse]) -> None:
        nonlocal got, finals
        frame = None
        async for frame in stream:
            got += frame.WhichOneof("payload") == "artifact_update"
        if frame is not None and frame.status_update.status.state == TaskState.TASK_STATE_COMPLETED:
            finals += 1

    async def body() -> Result:
        async with grpc.aio.insecure_channel(target.address) as channel:
            other = a2a_pb2_grpc.A2AServiceStub(channel)
            await other.SendMessage(request("unary"), metadata=V1)  # connected before the burst
            await asyncio.sleep(max(0.0, attach_by - time.perf_counter()))
            until = time.perf_counter() + window
            while time.perf_counter() < until and len(probes) < 10_000:
                t = time.perf_counter()
                await other.SendMessage(request("unary"), metadata=V1, timeout=60)
                probes.append((time.perf_counter() - t) * 1000)
                await asyncio.sleep(0.01)
        async with asyncio.timeout(180):
            await asyncio.gather(*(read(s) for s in streams), return_exceptions=True)
        return {
            "other_p50_ms": statistics.median(probes),
            "other_p99_ms": pct(probes, 0.99),
            "other_max_ms": max(probes),
            "missing_frames": count * tasks - got,
            "missing_final_frames": tasks - finals,
            "units": got,
        }

    return await measured(target, body)


async def cancel(target: Target, tasks: int = 200) -> Result:
    """Park ``tasks`` tasks, each with a subscriber; cancel each; time to its final frame."""
    parked = []
    for i in range(tasks):
        reply = await target.stub(i).SendMessage(request("park", immediately=True), metadata=V1)
        parked.append((reply.task.id, await subscribe(target.stub(i), reply.task.id)))
    latencies: list[float] = []
    missing = 0

    async def body() -> Result:
        nonlocal missing
        for i, (task_id, stream) in enumerate(parked):
            t = time.perf_counter()
            reply = target.stub(i).CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
            final = None
            async for frame in stream:
                if frame.WhichOneof("payload") == "status_update":
                    final = frame.status_update.status.state
                    if final == TaskState.TASK_STATE_CANCELED:
                        latencies.append((time.perf_counter() - t) * 1000)
                        break
            if final != TaskState.TASK_STATE_CANCELED:
                missing += 1
            await reply
        return {
            "p50_ms": statistics.median(latencies) if latencies else float("nan"),
            "p99_ms": pct(latencies, 0.99),
            "missing_final_frames": missing,
        }

    return await measured(target, body)


async def parked_memory(
    target: Target, tasks: int, *, with_subscriber: bool, seconds: float
) -> Result:
    """Resident memory per parked task (with one open subscriber each, if asked)."""
    base = target.rss()
    streams = []
    deadline = time.perf_counter() + seconds
    made = 0
    for i in range(tasks):
        if time.perf_counter() > deadline:
            break
        reply = await target.stub(i).SendMessage(request("park", immediately=True), metadata=V1)
        if with_subscriber:
            streams.append(await subscribe(target.stub(i), reply.task.id))
        made += 1
    await asyncio.sleep(0.5)  # let the server settle its allocations before reading RSS
    per_task = (target.rss() - base) / max(made, 1)
    return {"bytes_per_task": per_task, "tasks": made}

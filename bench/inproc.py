"""``python -m bench.inproc``: what our code costs per call without gRPC, and how it grows.

    .venv/bin/python -m bench.inproc [--kind unary|stream] [--calls 1000,10000,100000]
                                     [--callers 16] [--set NAME=VALUE ...] [--nats]
                                     [--profile PATH]

For each count N, a fresh ``A2AService`` (every default, the ``Workload`` agent,
in memory) in this process is called N times through its servicer, at
``--callers`` at a time, with a stand-in for grpc.aio's servicer context (no
network, no gRPC): ``unary`` is a blocking SendMessage, ``stream`` a
SendStreamingMessage of 13 frames. It prints the CPU per call
(``time.process_time``) after 200 calls to warm up; what the ended calls leave
for the garbage collector (tracked objects still alive, per call) and what a
full collection then takes; and the exponent of the total time in N fitted
over the counts (1.0: each call costs the same however many came before).
Bounded in count; every call in ``asyncio.timeout``. ``--set`` changes a
``ServerConfig`` setting (repeatable; printed first), to measure what a
feature costs, e.g. ``--set idempotency_window=0``. ``--nats`` makes the service an
instance of a cluster on a nats-server of its own (started on a free loopback port;
its CPU is not counted), ``--profile`` writes a cProfile of the measured calls.

What it leaves out is what ``python -m bench`` adds: grpc.aio's call machinery
and the interceptors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import math
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from a2a.types.a2a_pb2 import Message, Part, Role, SendMessageRequest

from a2a_grpc_server import A2AService, ServerConfig
from a2a_grpc_server._internal.app.card import default_card
from a2a_grpc_server._internal.app.settings import SETTINGS, SettingError, resolve, server_config

from .agents import Workload
from .servers import settled

WARM_UP = 200
FULL_PASSES = 3
CALL_AT_MOST = 10.0
"""Seconds one call may take."""


class Context:
    """What the servicer asks of grpc.aio's servicer context, answered at once."""

    def __init__(self) -> None:
        self.written = 0

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The client's metadata: an A2A 1.0 client."""
        return (("a2a-version", "1.0"),)

    def time_remaining(self) -> float | None:
        """No deadline."""
        return None

    async def send_initial_metadata(self, metadata: Any) -> None:
        """Nothing to send."""

    async def write(self, message: Any) -> None:
        """Count a streamed frame."""
        self.written += 1


def _request(text: str) -> SendMessageRequest:
    return SendMessageRequest(
        message=Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, parts=[Part(text=text)])
    )


@dataclass
class Measured:
    """What ``calls`` calls cost, and what they left for the garbage collector."""

    cpu_us: float
    """CPU microseconds per call."""
    kept: float
    """Objects the collector tracks that the ended calls left in memory, per call."""
    full_ms: float
    """What one full collection takes with them kept (median of ``FULL_PASSES``)."""


async def measure(
    kind: str,
    calls: int,
    callers: int,
    config: ServerConfig | None = None,
    nats: str = "",
    profile: str = "",
) -> Measured:
    """What ``calls`` calls on a fresh service cost (see ``Measured``).

    With ``nats`` (a URL) the service is an instance of a cluster on it; with
    ``profile`` (a path) the measured calls are profiled (cProfile) into it.
    """
    cluster = None
    if nats:
        from a2a_grpc_server._internal.jetstream.conn import NatsConfig
        from a2a_grpc_server._internal.jetstream.node import NatsCluster
        from tests.support import CLUSTER_KEY

        cluster = await NatsCluster.connect(NatsConfig(servers=[nats], key=CLUSTER_KEY))
    service = A2AService(Workload(), default_card(), cluster=cluster, config=config)
    await service.start()
    if cluster is not None:
        await settled(cluster)
    servicer: Any = service.servicer
    text = "unary" if kind == "unary" else "stream"

    async def one() -> None:
        context = Context()
        async with asyncio.timeout(CALL_AT_MOST):
            if kind == "unary":
                await servicer.SendMessage(_request(text), context)
            else:
                await servicer.SendStreamingMessage(_request(text), context)
                if context.written != 13:
                    raise RuntimeError(f"a stream wrote {context.written} frames, not 13")

    async def caller(count: int) -> None:
        for _ in range(count):
            await one()

    try:
        await caller(WARM_UP)
        gc.collect()
        gc.freeze()  # (as `a2a-grpc-server serve` does)
        tracked = len(gc.get_objects())
        profiler = cProfile.Profile()
        if profile:
            profiler.enable()
        cpu = time.process_time()
        share, extra = divmod(calls, callers)
        await asyncio.gather(*(caller(share + (i < extra)) for i in range(callers)))
        cpu_us = 1e6 * (time.process_time() - cpu) / calls
        if profile:
            profiler.disable()
            profiler.dump_stats(profile)
        gc.collect()
        kept = (len(gc.get_objects()) - tracked) / calls
        passes = []
        for _ in range(FULL_PASSES):
            start = time.perf_counter()
            gc.collect()
            passes.append(1000 * (time.perf_counter() - start))
        return Measured(cpu_us, kept, statistics.median(passes))
    finally:
        await service.shutdown(0)
        if cluster is not None:
            await cluster.close()
        gc.unfreeze()


def exponent(counts: list[int], per_call: list[float]) -> float:
    """The least-squares slope of log(total time) on log(N)."""
    xs = [math.log(n) for n in counts]
    ys = [math.log(n * c) for n, c in zip(counts, per_call, strict=True)]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def config_of(settings: list[str]) -> ServerConfig | None:
    """``ServerConfig`` with ``NAME=VALUE`` settings changed (None: the defaults).

    Each is read as ``serve`` reads the setting's environment variable
    (``app.settings``: its kind, bounds and choices), so a value it would refuse is
    refused here too.
    """
    if not settings:
        return None
    server = {s.name: s for s in SETTINGS if s.group == "server"}
    environ: dict[str, str] = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name not in server:
            raise SystemExit(f"--set {setting}: {name!r} is not a ServerConfig setting")
        environ[server[name].env] = value
    try:
        return server_config(resolve({}, environ, None))
    except SettingError as exc:
        raise SystemExit(f"--set: {exc}") from None


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("unary", "stream"), default="unary")
    parser.add_argument("--calls", default="1000,10000,100000")
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--nats", action="store_true", help="an instance of a cluster on a nats-server of its own"
    )
    parser.add_argument("--profile", default="", help="cProfile the measured calls into PATH")
    args = parser.parse_args()
    config = config_of(args.set)
    print("settings: " + (", ".join(args.set) if args.set else "the defaults"), flush=True)
    counts = [int(n) for n in args.calls.split(",")]
    per_call = []
    with contextlib.ExitStack() as stack:
        nats = ""
        if args.nats:
            from tests.support import natsserver

            nats = stack.enter_context(natsserver.running(1)).urls[0]
        for n in counts:
            measured = asyncio.run(measure(args.kind, n, args.callers, config, nats, args.profile))
            per_call.append(measured.cpu_us)
            print(
                f"{args.kind:6} {n:>8,} calls: {measured.cpu_us:7.1f} us of CPU per call; "
                f"{measured.kept:.1f} tracked objects kept per call, a full collection "
                f"{measured.full_ms:.1f} ms",
                flush=True,
            )
    if len(set(counts)) > 1:  # (a fit needs two different counts)
        print(f"total time ~ N^{exponent(counts, per_call):.2f}")
    sys.exit(0)


if __name__ == "__main__":
    main()

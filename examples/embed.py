"""Embedding the A2A service into an existing grpc.aio server, beside your own services.

    python -m examples.embed [PORT]

The server here already serves health (think of it as yours, with its own
services); the A2A service joins it with its options (message sizes,
transport settings), its interceptors (per-RPC metrics and, with OpenTelemetry
configured, a span per call; first, so they see every call) and its collector
in the process's Prometheus registry; ``a2a.start()`` before serving (it joins
the cluster, when there is one). On SIGTERM/SIGINT: A2A first (every open
stream gets its final frame), then the server.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from a2a_grpc_server import A2AService, grpc_options
from a2a_grpc_server.agents.echo import EchoAgent


async def serve(port: int, stop: asyncio.Event, ready: Callable[[int], None]) -> None:
    """Serve on 127.0.0.1:``port`` until ``stop`` is set.

    Args:
        port: The port (0: any free port).
        stop: Set it to drain and stop.
        ready: Called with the bound port once serving.
    """
    a2a = A2AService(EchoAgent())
    server = grpc.aio.server(options=grpc_options(a2a.config), interceptors=a2a.interceptors())
    yours = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(yours, server)
    a2a.add_to_server(server)
    collector = a2a.collector()
    REGISTRY.register(collector)  # your /metrics now has the A2A metrics too
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await a2a.start()  # before serving: joins the cluster, if any
    await server.start()
    await yours.set("", health_pb2.HealthCheckResponse.SERVING)
    ready(bound)
    try:
        await stop.wait()
    finally:
        await yours.enter_graceful_shutdown()
        await a2a.shutdown(grace=10)  # every stream gets its final frame
        await server.stop(grace=2)
        REGISTRY.unregister(collector)


async def main(port: int) -> None:
    """Serve until a signal."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(port, stop, lambda bound: print(f"serving on 127.0.0.1:{bound}", flush=True))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 50051))

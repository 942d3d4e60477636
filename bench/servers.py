"""Start one server under test in this process: ``python -m bench.servers KIND``.

KIND is ``ours`` (A2AService, in-memory, on a grpc.aio server made as
``a2a-grpc-server serve`` makes it: ``grpc_options`` and the service's
interceptors, per-RPC metrics and tracing), ``ours-bare`` (the same without
the interceptors: their cost is the difference), ``ours-nats`` (A2AService joined to
the NATS given by ``--nats``; ready once it writes as a running cluster does, a lease
after it came up: ``settled``), ``ours-v10`` and ``ours-nats-v10`` (those two
with ``generation`` and ``idempotency_window`` off), ``ours-unpaced`` (``loop_slice``
0: the pacer off, to see what it costs a burst), ``ours-nats-bucket`` (new tasks in
the snapshot bucket, ``nats_task_log`` off: the layout before the task log), ``sdk`` (a2a-sdk
1.3.0: ``GrpcHandler`` over ``DefaultRequestHandler`` and ``InMemoryTaskStore``, the same
agent) or
``raw`` (``bench.raw``). Each binds 127.0.0.1 on a free port, prints
``ready <port>`` on stdout and serves until SIGTERM. ``--uvloop`` runs it on
uvloop (the ``perf`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib
import logging
import signal
import sys
from typing import Any

import grpc
import httpx
from a2a.server.request_handlers import DefaultRequestHandler, GrpcHandler
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
)
from a2a.types import a2a_pb2_grpc

from a2a_grpc_server import A2AService, ServerConfig, grpc_options

from .agents import Workload
from .raw import RawServicer


def internal(name: str) -> Any:
    """The implementation's module ``name`` (``app.card``), in this checkout or one of before
    the move under ``_internal`` (``ours@DIR`` may serve either)."""
    try:
        return importlib.import_module(f"a2a_grpc_server._internal.{name}")
    except ModuleNotFoundError as error:
        if error.name != "a2a_grpc_server._internal":  # (nats-py missing, say: not the move)
            raise
        return importlib.import_module(f"a2a_grpc_server.{name}")


KINDS = (
    "ours",
    "ours-bare",
    "ours-nats",
    "ours-v10",
    "ours-nats-v10",
    "ours-unpaced",
    "ours-nats-bucket",
    "sdk",
    "raw",
)
"""``-v10``: ours without the v1.1 generation and the idempotency of retries (both
settings off): the difference from ``ours`` is what the two cost. ``-unpaced``: ours
with ``loop_slice`` 0. ``-bucket``: new
tasks in the snapshot bucket (``nats_task_log`` off: format 2, before issue 41). Each changes
a setting on purpose, to measure it."""


async def settled(cluster: Any) -> None:
    """Until ``cluster`` writes as a running cluster does: the current format, with every
    feature its instances share, once it has heard them all (a lease after it came up,
    ``lease``: 10 s by default). Measured sooner, its first writes would be format 1's."""
    formats = internal("jetstream.formats")
    async with asyncio.timeout(cluster.conn.config.lease * 3):
        await cluster.formats.wait_for(formats.CURRENT)


async def build(
    kind: str, nats: str | None, push_to_loopback: bool = False
) -> tuple[grpc.aio.Server, A2AService | None]:
    """A grpc.aio server with the servicer of ``kind`` added (not started).

    With ``push_to_loopback`` ours may post to webhooks on 127.0.0.1 (by
    default it refuses: ``push_allow_private``), and a2a-sdk gets its push
    sender and config store (it has none by default).
    """
    service: A2AService | None = None
    if kind.startswith("ours"):
        cluster = None
        if kind.startswith("ours-nats"):
            NatsConfig = internal("jetstream.conn").NatsConfig
            NatsCluster = internal("jetstream.node").NatsCluster
            assert nats, "ours-nats needs --nats"
            from tests.support import CLUSTER_KEY

            # The defaults, and the cluster key every instance must now be given (issue 22).
            # (``-bucket``: a setting changed on purpose, to measure the layout before)
            config_nats = NatsConfig(
                servers=[nats], key=CLUSTER_KEY, task_log="-bucket" not in kind
            )
            cluster = await NatsCluster.connect(config_nats)
        # The defaults a user gets (but for the one the push benchmark must change).
        config = ServerConfig(push_allow_private=True) if push_to_loopback else None
        if kind.endswith("-v10"):  # (a setting changed on purpose: what the two cost)
            config = ServerConfig(generation=False, idempotency_window=0)
        if kind.endswith("-unpaced"):  # (a setting changed on purpose: what pacing costs)
            config = ServerConfig(loop_slice=0)
        service = A2AService(
            Workload(), internal("app.card").default_card(), cluster=cluster, config=config
        )
        await service.start()
        if cluster is not None:
            await settled(cluster)  # (measured as a running cluster writes)
        interceptors = [] if kind == "ours-bare" else service.interceptors()
        server = grpc.aio.server(
            options=[*grpc_options(service.config), ("grpc.so_reuseport", 0)],
            interceptors=interceptors,
        )
        service.add_to_server(server)
        return server, service
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    if kind == "sdk":
        card = internal("app.card").default_card()
        push: dict[str, Any] = {}
        if push_to_loopback:
            card.capabilities.push_notifications = True
            configs = InMemoryPushNotificationConfigStore()
            sender = BasePushNotificationSender(httpx.AsyncClient(), configs)
            push = {"push_config_store": configs, "push_sender": sender}
        handler = DefaultRequestHandler(Workload(), InMemoryTaskStore(), card, **push)
        a2a_pb2_grpc.add_A2AServiceServicer_to_server(GrpcHandler(handler), server)  # type: ignore[no-untyped-call]
    else:
        a2a_pb2_grpc.add_A2AServiceServicer_to_server(RawServicer(), server)  # type: ignore[no-untyped-call]
    return server, service


async def serve(
    kind: str, nats: str | None, push_to_loopback: bool, profile: str | None = None
) -> None:
    """Serve until SIGTERM (with ``profile``, a cProfile of the serving is written there)."""
    server, service = await build(kind, nats, push_to_loopback)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    gc.collect()
    gc.freeze()  # as `a2a-grpc-server serve` does, for every server alike
    profiler = cProfile.Profile()
    if profile:
        profiler.enable()
    print(f"ready {port}", flush=True)
    await stop.wait()
    if profile:  # (written before the shutdown, which may wait for webhooks)
        profiler.disable()
        profiler.dump_stats(profile)
    if service is not None:
        await service.shutdown(0)
        if service.cluster is not None:
            await service.cluster.close()
    await server.stop(None)


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--nats")
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument(
        "--push-to-loopback", action="store_true", help="webhooks on 127.0.0.1 (bench.push)"
    )
    parser.add_argument("--profile", help="write a cProfile of the serving here at SIGTERM")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    main = serve(args.kind, args.nats, args.push_to_loopback, args.profile)
    if args.uvloop:
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)
    sys.exit(0)


if __name__ == "__main__":
    main()

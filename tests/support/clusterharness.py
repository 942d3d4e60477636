"""Several server instances in this process sharing real nats-server processes.

Each instance is a full ``A2AService`` on its own grpc.aio server (127.0.0.1:0)
with its own NATS connection and instance id, as in a real deployment; they
share only NATS. On a normal exit every instance must be idle and no
coroutine of the package may be left (the same leak check as ``harness``).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from a2a.client.transports.grpc import GrpcTransport
from a2a.server.agent_execution import AgentExecutor
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import StreamResponse, TaskState

from a2a_grpc_server import A2AService, ServerConfig
from a2a_grpc_server._internal.jetstream.conn import NatsConfig
from a2a_grpc_server._internal.jetstream.formats import CURRENT
from a2a_grpc_server._internal.jetstream.node import NatsCluster
from a2a_grpc_server._internal.rpc.auth import Authenticator
from a2a_grpc_server.testing import INSTANCE_TASKS, assert_nothing_left
from tests.support import CLUSTER_KEY
from tests.support.harness import expose

S = TaskState
TASK_LOG: bool | None = None
"""Whether instances create tasks in the task log (format 3): the ``layout`` fixture sets
it to run a module's tests on both layouts, and with it set, an instance is ready once new
tasks go to that layout (a lease after start). None: the default (``nats_task_log`` on),
ready at once, its first tasks (in its first lease) in the snapshot bucket."""


@dataclass
class Instance:
    """One server instance and a client of it."""

    name: str
    service: A2AService
    cluster: NatsCluster
    server: grpc.aio.Server
    address: str
    channel: grpc.aio.Channel
    stub: a2a_pb2_grpc.A2AServiceStub
    client: GrpcTransport

    @property
    def instance_id(self) -> str:
        """The id this instance writes as owner."""
        return self.cluster.instance_id


async def start_instance(
    name: str,
    executor: AgentExecutor,
    servers: Sequence[str],
    *,
    lease: float = 2.0,
    replicas: int = 1,
    config: ServerConfig | None = None,
    events_per_task: int = 16_384,
    retry_for: float = 30.0,
    auth: Authenticator | None = None,
    event_streams: int = 1,
    routed_in_flight: int = 256,
    task_log: bool | None = None,
) -> Instance:
    """Start one instance joined to the cluster on ``servers``.

    ``task_log``: whether it creates tasks in the task log (None: ``TASK_LOG``; if that is
    None too, the default, without waiting for it).
    """
    wanted = TASK_LOG if task_log is None else task_log
    cluster = await NatsCluster.connect(
        NatsConfig(
            servers=list(servers),
            instance_id=f"{name}-{uuid.uuid4().hex[:6]}",
            lease=lease,
            replicas=replicas,
            events_per_task=events_per_task,
            retry_for=retry_for,
            key=CLUSTER_KEY,
            event_streams=event_streams,
            routed_in_flight=routed_in_flight,
            task_log=True if wanted is None else wanted,
        )
    )
    service = A2AService(
        executor, config=config or ServerConfig(cancel_timeout=1.0), cluster=cluster
    )
    await service.start()
    if wanted:  # (new tasks go to the log once the cluster is settled)
        async with asyncio.timeout(4 * lease + 10):
            await cluster.formats.wait_for(CURRENT)
        assert cluster.formats.writes_log
    h = await expose(service, auth)
    return Instance(name, service, cluster, h.server, h.address, h.channel, h.stub, h.client)


async def stop_instance(instance: Instance) -> None:
    """Shut the instance down (its tasks end FAILED) and close everything it opened."""
    await instance.service.shutdown(grace=0)
    await instance.cluster.close()
    await instance.client.close()
    await instance.channel.close()
    await instance.server.stop(grace=None)


@contextlib.asynccontextmanager
async def instances(
    executor: AgentExecutor,
    servers: Sequence[str],
    names: Sequence[str] = ("A", "B"),
    **options: object,
) -> AsyncIterator[list[Instance]]:
    """Start one instance per name; on a normal exit check nothing of ours is left."""
    started: list[Instance] = []
    try:
        for name in names:
            started.append(await start_instance(name, executor, servers, **options))  # type: ignore[arg-type]
        yield started
        await assert_idle({i.name: i.service for i in started})
    finally:
        for instance in started:
            try:
                async with asyncio.timeout(10):
                    await stop_instance(instance)
            except TimeoutError:
                _dump_tasks(f"instance {instance.name} did not stop within 10 s")
                raise


async def assert_idle(services: dict[str, A2AService]) -> None:
    """Within 1 s every service is idle, no relay is open, and no coroutine of ours is left
    (but the instances' own background tasks)."""
    async with asyncio.timeout(1.0):
        for service in services.values():
            await service.wait_idle()
    relays = {name: service.metrics.relays_open for name, service in services.items()}
    assert not any(relays.values()), f"relays left open: {relays}"
    assert_nothing_left(allowed=INSTANCE_TASKS)


def _dump_tasks(why: str) -> None:
    import sys

    print(f"--- {why}; live tasks:", file=sys.stderr)
    for task in asyncio.all_tasks():
        print(f"- {task.get_name()} {task.get_coro()!r}", file=sys.stderr)
        with contextlib.suppress(TypeError):  # a cython coroutine has no Python frames
            task.print_stack(limit=8, file=sys.stderr)


async def collect(stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
    """Every frame of a stream, until it ends."""
    return [frame async for frame in stream]

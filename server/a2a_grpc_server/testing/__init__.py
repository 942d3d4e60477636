"""For embedders' tests: a real server in the test's own process, and a local nats-server.

    from a2a_grpc_server.testing import nats_server, running_server

    async def test_my_agent() -> None:
        async with running_server(MyExecutor()) as server:
            answer = await server.stub.SendMessage(request, metadata=server.metadata)

    def test_my_agent_in_a_cluster() -> None:
        with nats_server() as nats:  # nats-server -js on a free loopback port
            ...running_server(MyExecutor(), nats_url=nats.urls[0])...

``running_server`` binds 127.0.0.1 on free ports (gRPC, and HTTP for the card
and metrics when asked), gives a channel and a stub of it, and on exit ends
every task with its final frame and closes everything it opened.

The leak check our own tests run after every stream test is here too:
``leftover_tasks()`` names the asyncio tasks that still run code of this
package (an execution, a stream, a relay), and ``assert_nothing_left()``
fails a test that leaves one behind::

    async with running_server(MyExecutor()) as server:
        ...  # the test's calls, each awaited to its end
        await server.server.service.wait_idle()
        assert_nothing_left()
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import types
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import grpc
from a2a.server.agent_execution import AgentExecutor
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import AgentCard

from .._internal.app.service import A2AServer
from .._internal.config import ServerConfig
from .._internal.jetstream.natsconfig import NatsConfig
from .._internal.model.names import TASK_PREFIX
from .._internal.rpc.auth import Authenticator
from ._nats import NatsNode, NatsServers
from ._nats import running as nats_server

_CLUSTER_KEY = secrets.token_bytes(32)
"""The cluster key ``running_server`` gives every instance it starts in this process."""

__all__ = [
    "INSTANCE_TASKS",
    "NatsNode",
    "NatsServers",
    "RunningServer",
    "assert_nothing_left",
    "leftover_tasks",
    "nats_server",
    "running_server",
]

_PACKAGE_DIR = f"/{__name__.split('.')[0]}/"
INSTANCE_TASKS = (
    ":lease",
    ":heartbeat",
    ":lease-watch",
    ":lease-sweep",
    ":lease-claim",
    ":recheck",
    ":lease-index",
    ":index-drop",
)
"""Name suffixes of a cluster instance's own background tasks, alive as long as it runs
(``assert_nothing_left(allowed=INSTANCE_TASKS)`` while a cluster instance still runs)."""

_V1_METADATA = (("a2a-version", "1.0"),)


@dataclass
class RunningServer:
    """A server started by ``running_server``, and a client of it.

    Attributes:
        server: The server.
        channel: An insecure channel to it.
        stub: The generated A2A stub on that channel.
        metadata: What every A2A call sends (the A2A version).
    """

    server: A2AServer
    channel: grpc.aio.Channel
    stub: a2a_pb2_grpc.A2AServiceStub
    metadata: tuple[tuple[str, str], ...] = _V1_METADATA

    @property
    def address(self) -> str:
        """``127.0.0.1:port`` of the gRPC server."""
        return self.server.grpc_address

    @property
    def card_url(self) -> str | None:
        """The agent card's URL (None without ``http``)."""
        port = self.server.http_port
        return None if port is None else f"http://127.0.0.1:{port}/.well-known/agent-card.json"


@contextlib.asynccontextmanager
async def running_server(
    executor: AgentExecutor,
    card: AgentCard | None = None,
    *,
    config: ServerConfig | None = None,
    auth: Authenticator | None = None,
    nats_url: str | None = None,
    http: bool = False,
) -> AsyncIterator[RunningServer]:
    """Serve ``executor`` on 127.0.0.1 (free ports) for the duration of the block.

    Args:
        executor: The agent under test.
        card: Its card (a default one if None).
        config: Limits (``ServerConfig()`` if None).
        auth: Authenticate calls with this.
        nats_url: Join the cluster on this NATS server (see ``nats_server``).
        http: Also serve the agent card and metrics over HTTP.

    Raises:
        OSError: A port could not be bound, or NATS could not be reached.
    """
    nats = NatsConfig(servers=[nats_url], key=_CLUSTER_KEY) if nats_url else None
    server = A2AServer(
        executor,
        card,
        host="127.0.0.1",
        port=0,
        http_port=0 if http else None,
        config=config,
        auth=auth,
        nats=nats,
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            yield RunningServer(server, channel, a2a_pb2_grpc.A2AServiceStub(channel))
    finally:
        await server.stop(grace=0)


def leftover_tasks() -> list[str]:
    """The names of live asyncio tasks (but the caller's) running code of this package.

    A task counts if it is named as this package names its tasks, or if a
    frame of this package is in its await chain (a coroutine of an
    embedder's that is waiting on a stream of ours counts too).
    """
    found = []
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is current or task.done():
            continue
        if task.get_name().startswith(TASK_PREFIX) or _runs_our_code(task.get_coro()):
            found.append(task.get_name())
    return found


def assert_nothing_left(allowed: Iterable[str] = ()) -> None:
    """Fail unless no asyncio task of this package is alive (see ``leftover_tasks``).

    Args:
        allowed: Name suffixes of tasks that may live on (an instance's own
            background tasks, such as ``":lease"``, while it still runs).

    Raises:
        AssertionError: Naming every task left.
    """
    suffixes = tuple(allowed)
    left = [name for name in leftover_tasks() if not (suffixes and name.endswith(suffixes))]
    assert not left, f"coroutines of ours still alive: {left}"


def _runs_our_code(coro: object) -> bool:
    seen = 0
    while coro is not None and seen < 100:
        seen += 1
        code = (
            getattr(coro, "cr_code", None)
            or getattr(coro, "ag_code", None)
            or getattr(coro, "gi_code", None)
        )
        if isinstance(code, types.CodeType) and _PACKAGE_DIR in code.co_filename:
            return True
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "ag_await", None)
            or getattr(coro, "gi_yieldfrom", None)
        )
    return False

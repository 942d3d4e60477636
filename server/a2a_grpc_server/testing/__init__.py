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
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from a2a.server.agent_execution import AgentExecutor
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import AgentCard

from ..app.service import A2AServer
from ..config import ServerConfig
from ..jetstream.natsconfig import NatsConfig
from ..rpc.auth import Authenticator
from .nats import running as nats_server

__all__ = ["RunningServer", "nats_server", "running_server"]

V1_METADATA = (("a2a-version", "1.0"),)


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
    metadata: tuple[tuple[str, str], ...] = V1_METADATA

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
    nats = NatsConfig(servers=[nats_url]) if nats_url else None
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

"""NatsCluster: this instance's membership of a cluster on NATS JetStream.

Lifecycle: ``await NatsCluster.connect(config)`` opens the connection and
the shared assets; its ``store`` and ``events`` are handed to the service;
``join(manager)`` (called by ``A2AService.start``) starts the lease and the
routed-request service; ``leave()`` (called by ``A2AService.shutdown`` after
the local tasks ended) severs relays, stops routing and releases the lease;
``close()`` closes the connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from a2a.types.a2a_pb2 import SendMessageRequest, Task

from ..callmeta import Caller
from ..channel import Subscription
from ..store import StoredTask
from ..store.nats import NatsTaskStore
from .events import NatsEventLog
from .lease import Lease
from .natsconn import TASKS_BUCKET, NatsConfig, NatsConnection, connect
from .relay import Relays
from .routing import Router

if TYPE_CHECKING:
    from ..manager import TaskManager

CANCEL_SLACK = 1.0


class NatsCluster:
    """Implements ``Cluster`` (see the package docstring) on a NATS connection.

    Args:
        conn: An open connection (see ``connect``).
    """

    def __init__(self, conn: NatsConnection) -> None:
        self.conn = conn
        self.store = NatsTaskStore(conn.js, TASKS_BUCKET, conn.tasks, conn.config.instance_id)
        self.events = NatsEventLog(conn.js)
        self._relays: Relays | None = None
        self._router: Router | None = None
        self.lease: Lease | None = None

    @classmethod
    async def connect(cls, config: NatsConfig) -> NatsCluster:
        """Connect to NATS and prepare the shared assets.

        Raises:
            ConnectionError: NATS or JetStream is not available.
        """
        return cls(await connect(config))

    @property
    def instance_id(self) -> str:
        """This instance's id."""
        return self.conn.config.instance_id

    async def join(self, manager: TaskManager) -> None:
        """Start heartbeating and serving routed requests for ``manager``."""
        config = manager.config
        self._relays = Relays(self.events, self.store, config.subscriber_buffer, manager.metrics)
        self._router = Router(self.conn.nc, self.instance_id, config.cancel_timeout + CANCEL_SLACK)
        self.lease = Lease(self.conn, self.store, self.events, manager.metrics)
        await self.lease.start()
        await self._router.start(manager)

    async def leave(self) -> None:
        """Sever relayed streams, stop routing, release the lease (survivors sweep at once)."""
        if self._relays is not None:
            self._relays.sever_all("this instance is shutting down; resubscribe through another")
            await self._relays.wait_closed()
        if self._router is not None:
            await self._router.stop()
        if self.lease is not None:
            await self.lease.stop(release=True)

    async def close(self) -> None:
        """Close the NATS connection."""
        await self.conn.close()

    async def wait_idle(self) -> None:
        """Wait until relay cleanups are done (for leak checks)."""
        if self._relays is not None:
            await self._relays.wait_closed()

    async def subscribe(self, stored: StoredTask) -> tuple[Task, Subscription]:
        """Join the task through this instance's relay (see ``Cluster.subscribe``)."""
        assert self._relays is not None, "join() first"
        return await self._relays.subscribe(stored.task.id)

    async def cancel(self, stored: StoredTask, call: Caller) -> Task:
        """Have the owner cancel the task (see ``Cluster.cancel``)."""
        assert self._router is not None, "join() first"
        return await self._router.cancel(stored.owner, stored.task.id, call)

    async def send(self, stored: StoredTask, request: SendMessageRequest, call: Caller) -> None:
        """Have the owner start a follow-up (see ``Cluster.send``)."""
        assert self._router is not None, "join() first"
        await self._router.send(stored.owner, request, call)

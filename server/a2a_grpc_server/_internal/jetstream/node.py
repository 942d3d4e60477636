"""NatsCluster: this instance's membership of a cluster on NATS JetStream.

Lifecycle: ``await NatsCluster.connect(config)`` opens the connection and
the shared assets; its ``journal`` is the service's; ``join(local)``
(called by ``A2AService.start``) starts the lease and the routed-request
service; ``leave()`` (called by ``A2AService.shutdown`` after the local tasks
ended) severs relays, stops routing and releases the lease; ``close()``
closes the connection.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from a2a.types.a2a_pb2 import SendMessageRequest, Task
from a2a.utils.errors import TaskNotFoundError

from ..errors import UnknownFormatError
from ..journal import PageTokens, RecordedTask, Released, StoreError
from ..log.tasklog import LogReader
from ..model import taskops
from ..model.caller import Caller
from .conn import NatsConfig, NatsConnection, connect
from .formats import Formats
from .journal import JetStreamJournal
from .keys import JetStreamSentKeys
from .lease import Lease
from .logjournal import LogJournal
from .pushstore import DeliveryCoverage, JetStreamPushConfigs
from .relay import Relays
from .requests import JetStreamRequests
from .retry import Retry
from .routing import Router
from .signing import signer_for
from .store import ClusterJournal

if TYPE_CHECKING:
    from ..cluster import Local

logger = logging.getLogger(__name__.replace("._internal", ""))

RECORD_SLACK = 64 * 1024
"""Bytes of a NATS message kept for what travels beside a task: a snapshot's head, a
record's header, a routed request's headers (the caller's metadata: gRPC limits it to
16 KiB) and the request's other fields."""


class NatsCluster:
    """Cluster mode on NATS JetStream: what ``A2AServer`` and ``A2AService`` run on.

    Make one with ``await NatsCluster.connect(config)``, pass it as ``cluster=``,
    and close it after the service has shut down. Its other public methods are
    how the server drives it (the ``ClusterMember`` port): they are not API.

    Args:
        conn: An open connection (see ``connect``).
        requests: Lean JetStream requests on it, started.

    Raises:
        ValueError: The config names no cluster key and does not trust the bus
            (see ``signing``).
    """

    def __init__(self, conn: NatsConnection, requests: JetStreamRequests) -> None:
        self._signer = signer_for(conn.config)
        self.conn = conn
        self._requests = requests
        self.formats = Formats()
        """The format this instance writes (see ``formats``: the upgrade rule)."""
        self.formats.log_wanted = conn.config.task_log
        tokens = PageTokens(self._signer.derive(b"page tokens"))
        legacy = JetStreamJournal(
            requests,
            conn.js,
            conn.config.instance_id,
            conn.config.snapshot_every,
            Retry(conn.config.retry_for),
            self.formats,
            tokens,
            conn.config.event_streams,
            conn.config.task_ttl,
        )
        log = LogJournal(
            requests,
            conn.js,
            conn.config.instance_id,
            conn.config.snapshot_every,
            Retry(conn.config.retry_for),
            tokens,
            task_ttl=conn.config.task_ttl,
        )
        self._journal = ClusterJournal(legacy, log, self.formats, tokens)
        self._relays: Relays | None = None
        self._keys: JetStreamSentKeys | None = None
        self._router: Router | None = None
        self.lease: Lease | None = None
        self.push_store = JetStreamPushConfigs(
            conn.js,
            conn.push,
            Retry(conn.config.retry_for),
            self.formats,
            callers=conn.push_callers,
            index=self._journal.index,
            entry_ttl=conn.config.task_ttl,
        )
        """Push configs and cursors, shared by every instance."""
        self.push_coverage = DeliveryCoverage(
            self.push_store, self._journal.index, self.formats, conn.config.instance_id
        )
        """Whether orphaned configs can be found through their deliverers' entries."""
        self._journal.listing.coverage = self.push_coverage
        self._local: Local | None = None

    @classmethod
    async def connect(cls, config: NatsConfig) -> NatsCluster:
        """Connect to NATS and prepare the shared assets.

        Raises:
            ConnectionError: NATS or JetStream is not available.
            ValueError: No cluster key, and the bus is not trusted (see ``signing``).
        """
        signer_for(config)  # (a missing or short key fails before connecting)
        conn = await connect(config)
        requests = JetStreamRequests(conn.nc)
        await requests.start()
        return cls(conn, requests)

    @property
    def instance_id(self) -> str:
        """This instance's id."""
        return self.conn.config.instance_id

    @property
    def journal(self) -> ClusterJournal:
        """The shared record (the snapshot bucket and its event streams, and the task log)."""
        return self._journal

    @property
    def max_record_bytes(self) -> int:
        """What one NATS message carries (``max_payload``), less room for what travels beside.

        See ``Cluster.max_record_bytes`` and ``RECORD_SLACK``.
        """
        return self._requests.max_payload - RECORD_SLACK

    async def join(self, local: Local) -> None:
        """Start heartbeating and serving routed requests for ``local``.

        Raises:
            StoreError: The shared record could not be read.
        """
        tasks = local.tasks
        self._local = local
        self._relays = Relays(self._journal, tasks.pool, tasks.metrics)
        self._router = Router(
            self.conn.nc,
            self.instance_id,
            tasks.config.cancel_timeout,
            self._signer,
            heartbeats=self.conn.instances,
            lease=self.conn.config.lease,
            in_flight=self.conn.config.routed_in_flight,
            retry_for=self.conn.config.retry_for,
        )
        self.lease = Lease(
            self.conn,
            self._journal,
            tasks.metrics,
            on_gap=local.recheck_ownership,
            on_swept=self._adopt_push if local.push is not None else None,
            formats=self.formats,
        )
        await self.lease.start()
        await self._router.start(local)

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
        """Finish the index's deletes (bounded), stop the keys', then close the NATS connection."""
        if self._keys is not None:
            await self._keys.close()
        await self._journal.close()
        await self._requests.close()
        await self.conn.close()

    async def wait_idle(self) -> None:
        """Wait until relay cleanups and the keys' deletes are done (for leak checks)."""
        if self._relays is not None:
            await self._relays.wait_closed()
        if self._keys is not None:
            await self._keys.wait_deleted()

    async def subscribe(
        self, recorded: RecordedTask, *, passive: bool = False
    ) -> tuple[Task, LogReader]:
        """Join the task through this instance's relay (see ``Peers.subscribe``)."""
        assert self._relays is not None, "join() first"
        return await self._relays.subscribe(recorded.task.id, passive=passive)

    async def replay(self, recorded: RecordedTask, after: int) -> LogReader:
        """A reader of the task's frames after ``after`` (see ``Cluster.replay``)."""
        assert self._relays is not None, "join() first"
        return await self._relays.replay(recorded, after)

    async def cancel(self, recorded: RecordedTask, call: Caller) -> Task:
        """Have the owner cancel the task (see ``Cluster.cancel``)."""
        assert self._router is not None, "join() first"
        return await self._router.cancel(recorded.owner, recorded.task.id, call)

    async def send(self, recorded: RecordedTask, request: SendMessageRequest, call: Caller) -> None:
        """Have the owner start a follow-up (see ``Cluster.send``)."""
        assert self._router is not None, "join() first"
        await self._router.send(recorded.owner, request, call)

    def sent_keys(self, window: float, most: int = 100_000) -> JetStreamSentKeys:
        """The message ids sent, shared by every instance (``A2A_KEYS``), kept ``window`` s.

        ``most``: most keys this instance's claims keep there (``keys.Claimed``).
        """
        config = self.conn.config
        self._keys = JetStreamSentKeys(
            self.conn.js,
            window,
            config.replicas,
            Retry(config.retry_for),
            requests=self._requests,
            most=most,
        )
        return self._keys

    async def _adopt_push(self, alive: set[str]) -> None:
        """Take over the webhooks lost instances were delivering to (after each lease sweep).

        A config whose deliverer is gone and whose task has ended (the sweep
        just ended the lost owner's running tasks FAILED) gets what its
        webhook had not confirmed, the final frame last, from this instance:
        whichever survivor adopts it first (compare-and-set); the others skip
        it. Configs of tasks still running wait for the next sweep.
        """
        local = self._local
        push = local.push if local is not None else None
        if local is None or push is None:
            return
        indexed = await self.push_coverage.trusted()
        try:
            orphans = await self.push_store.orphans(alive, indexed=indexed)
        except UnknownFormatError as exc:  # (a newer version's entries: read every config)
            logger.warning(
                "push configs' delivery entries not read (%s): reading every config", exc
            )
            orphans = await self.push_store.orphans(alive)
        for orphan in orphans:
            try:
                recorded = await local.tasks.recorded(orphan.task_id)
            except TaskNotFoundError:
                continue  # (the task's retention ended)
            if not taskops.is_final(recorded.task):
                continue
            if not await self.push_store.adopt(orphan, self.instance_id):
                continue  # another survivor did
            logger.warning(
                "push config %s of task %s: its instance %s was lost; delivering from frame %d",
                orphan.config.id,
                orphan.task_id,
                orphan.deliverer,
                orphan.cursor + 1,
            )
            await push.deliver_ended(recorded, orphan.config, orphan.cursor)

    async def claim(self, recorded: RecordedTask) -> RecordedTask | None:
        """Take over a waiting task owned by nobody (see ``Peers.claim``).

        Its push configs created while nobody owned it are this instance's to
        deliver from now on (so a sweep adopts them if this instance is lost).
        """
        claimed = await self._journal.ownership.claim(recorded.task.id)
        if claimed is not None:
            try:
                for orphan in await self.push_store.without_deliverer(claimed.task.id):
                    await self.push_store.adopt(orphan, self.instance_id)
            except StoreError as exc:  # (best effort: they are delivered from here anyway)
                logger.warning("task %s: its push configs not adopted: %s", claimed.task.id, exc)
        return claimed

    async def release(self, task_id: str) -> Released:
        """Leave a waiting task of this instance's to the cluster (see ``Peers.release``).

        Within this instance's first lease every heartbeat is read first
        (``Lease.read_all_heartbeats``): a release needs to know them all.
        """
        if self.lease is not None:
            await self.lease.read_all_heartbeats()
        return await self._journal.ownership.release(task_id, self.instance_id)

    async def push(self, recorded: RecordedTask, config_id: str, call: Caller) -> None:
        """Have the owner deliver a push config stored for its task (see ``Cluster.push``)."""
        assert self._router is not None, "join() first"
        await self._router.push(recorded.owner, recorded.task.id, config_id, call)

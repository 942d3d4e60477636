"""Cluster mode: this instance's membership of a cluster, as the service uses it.

The engine sees the other instances only through ``engine.ports.Peers``
(what it asks of them); the service (``app``) and push see ``Cluster``
below, which adds the lifecycle, the shared record and push routing;
``jetstream.node.NatsCluster`` implements it on NATS JetStream (all NATS
code lives in the ``jetstream`` package), and a single instance runs with
none (``None``).

* The shared record of every task is the cluster's ``journal``: the owner of
  a task (the instance running its executor) records every change there
  before appending the frame to its own log (persist, then append), with the
  same sequence numbers every instance sees.
* Any other instance reaches the task through ``Cluster``: a subscription is
  served from one relay per task and instance (a log fed from the shared
  record, read by cursors like the owner's); a resumption reads the shared
  record from the cursor; a cancel or follow-up message is sent to the
  owner, which runs its normal path, so every reader everywhere sees the
  same frames and outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..engine.ports import Peers

if TYPE_CHECKING:
    from ..engine.engine import TaskEngine
    from ..journal import RecordedTask, TaskJournal
    from ..model.caller import Caller


class Cluster(Peers, Protocol):
    """This instance's membership of a cluster, as the service and push use it.

    Lifecycle: ``join`` before serving, ``leave`` after the local tasks ended
    (at shutdown), then ``close``.
    """

    @property
    def journal(self) -> TaskJournal:
        """The record every instance shares; the service's journal in cluster mode."""
        ...

    @property
    def max_record_bytes(self) -> int | None:
        """The largest serialized task the shared record stores (None: no limit of its own).

        The service lowers ``ServerConfig.max_task_bytes`` (and with it the
        request limit) to this, so whatever it accepts it can record.
        """
        ...

    async def join(self, engine: TaskEngine) -> None:
        """Start serving other instances' routed requests with ``engine``.

        Raises:
            StoreError: The shared record could not be read.
        """
        ...

    async def leave(self) -> None:
        """Sever relayed streams and leave the cluster (after local tasks ended)."""
        ...

    async def close(self) -> None:
        """Release the connection (after ``leave``)."""
        ...

    async def wait_idle(self) -> None:
        """Wait until no relay or routed request of this instance is being cleaned up."""
        ...

    async def push(self, recorded: RecordedTask, config_id: str, call: Caller) -> None:
        """Have the owner start delivering a push config stored for its task.

        Raises:
            OwnerUnavailableError: The owner did not answer.
        """
        ...

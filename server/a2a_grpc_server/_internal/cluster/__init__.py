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

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..engine.ports import Peers

if TYPE_CHECKING:
    from a2a.types.a2a_pb2 import TaskPushNotificationConfig

    from ..engine.engine import TaskEngine
    from ..engine.registry import LiveTasks
    from ..journal import RecordedTask, TaskJournal
    from ..model.caller import Caller


class OwnedPush(Protocol):
    """What the cluster asks of this instance's push notifications (``PushService``)."""

    async def follow_stored(self, task_id: str, config_id: str) -> None:
        """Start delivering a stored config of a task this instance runs (a routed ``push``)."""
        ...

    async def deliver_ended(
        self, recorded: RecordedTask, config: TaskPushNotificationConfig, cursor: int
    ) -> None:
        """Deliver what a lost instance's webhook had not confirmed of an ended task."""
        ...


@dataclass(frozen=True, slots=True)
class Local:
    """What this instance brings to the cluster when it joins (the owner's side).

    Attributes:
        owner: Serves the routed cancels and follow-ups of this instance's
            tasks (the engine: their normal, local path).
        tasks: This instance's live tasks (their log pool, metrics, limits
            and records).
        recheck_ownership: Ends the tasks another instance ended while this
            one was out of touch; returns how many.
        push: This instance's push notifications (None: push is off).
    """

    owner: TaskEngine
    tasks: LiveTasks
    recheck_ownership: Callable[[], Awaitable[int]]
    push: OwnedPush | None = None


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

    async def join(self, local: Local) -> None:
        """Start serving other instances' routed requests with ``local``.

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

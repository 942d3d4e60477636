"""Cluster mode: what the core asks of the other instances sharing its tasks.

The core (``engine``, ``live``, ``app``) sees a cluster only through
``Cluster`` below; ``jetstream.node.NatsCluster`` implements it on NATS
JetStream (all NATS code lives in the ``jetstream`` package), and a single
instance runs with none (``None``).

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

from a2a.types.a2a_pb2 import SendMessageRequest, Task

if TYPE_CHECKING:
    from .callmeta import Caller
    from .engine import TaskEngine
    from .journal import RecordedTask, TaskJournal
    from .push.configs import PushConfigStore
    from .tasklog import LogReader


class Cluster(Protocol):
    """This instance's membership of a cluster, as the core uses it.

    Lifecycle: ``join`` before serving, ``leave`` after the local tasks ended
    (at shutdown), then ``close``.
    """

    @property
    def instance_id(self) -> str:
        """This instance's id (the owner recorded with the tasks it runs)."""
        ...

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

    async def subscribe(self, recorded: RecordedTask) -> tuple[Task, LogReader]:
        """Join a task another instance owns, through this instance's relay of it.

        Returns:
            The task as of the relay's log and a reader of every frame after it.

        Raises:
            UnsupportedOperationError: The task has ended.
            TaskNotFoundError: The task is gone.
            RelayLostError: This instance is leaving the cluster.
        """
        ...

    async def replay(self, recorded: RecordedTask, after: int) -> LogReader:
        """A reader of the task's frames after ``after``, from the shared record.

        It ends after the task's final frame (at once if ``after`` is it).

        Raises:
            FrameNotKeptError: The shared record no longer holds frame ``after + 1``.
            StoreUnavailableError: The shared record could not be read.
        """
        ...

    async def cancel(self, recorded: RecordedTask, call: Caller) -> Task:
        """Have the owner cancel the task; returns the task once CANCELED.

        Raises:
            TaskNotCancelableError: The task ended before it could be canceled.
            OwnerUnavailableError: The owner did not answer.
        """
        ...

    async def send(self, recorded: RecordedTask, request: SendMessageRequest, call: Caller) -> None:
        """Have the owner start a follow-up message on its interrupted task.

        Raises:
            UnsupportedOperationError: The task does not accept the message now.
            OwnerUnavailableError: The owner did not answer.
        """
        ...

    @property
    def push_store(self) -> PushConfigStore:
        """Push configs and their cursors, shared by every instance."""
        ...

    async def push(self, recorded: RecordedTask, config_id: str, call: Caller) -> None:
        """Have the owner start delivering a push config stored for its task.

        Raises:
            OwnerUnavailableError: The owner did not answer.
        """
        ...

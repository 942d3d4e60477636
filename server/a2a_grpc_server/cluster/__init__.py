"""Cluster mode: several instances share tasks through NATS JetStream.

The core (``manager``, ``active``) sees a cluster only through the two small
interfaces below; ``cluster.node.NatsCluster`` implements both on NATS, and a
single instance runs with neither (``None``).

* The owner of a task (the instance running its executor) appends every
  frame to the ``EventLog`` after persisting it and before broadcasting it
  locally: persist, then log, then broadcast.
* Any other instance reaches the task through ``Cluster``: a subscription is
  served from one relay channel per task and instance, fed from the log; a
  cancel or follow-up message is sent to the owner, which runs its normal
  path, so every subscriber everywhere sees the same frames and outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from a2a.types.a2a_pb2 import SendMessageRequest, StreamResponse, Task

if TYPE_CHECKING:
    from ..callmeta import Caller
    from ..channel import Subscription
    from ..manager import TaskManager
    from ..store import StoredTask


class EventLog(Protocol):
    """The durable, ordered log of one task's frames, readable by every instance."""

    async def append(
        self, task_id: str, seq: int, version: int, frame: StreamResponse | None, snapshot: Task
    ) -> None:
        """Record a frame persisted at ``version``, as the task's ``seq``-th log entry.

        ``seq`` counts a task's entries from 1 with no gap; ``last_seq`` tells
        a writer other than the owner (the lease reaper) where to continue.

        With ``frame`` None it records a change that has no frame (e.g. a
        follow-up message added to the history); ``snapshot`` is the task after it.

        Implementations MUST keep the order of appends per task and MUST make an
        appended frame visible to every follower.

        Raises:
            StoreError: The frame could not be recorded.
        """
        ...

    async def last_seq(self, task_id: str) -> int:
        """The ``seq`` of the task's last entry (0 if it has none).

        Raises:
            StoreError: The log could not be read.
        """
        ...


class Cluster(Protocol):
    """What the task manager asks of the other instances."""

    @property
    def instance_id(self) -> str:
        """This instance's id (the owner written with the tasks it runs)."""
        ...

    async def join(self, manager: TaskManager) -> None:
        """Start serving other instances' routed requests with ``manager``."""
        ...

    async def leave(self) -> None:
        """Sever relayed streams and leave the cluster (after local tasks ended)."""
        ...

    async def wait_idle(self) -> None:
        """Wait until no relay cleanup of this instance is pending."""
        ...

    async def subscribe(self, stored: StoredTask) -> tuple[Task, Subscription]:
        """Join a task owned by another instance, through this instance's relay.

        Raises:
            UnsupportedOperationError: The task has ended.
            TaskNotFoundError: The task is gone.
        """
        ...

    async def cancel(self, stored: StoredTask, call: Caller) -> Task:
        """Have the owner cancel the task; returns the task once CANCELED.

        Raises:
            TaskNotCancelableError: The task ended before it could be canceled.
            OwnerUnavailableError: The owner did not answer.
        """
        ...

    async def send(self, stored: StoredTask, request: SendMessageRequest, call: Caller) -> None:
        """Have the owner start a follow-up message on its interrupted task.

        Raises:
            UnsupportedOperationError: The task does not accept the message now.
            OwnerUnavailableError: The owner did not answer.
        """
        ...

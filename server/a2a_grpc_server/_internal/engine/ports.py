"""What the engine asks of the collaborators an upper layer gives it.

The engine is below push and cluster: it names here, as small protocols,
the little it needs of them, and they implement it (``cluster.Cluster`` is a
``Peers``; ``push.service.PushService`` is a ``PushHooks``, and with it a
``TaskListener`` of the registry). It also names what it offers them beyond
the operations: ``TaskDirectory``, the lookups push makes
(``registry.LiveTasks`` implements it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from a2a.types.a2a_pb2 import Message, SendMessageRequest, Task, TaskPushNotificationConfig

if TYPE_CHECKING:
    from ..execution.live import LiveTask
    from ..journal import RecordedTask, Released
    from ..log.tasklog import LogReader
    from ..model.caller import Caller


class Outcome(Protocol):
    """What ``send`` hands back: the caller's reader (if asked for) and the answer to wait for."""

    @property
    def snapshot(self) -> Task | None:
        """The task before this message's events (None for a new task)."""
        ...

    @property
    def reader(self) -> LogReader | None:
        """The caller's reader of the task's frames (None when not asked for)."""
        ...

    @property
    def task_id(self) -> str:
        """The task the message started or continues."""
        ...

    @property
    def since(self) -> int:
        """The number of the task's last change before this message's run."""
        ...

    async def outcome(self, *, immediately: bool) -> tuple[Task | Message, int]:
        """Wait for what a blocking SendMessage answers, and the seq of its last change."""
        ...


class TaskOperations(Protocol):
    """What the gRPC face asks of tasks.

    ``TaskEngine`` implements it alone, ``cluster.front.ClusterFront`` in a
    cluster. Each method raises what ``TaskEngine``'s does; the front also
    OwnerUnavailableError, OwnerTimeoutError and RelayLostError.
    """

    async def send(
        self,
        request: SendMessageRequest,
        call: Caller,
        *,
        subscribe: bool,
        resumable: bool = False,
    ) -> Outcome:
        """Start a new task, or continue an interrupted one, with a message."""
        ...

    async def cancel(self, task_id: str, call: Caller) -> Task:
        """Cancel a task; every stream of it ends CANCELED."""
        ...

    async def read(self, task_id: str, scope: str, *, resumable: bool = False) -> tuple[Task, int]:
        """The task as recorded, and the number of the last change it includes."""
        ...

    async def subscribe(
        self, task_id: str, scope: str, *, resumable: bool = False
    ) -> tuple[Task, LogReader]:
        """Join a live task: its snapshot, and a reader of every frame after it."""
        ...

    async def resume(self, task_id: str, after: int, scope: str) -> LogReader:
        """A reader of exactly the task's frames after ``after`` (the resume extension)."""
        ...

    async def watch(self, task_id: str, scope: str, after: int) -> LogReader | None:
        """A passive reader of the task's next change (v1.1's long-poll).

        None when the task has ended or moved past change ``after`` already.
        """
        ...


class Peers(Protocol):
    """The other instances sharing this instance's tasks (cluster mode).

    A task another instance owns is read through this instance's relay of it,
    resumed from the shared record, and canceled or continued by its owner.
    A task waiting for input belongs to the cluster rather than to an
    instance: its owner releases it when it shuts down (a survivor does when
    the owner is lost), and whichever instance takes its next message or
    cancel claims it and runs it there.
    """

    @property
    def instance_id(self) -> str:
        """This instance's id (the owner recorded with the tasks it runs)."""
        ...

    async def subscribe(
        self, recorded: RecordedTask, *, passive: bool = False
    ) -> tuple[Task, LogReader]:
        """Join a task another instance owns, through this instance's relay of it.

        A ``passive`` reader (a long-poll) is not one of the task's subscribers
        (``TaskLog.readers``), so ``quota_subscribers`` does not count it.

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

    async def claim(self, recorded: RecordedTask) -> RecordedTask | None:
        """Take over a waiting task owned by nobody (compare-and-set on the shared record).

        Returns:
            The task, owned by this instance now; None if another instance
            claimed it first (or it no longer waits).

        Raises:
            StoreUnavailableError: The shared record could not be written.
        """
        ...

    async def release(self, task_id: str) -> Released:
        """Leave a waiting task of this instance's to the cluster (owned by nobody).

        Returns:
            ``RELEASED``; ``MOVED_ON`` if it is not this instance's any more
            (its copy here is out of date); ``KEPT`` if it stays this
            instance's (its record does not show it waiting, or an older
            version is in the cluster).

        Raises:
            StoreUnavailableError: The shared record could not be written.
        """
        ...


class TaskDirectory(Protocol):
    """Where an upper layer looks a task up (``registry.LiveTasks``)."""

    async def recorded(self, task_id: str, scope: str | None = None) -> RecordedTask:
        """The task as recorded (or its final state, not recorded yet).

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
        """
        ...

    def live_task(self, task_id: str) -> LiveTask | None:
        """The task, if it is live (in memory) on this instance."""
        ...

    def owned_elsewhere(self, recorded: RecordedTask) -> bool:
        """Whether another instance runs the task (cluster mode)."""
        ...


class TaskListener(Protocol):
    """What the registry tells of its tasks' comings and goings (push listens)."""

    def revived(self, live: LiveTask) -> None:
        """A task came back into memory: resume what it had."""
        ...

    def evicted(self, task_id: str) -> None:
        """The task left memory (its record stays; it may be revived)."""
        ...

    def forgotten(self, task_id: str) -> None:
        """The task is gone for good: nothing of it is recorded any more."""
        ...


class PushHooks(TaskListener, Protocol):
    """What the engine tells push notifications of its tasks' lives."""

    async def register(self, live: LiveTask, config: TaskPushNotificationConfig) -> None:
        """Keep an inline config of a live task; its webhook follows the task from now on."""
        ...

    async def close(self, deadline: float | None) -> None:
        """Shutdown: let deliveries send the final frames until ``deadline`` (loop time)."""
        ...

    async def wait_ended(self) -> None:
        """Wait until every delivery that was asked to end has ended."""
        ...

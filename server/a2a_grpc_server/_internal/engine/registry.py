"""LiveTasks: which tasks are live (in memory) on this instance, and how they come and go.

A task is live from its first message until its log closes; a task waiting
for input may leave memory earlier (``ParkingLot``) and come back from its
record (``revive``). The registry owns what every live task shares: the log
pool, the parking lot, the per-principal counts (``Quotas``) and the final
states still being recorded (``FinalRetries``). It tells one listener
(``ports.TaskListener``: push notifications) when a task comes back, leaves
memory or is gone for good.

Who runs what: everything here runs on the event loop, synchronously, except
``recorded`` (a journal read). The engine creates and revives tasks; a log's
close callback (registered here when a task becomes live) is the one climb back up:
the log, below, tells the registry its task ended.

It is also the engine's ``ports.TaskDirectory``: where push looks a task up.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from a2a.types.a2a_pb2 import Message, Task

from ..config import ServerConfig
from ..execution.live import LiveTask
from ..execution.parking import ParkingLot
from ..execution.quotas import Quotas
from ..journal import RecordedTask, TaskJournal
from ..log.tasklog import LogLimits, LogPool, TaskLog
from ..model import taskops
from ..model.scope import context_for, not_found, principal_of
from ..obs.metrics import Metrics
from .finals import FinalRetries

if TYPE_CHECKING:
    from .ports import TaskListener


class LiveTasks:
    """The live tasks of this instance (see the module docstring).

    Args:
        journal: Where tasks are recorded.
        config: Limits (logs, parking, quotas, task size).
        metrics: Where this instance counts what it does.
        instance_id: The owner id this instance records (cluster mode; None: alone).
    """

    def __init__(
        self,
        journal: TaskJournal,
        config: ServerConfig,
        metrics: Metrics | None = None,
        *,
        instance_id: str | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        self.journal = journal
        """Where tasks are recorded."""
        self.config = config
        limits = LogLimits(config.log_max_frames, config.log_max_bytes, config.resume_window)
        self.pool = LogPool(config.log_total_bytes, limits, self.metrics)
        """Every task log of this instance (relays included)."""
        self.parking = ParkingLot(
            config.parked_timeout,
            config.max_parked_tasks,
            durable=instance_id is not None,
            evict=self._evict,
            clock=self.pool.clock,
        )
        """The tasks waiting for input here (see ``parking``)."""
        self.quotas = Quotas(config)
        """What each principal holds here (see ``quotas``)."""
        self.finals = FinalRetries()
        """Ended tasks whose final state the journal has not recorded yet."""
        self._instance_id = instance_id
        self._live: dict[str, LiveTask] = {}
        self._listener: TaskListener | None = None
        self._open = True

    def listen(self, listener: TaskListener) -> None:
        """Tell ``listener`` of every revival, eviction and forgotten task from now on."""
        assert self._listener is None, "one listener (push notifications)"
        self._listener = listener

    @property
    def count(self) -> int:
        """Tasks live on this instance (not ended, in memory)."""
        return len(self._live)

    def all(self) -> list[LiveTask]:
        """Every live task, now."""
        return list(self._live.values())

    def live_task(self, task_id: str) -> LiveTask | None:
        """The task, if it is live (in memory) on this instance."""
        return self._live.get(task_id)

    def live_in(self, task_id: str, scope: str) -> LiveTask | None:
        """The live task, if there is one and it is of ``scope``."""
        live = self._live.get(task_id)
        return live if live is not None and live.scope == scope else None

    def owned_elsewhere(self, recorded: RecordedTask) -> bool:
        """Whether the task is not this instance's (cluster mode): another's, or nobody's.

        A waiting task owned by nobody (released) is claimed before it is
        run here (``Peers.claim``); until then it is read from the shared record.
        """
        return self._instance_id is not None and recorded.owner != self._instance_id

    def hand_over(self, live: LiveTask, why: str) -> None:
        """Let go of a waiting task the cluster continues (see ``TaskLog.hand_over``).

        Its readers here end with ``TaskHandedOverError`` (UNAVAILABLE: they
        resubscribe through another instance), its deliveries stop (their
        cursors stay, for whoever continues it) and it leaves memory.
        """
        live.hand_over(why)

    async def recorded(self, task_id: str, scope: str | None = None) -> RecordedTask:
        """The task as recorded; for a final state not recorded yet, that state.

        Args:
            task_id: The task.
            scope: The caller's scope (None: the server's own, unscoped read).

        Raises:
            TaskNotFoundError: No such task, or it is not of ``scope`` (unless None).
        """
        unrecorded = self.finals.live(task_id)
        if scope is not None:
            # Another scope's task answers as a missing one, and as fast: its scope is
            # checked before its body is read (a large task would take longer to copy).
            live = unrecorded or self._live.get(task_id)
            scope_of = getattr(self.journal, "scope_of", None)  # (an embedder's may lack it)
            owner = live.scope if live is not None else scope_of(task_id) if scope_of else None
            if owner is not None and owner != scope:
                raise not_found(task_id)
        if unrecorded is not None and unrecorded.log.snapshot is not None:
            found = RecordedTask(
                taskops.copy(unrecorded.log.snapshot),
                0,
                self._instance_id or "",  # (this instance's until recorded)
                unrecorded.log.last_seq,
                unrecorded.scope,
            )
        else:
            recorded = await self.journal.get(task_id)
            if recorded is None:
                raise not_found(task_id)
            found = recorded
        if scope is not None and found.scope != scope:
            raise not_found(task_id)
        return found

    def current(self, task: Task) -> Task:
        """``task`` as the journal listed it, or its final state if that is not recorded yet."""
        final = self.finals.final(task.id)
        return taskops.copy(final) if final is not None else task

    def new(self, message: Message, scope: str) -> LiveTask:
        """A new task for ``message`` (its ids set), live from now on.

        Raises:
            ParkedTasksLimitError: No room for it (see ``ParkingLot.make_room``).
        """
        self.parking.make_room()
        task_id = str(uuid.uuid4())
        context_id = context_for(scope, message.context_id)
        message.task_id, message.context_id = task_id, context_id
        self.metrics.tasks_started += 1
        live = LiveTask(
            task_id,
            context_id,
            self.journal,
            TaskLog(task_id, self.pool),
            first_message=message,
            max_bytes=self.config.max_task_bytes,
            scope=scope,
        )
        self._register(live)
        return live

    def revivable(self, found: RecordedTask) -> LiveTask | None:
        """The task live here, or brought back from its record (None: it is not here)."""
        return self._live.get(found.task.id) or self._revive(found)

    def abandon(self, live: LiveTask) -> None:
        """Forget a new task whose run never started (nothing of it was recorded)."""
        self._drop(live)
        if self._listener is not None:
            self._listener.evicted(live.task_id)
            self._listener.forgotten(live.task_id)
        live.log.release()

    def close(self) -> None:
        """Shutdown began: no task is revived any more, none parks."""
        self._open = False
        self.parking.close()

    def _revive(self, found: RecordedTask) -> LiveTask | None:
        """Bring a parked task that left memory back from its record (None: it is not one)."""
        task = found.task
        if task.status.state not in taskops.INTERRUPTED or self.owned_elsewhere(found):
            return None
        if not self._open:
            return None
        live = LiveTask(
            task.id,
            task.context_id,
            self.journal,
            TaskLog(task.id, self.pool, first_seq=found.seq + 1),
            task=task,
            version=found.version,
            max_bytes=self.config.max_task_bytes,
            scope=found.scope,
        )
        self._register(live)
        self.parking.park(live)
        if self._listener is not None:
            self._listener.revived(live)
        return live

    def _evict(self, live: LiveTask) -> None:
        """Take a parked task out of memory (``ParkingLot``); its record stays."""
        self._drop(live)
        if self._listener is not None:
            self._listener.evicted(live.task_id)
        live.log.release()

    def _register(self, live: LiveTask) -> None:
        self._live[live.task_id] = live
        self.quotas.task_added(principal_of(live.scope))

        def out_of_memory() -> None:
            self._drop(live)
            self.parking.unpark(live.task_id)

        def letting_go() -> None:  # (before a hand-over closes the log: see ended)
            out_of_memory()
            if self._listener is not None:
                self._listener.evicted(live.task_id)

        live.letting_go = letting_go

        def ended() -> None:
            # (letting_go refers to ``live``: a cycle the collector would have to find)
            live.letting_go = None
            out_of_memory()
            if live.task is None and self._listener is not None:
                # A message-only answer: no task is recorded, so no retention drops
                # the push configs a message carried; they go now.
                self._listener.forgotten(live.task_id)
            if live.final_unrecorded:
                self.finals.retry(live)

        live.log.on_close(ended)

    def _drop(self, live: LiveTask) -> None:
        """``live`` is no longer in memory here (once; it may be revived later)."""
        if self._live.get(live.task_id) is live:
            del self._live[live.task_id]
            self.quotas.task_removed(principal_of(live.scope))

"""ActiveTask: one live task's state, its channel, and the only code that writes it.

Who runs what: ``commit`` is called by the task's consumer for every event
the executor enqueues; ``finalize`` by the consumer (executor failed or ended
without an outcome), by CancelTask (the executor did not cancel in time, or
its ``cancel()`` ended without a final state) and by shutdown. Both hold the
task's lock from reading the current version to broadcasting, so the store,
the channel snapshot and the frames subscribers see never disagree:
persist, then broadcast. Once the task is final nothing more is written.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from a2a.types.a2a_pb2 import Message, StreamResponse, Task, TaskState, TaskStatusUpdateEvent
from a2a.utils.errors import InvalidAgentResponseError

from . import taskops
from .channel import TaskChannel
from .store import FinalTaskError, StoreError, TaskStore
from .taskops import Event

if TYPE_CHECKING:
    from .cluster import EventLog
    from .supervisor import Run

logger = logging.getLogger(__name__)


class ActiveTask:
    """A task that has not ended yet, on the instance that runs it.

    Args:
        task_id: The task's id.
        context_id: The task's context id.
        store: Where the task is persisted.
        channel: The task's broadcast.
        task: The stored task, or None for a task the executor has not
            created yet.
        version: The stored version of ``task``.
        first_message: The user message that starts a new task.
        events: Where frames are logged for other instances (cluster mode).
    """

    __slots__ = (
        "_events",
        "_first_message",
        "_index",
        "_logged",
        "_store",
        "_task",
        "_version",
        "admitting",
        "answer",
        "channel",
        "context_id",
        "lock",
        "run",
        "task_id",
    )

    def __init__(
        self,
        task_id: str,
        context_id: str,
        store: TaskStore,
        channel: TaskChannel,
        task: Task | None = None,
        version: int = 0,
        first_message: Message | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.task_id = task_id
        self.context_id = context_id
        self.channel = channel
        self.lock = asyncio.Lock()
        self.answer: Message | None = None
        """The executor's message-only answer, when it gave one."""
        self._store = store
        self._task = task
        self._index = taskops.index_artifacts(task) if task is not None else {}
        self._version = version
        self._first_message = first_message
        self._events = events
        self._logged = 0
        self.run: Run | None = None
        """The execution currently feeding this task, if any."""
        self.admitting = False
        """A follow-up message is being admitted (its run is about to start)."""

    @property
    def task(self) -> Task | None:
        """The task as last persisted (do not mutate), or None before it exists."""
        return self._task

    @property
    def state(self) -> TaskState:
        """The task's current state (UNSPECIFIED before it exists)."""
        return (
            self._task.status.state if self._task is not None else TaskState.TASK_STATE_UNSPECIFIED
        )

    async def commit(self, event: Event) -> None:
        """Persist ``event``'s effect on the task, then broadcast its frame.

        An event that arrives after the task ended is dropped and logged.

        Raises:
            InvalidAgentResponseError: The event does not fit this task.
            StoreError: The store refused the write.
        """
        async with self.lock:
            if self.channel.closed:
                self.drop(event, "the task already ended")
                return
            if self._task is None:
                if isinstance(event, Message):
                    self._answer(event)
                    return
                await self._create(event if isinstance(event, Task) else None)
                if isinstance(event, Task):
                    return
            task = self._task
            assert task is not None
            # Applied in place, not on a copy, and handed straight to the
            # store (TaskStore.update's ownership rule): a copy per event would
            # make a long stream quadratic. apply() validates before it
            # mutates, and a store that refuses the write ends the task
            # (supervisor), so an unpersisted change is never built upon.
            frame = taskops.apply(task, event, self._index)
            await self._persist(task)
            await self._log(frame, task)
            final = taskops.is_final(task)
            self.channel.publish(frame, task, final=final)
            if final:
                self.channel.close()

    async def add_user_message(self, message: Message) -> None:
        """Record a follow-up user message in the task's history (no frame is sent)."""
        async with self.lock:
            assert self._task is not None
            updated = taskops.copy(self._task)
            taskops.add_user_message(updated, message)
            await self._persist(updated)
            await self._log(None, updated)
            self.channel.set_snapshot(updated)

    async def finalize(self, state: TaskState, text: str) -> None:
        """End the task in ``state`` unless it already ended; every subscriber gets the frame.

        Args:
            state: A terminal state.
            text: The status message, for a person to read.
        """
        async with self.lock:
            if self.channel.closed:
                return
            try:
                if self._task is None:
                    await self._create(None)
            except StoreError:
                logger.exception("could not create task %s to record its end", self.task_id)
            base = self._task or taskops.new_task(
                self.task_id, self.context_id, self._first_message
            )
            if taskops.is_final(base):
                self.channel.close()
                return
            updated = taskops.copy(base)
            frame = taskops.apply(updated, taskops.status_event(updated, state, text))
            try:
                if self._task is not None:
                    await self._persist(updated)
            except FinalTaskError:
                if await self._close_as_stored():
                    return
            except StoreError:
                # Subscribers still get the frame even if the store refused it.
                logger.exception("could not persist the final state of task %s", self.task_id)
            try:
                await self._log(frame, updated)
            except StoreError:
                logger.exception("could not log the final frame of task %s", self.task_id)
            self.channel.close(frame, updated)

    async def _close_as_stored(self) -> bool:
        """End the channel with the outcome another instance already stored.

        In cluster mode a survivor that thought this instance lost may have
        ended the task (and logged its frame); local subscribers then get
        that same outcome, not one of ours.
        """
        try:
            stored = await self._store.get(self.task_id)
        except StoreError:
            return False
        if stored is None or not taskops.is_final(stored.task):
            return False
        task = stored.task
        logger.warning(
            "task %s was ended %s by another instance",
            self.task_id,
            TaskState.Name(task.status.state),
        )
        update = TaskStatusUpdateEvent(task_id=task.id, context_id=task.context_id)
        update.status.CopyFrom(task.status)
        self.channel.close(StreamResponse(status_update=update), task)
        return True

    async def _create(self, given: Task | None) -> None:
        if given is not None:
            if given.id and given.id != self.task_id:
                raise InvalidAgentResponseError(
                    f"agent created task {given.id!r} while serving task {self.task_id!r}"
                )
            task = taskops.copy(given)
            task.id, task.context_id = self.task_id, task.context_id or self.context_id
            if task.context_id != self.context_id:
                raise InvalidAgentResponseError(
                    f"agent created a task in context {task.context_id!r}, not {self.context_id!r}"
                )
            if task.status.state == TaskState.TASK_STATE_UNSPECIFIED:
                task.status.state = TaskState.TASK_STATE_SUBMITTED
            if not task.status.HasField("timestamp"):
                task.status.timestamp.CopyFrom(taskops.now())
            first = self._first_message
            if first is not None and all(m.message_id != first.message_id for m in task.history):
                task.history.insert(0, first)
        else:
            task = taskops.new_task(self.task_id, self.context_id, self._first_message)
        self._version = await self._store.create(task)
        self._task = task
        self._first_message = None  # in the task's history now
        self._index = taskops.index_artifacts(task)
        frame = StreamResponse(task=task)
        await self._log(frame, task)
        self.channel.publish(frame, task, final=taskops.is_final(task))
        if taskops.is_final(task):
            self.channel.close()

    async def _persist(self, updated: Task) -> None:
        self._version = await self._store.update(updated, self._version)
        self._task = updated

    async def _log(self, frame: StreamResponse | None, task: Task) -> None:
        """Log a persisted frame for other instances (persist, log, then broadcast)."""
        if self._events is not None:
            seq = self._logged + 1
            await self._events.append(self.task_id, seq, self._version, frame, task)
            self._logged = seq

    def _answer(self, message: Message) -> None:
        self.answer = message
        self.channel.publish(StreamResponse(message=message), None, final=True)
        self.channel.close()

    def drop(self, event: Event, why: str) -> None:
        """Count and log an event that is not applied."""
        self.channel.metrics.dropped_events += 1
        logger.warning(
            "dropped a %s for task %s (%s): %s",
            type(event).__name__,
            self.task_id,
            TaskState.Name(self.state),
            why,
        )

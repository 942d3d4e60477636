"""TaskManager: which tasks are live on this instance, and the operations on them.

Who runs what: gRPC handlers call ``send``, ``cancel`` and ``subscribe``;
each ``send`` that starts work spawns one ``Run`` (see ``supervisor``) as an
asyncio task the manager keeps until it ends. A task is "active" from its
first message until its channel closes; interrupted tasks stay active
without a run, waiting for a follow-up. ``shutdown`` ends every active task
with a final frame.

In cluster mode a task is active only on its owner. For a task owned by
another instance, ``subscribe`` joins this instance's relay of it, and
``cancel`` and follow-up ``send`` are routed to the owner (see ``cluster``),
which runs them through this same class with ``route=False``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.types.a2a_pb2 import Message, SendMessageRequest, Task, TaskState
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from . import taskops
from .active import ActiveTask
from .callmeta import Caller, request_context
from .channel import ChannelClosedError, Subscription, TaskChannel
from .config import ServerConfig
from .errors import ServerShuttingDownError
from .metrics import Metrics
from .store import StoredTask, TaskStore
from .supervisor import TASK_PREFIX, Run

if TYPE_CHECKING:
    from .cluster import Cluster, EventLog

logger = logging.getLogger(__name__)

CANCEL_SLACK = 1.0
"""Seconds CancelTask waits beyond ``cancel_timeout`` before it ends the task itself."""


@dataclass(slots=True)
class Started:
    """What ``TaskManager.send`` hands back once the execution is running.

    Attributes:
        active: The task being executed.
        snapshot: The task before this message's events (None for a new task).
        subscription: The caller's subscription, made before the executor
            started (None when the caller did not ask for one).
        start_seq: The channel's frame count before the executor started.
        run: The execution started for this message.
    """

    active: ActiveTask
    snapshot: Task | None
    subscription: Subscription | None
    start_seq: int
    run: Run

    async def outcome(self, *, immediately: bool) -> Task | Message:
        """Wait for what a blocking SendMessage answers.

        Args:
            immediately: Answer as soon as the task exists.

        Returns:
            The executor's message-only answer, or a copy of the task once it
            is final, interrupted by this message's run, or idle again.
        """
        active, channel = self.active, self.active.channel
        while not channel.closed and not self.run.finished:
            if immediately and active.task is not None:
                break
            if channel.seq > self.start_seq and active.state in taskops.INTERRUPTED:
                break
            await channel.wait_changed()
        if active.task is None and active.answer is not None:
            return active.answer
        # The channel's snapshot covers a task the store refused to create.
        task = active.task or channel.snapshot
        assert task is not None, "a run that ends without an answer always leaves a task"
        return taskops.copy(task)


@dataclass(slots=True)
class Routed:
    """A follow-up message this instance sent to the task's owner (cluster mode).

    Attributes:
        snapshot: The task as the message found it (the message included).
        subscription: This caller's subscription to the task's relay.
        store: Where the task is read back from.
    """

    snapshot: Task
    subscription: Subscription
    store: TaskStore

    async def outcome(self, *, immediately: bool) -> Task | Message:
        """Wait for what a blocking SendMessage answers (see ``Started.outcome``)."""
        sub = self.subscription
        try:
            if not immediately:
                async for frame in sub:
                    kind = frame.WhichOneof("payload")
                    state = (
                        frame.status_update.status.state
                        if kind == "status_update"
                        else frame.task.status.state
                        if kind == "task"
                        else TaskState.TASK_STATE_UNSPECIFIED
                    )
                    if taskops.is_final_state(state) or state in taskops.INTERRUPTED:
                        break
        finally:
            sub.close()
        stored = await self.store.get(self.snapshot.id)
        return stored.task if stored is not None else self.snapshot


def _no_more_messages(task: Task) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"task {task.id!r} is {TaskState.Name(task.status.state)} and accepts no more "
        "messages; start a new task (omit message.task_id)"
    )


class TaskManager:
    """Owns the live tasks of this instance.

    Args:
        executor: The agent.
        store: Where tasks are persisted.
        config: Limits.
        metrics: Where this instance counts what it does.
        cluster: The other instances (None: this instance is alone).
        events: Where frames are logged for the other instances (cluster mode).
    """

    def __init__(
        self,
        executor: AgentExecutor,
        store: TaskStore,
        config: ServerConfig,
        metrics: Metrics | None = None,
        *,
        cluster: Cluster | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        self.config = config
        self._executor = executor
        self._store = store
        self._config = config
        self._cluster = cluster
        self._events = events
        self._active: dict[str, ActiveTask] = {}
        self._runs: dict[asyncio.Task[None], Run] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True

    @property
    def store(self) -> TaskStore:
        """The task store."""
        return self._store

    @property
    def active_count(self) -> int:
        """Tasks that have not ended on this instance."""
        return len(self._active)

    async def send(
        self,
        request: SendMessageRequest,
        call: Caller,
        *,
        subscribe: bool,
        route: bool = True,
    ) -> Started | Routed:
        """Start executing a message: a new task, or a follow-up to an interrupted one.

        Args:
            request: The message and its configuration.
            call: The caller's context.
            subscribe: Subscribe the caller before the executor starts.
            route: Send a follow-up for a task another instance owns to that
                owner (False: this instance was routed to; serve it here).

        Raises:
            TaskNotFoundError: The message names a task the store does not have.
            UnsupportedOperationError: That task has ended or is still working.
            InvalidParamsError: The message's context does not match the task's.
            ServerShuttingDownError: The server is draining.
            OwnerUnavailableError: The task's owner did not answer (cluster mode).
        """
        if not self._accepting:
            raise ServerShuttingDownError("server is shutting down; retry on another instance")
        message = request.message
        follow_up = bool(message.task_id)
        if follow_up:
            stored = await self._check_follow_up(message.task_id, message.context_id)
            if route and self._owned_elsewhere(stored):
                return await self._route_send(stored, request, call)
            active = self._admit(stored)
            message.context_id = active.context_id
        else:
            active = self._new_task(message)
        try:
            if follow_up:
                await active.add_user_message(message)
            if active.channel.closed:  # canceled while the message was being recorded
                raise UnsupportedOperationError(
                    f"task {active.task_id!r} ended before this message could start; "
                    "start a new task (omit message.task_id)"
                )
            snapshot, sub = active.channel.subscribe() if subscribe else (None, None)
            context = request_context(
                call,
                request=request,
                task_id=active.task_id,
                context_id=active.context_id,
                task=taskops.copy(active.task) if active.task else None,
            )
            start_seq = active.channel.seq
            run = self._spawn(active, context)
        finally:
            active.admitting = False
        return Started(active, snapshot, sub, start_seq, run)

    def _new_task(self, message: Message) -> ActiveTask:
        task_id = str(uuid.uuid4())
        context_id = message.context_id or str(uuid.uuid4())
        message.task_id, message.context_id = task_id, context_id
        channel = TaskChannel(task_id, self._config.subscriber_buffer, self.metrics)
        self.metrics.tasks_started += 1
        active = ActiveTask(
            task_id, context_id, self._store, channel, first_message=message, events=self._events
        )
        self._register(active)
        return active

    async def get(self, task_id: str) -> Task:
        """Return the stored task.

        Raises:
            TaskNotFoundError: The store has no such task (never had it, or
                it was evicted by retention).
        """
        return (await self._get_stored(task_id)).task

    async def _get_stored(self, task_id: str) -> StoredTask:
        stored = await self._store.get(task_id)
        if stored is None:
            raise TaskNotFoundError(f"task {task_id!r} not found")
        return stored

    def _owned_elsewhere(self, stored: StoredTask) -> bool:
        return (
            self._cluster is not None
            and bool(stored.owner)
            and stored.owner != self._cluster.instance_id
        )

    async def cancel(self, task_id: str, call: Caller, *, route: bool = True) -> Task:
        """Cancel a task; every stream of it, on every instance, ends with CANCELED.

        The executor's ``cancel()`` gets ``cancel_timeout`` seconds to end the
        task; if it does not (no-op, raised, hung), the server ends it
        CANCELED itself and cancels the executor. A task another instance
        owns is canceled by that owner (unless ``route`` is False).

        Raises:
            TaskNotFoundError: No such task.
            TaskNotCancelableError: The task already ended.
            OwnerUnavailableError: The task's owner did not answer (cluster mode).
        """
        started = time.monotonic()
        active = self._active.get(task_id)
        if active is None or active.task is None or taskops.is_final(active.task):
            # Not running here (or not yet created): the store decides.
            found = await self._get_stored(task_id)
            stored = found.task
            if not taskops.is_final(stored) and route and self._owned_elsewhere(found):
                assert self._cluster is not None
                final = await self._cluster.cancel(found, call)
                self.metrics.cancel_seconds.observe(time.monotonic() - started)
                return final
            active = self._active.get(task_id)
            if taskops.is_final(stored) or active is None:
                raise TaskNotCancelableError(
                    f"task {task_id!r} is {TaskState.Name(stored.status.state)} "
                    "and cannot be canceled"
                )
        run = active.run
        if run is None or not run.request_cancel():
            context = request_context(
                call,
                task_id=task_id,
                context_id=active.context_id,
                task=taskops.copy(active.task) if active.task else None,
            )
            self._spawn(active, context, execute=False, cancel=True)
        try:
            # The run bounds cancel() by cancel_timeout and then ends the task
            # itself; this wait only guards against a run that cannot.
            async with asyncio.timeout(self._config.cancel_timeout + CANCEL_SLACK):
                while not active.channel.closed:
                    await active.channel.wait_changed()
        except TimeoutError:
            logger.error("task %s: its run did not end it after cancel; ending it here", task_id)
            await active.finalize(TaskState.TASK_STATE_CANCELED, "task canceled by request")
        self.metrics.cancel_seconds.observe(time.monotonic() - started)
        final = await self.get(task_id)
        if final.status.state != TaskState.TASK_STATE_CANCELED:
            raise TaskNotCancelableError(
                f"task {task_id!r} ended {TaskState.Name(final.status.state)} "
                "before it could be canceled"
            )
        return final

    async def subscribe(self, task_id: str) -> tuple[Task, Subscription]:
        """Join a live task's broadcast.

        Returns:
            The task snapshot and a subscription to every frame after it.

        Raises:
            TaskNotFoundError: No such task.
            UnsupportedOperationError: The task already ended.
        """
        found = await self._get_stored(task_id)
        stored = found.task
        active = self._active.get(task_id)
        if active is None and self._cluster is not None and not taskops.is_final(stored):
            return await self._cluster.subscribe(found)
        try:
            if active is None:
                raise ChannelClosedError(task_id)
            snapshot, sub = active.channel.subscribe()
        except ChannelClosedError:
            raise UnsupportedOperationError(
                f"task {task_id!r} is {TaskState.Name(stored.status.state)}; "
                "a terminal task cannot be subscribed to (use GetTask)"
            ) from None
        return snapshot or stored, sub

    async def shutdown(self, grace: float) -> None:
        """Stop accepting work, let runs finish for ``grace`` seconds, then end the rest FAILED."""
        self._accepting = False
        try:
            async with asyncio.timeout(grace):
                await self._wait_runs_interrupted()
        except TimeoutError:
            pass
        for active in list(self._active.values()):
            await active.finalize(TaskState.TASK_STATE_FAILED, "server shutting down")
        try:
            async with asyncio.timeout(self._config.cancel_timeout):
                await self.wait_idle()
        except TimeoutError:
            # Only an executor that swallows its cancellation gets here; its
            # streams already have their final frame.
            logger.error("%d run(s) ignored cancellation at shutdown", len(self._runs))

    async def wait_idle(self) -> None:
        """Wait until no run of this manager is alive."""
        await self._idle.wait()

    async def _check_follow_up(self, task_id: str, context_id: str) -> StoredTask:
        found = await self._get_stored(task_id)
        stored = found.task
        if context_id and context_id != stored.context_id:
            raise InvalidParamsError(
                f"message.context_id {context_id!r} does not match task {task_id!r}'s "
                f"context {stored.context_id!r}; omit it or send the task's own"
            )
        if taskops.is_final(stored):
            raise _no_more_messages(stored)
        return found

    def _admit(self, found: StoredTask) -> ActiveTask:
        stored = found.task
        active = self._active.get(stored.id)
        if active is None or active.channel.closed:
            raise _no_more_messages(stored)
        if active.admitting or (active.run is not None and not active.run.finished):
            raise UnsupportedOperationError(
                f"task {stored.id!r} is still {TaskState.Name(stored.status.state)}; send "
                "follow-ups only when it asks for input, or cancel it"
            )
        # Held until the follow-up's run is spawned: one executor per task.
        active.admitting = True
        return active

    async def _route_send(
        self, found: StoredTask, request: SendMessageRequest, call: Caller
    ) -> Routed:
        assert self._cluster is not None
        # Subscribed before the owner starts: no frame of this message is missed.
        snapshot, sub = await self._cluster.subscribe(found)
        try:
            await self._cluster.send(found, request, call)
        except BaseException:
            sub.close()
            raise
        request.message.context_id = snapshot.context_id
        taskops.add_user_message(snapshot, request.message)
        return Routed(snapshot, sub, self._store)

    def _register(self, active: ActiveTask) -> None:
        self._active[active.task_id] = active

        def forget() -> None:
            self._active.pop(active.task_id, None)

        active.channel.on_close(forget)

    def _spawn(
        self,
        active: ActiveTask,
        context: RequestContext,
        *,
        execute: bool = True,
        cancel: bool = False,
    ) -> Run:
        run = Run(
            active,
            self._executor,
            context,
            self._config.event_queue_size,
            self._config.cancel_timeout,
            execute=execute,
            cancel=cancel,
        )
        active.run = run
        task = asyncio.create_task(run.run(), name=f"{TASK_PREFIX}:run:{active.task_id}")
        self._runs[task] = run
        self._idle.clear()
        task.add_done_callback(self._run_done)
        return run

    def _run_done(self, task: asyncio.Task[None]) -> None:
        run = self._runs.pop(task)
        if run.active.run is run:
            run.active.run = None
        if not task.cancelled() and task.exception() is not None:
            logger.error("run of task %s crashed", run.active.task_id, exc_info=task.exception())
        if not self._runs:
            self._idle.set()

    async def _wait_runs_interrupted(self) -> None:
        while self._runs:
            await asyncio.wait(list(self._runs), return_when=asyncio.FIRST_COMPLETED)

"""TaskEngine: the operations on this instance's tasks.

Who runs what: gRPC handlers call ``send``, ``cancel``, ``read``,
``subscribe`` and ``resume``. The engine composes three parts, each with
one job: ``registry.LiveTasks`` (which tasks are live here, how they come
back from their record and leave memory), ``runs.Runs`` (the executions:
each ``send`` that starts work spawns one ``ExecutionSupervisor`` there) and
``finals.FinalRetries`` (final states the journal has not recorded yet, held
by the registry). A task is "live" from its first message until its log
closes; interrupted tasks stay live without an execution, waiting for a
follow-up. ``shutdown`` ends every live task with a final frame.

This is the local implementation of ``ports.TaskOperations``: it serves
the tasks this instance runs, and knows of other instances only that a task
another one owns is not to be revived here. In cluster mode
``cluster.front.ClusterFront`` implements the same operations above it: it
routes what concerns a task another instance owns (a relay, the shared
record, a request to the owner, which serves it through this class) and
hands the rest to this one.

Every operation on an existing task is scoped (see ``scope``): the caller's
scope is compared with the task's before anything else is done with it, and
a task of another scope is answered exactly as a missing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from a2a.server.agent_execution import AgentExecutor
from a2a.types.a2a_pb2 import Message, SendMessageRequest, Task, TaskState
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    UnsupportedOperationError,
)

from ..errors import (
    FrameNotKeptError,
    InvalidFieldError,
    ServerShuttingDownError,
    TaskGenerationMismatchError,
    quote,
)
from ..execution.live import LiveTask
from ..execution.supervisor import ExecutionSupervisor
from ..journal import FinalTaskError, RecordedTask, Released, StoreError
from ..log.tasklog import LogClosedError, LogReader, TaskLog
from ..model import generation, taskops
from ..model.caller import Caller, request_context
from ..model.scope import not_found, principal_of
from ..model.sizing import TaskTooLargeError
from .registry import LiveTasks
from .runs import Runs

if TYPE_CHECKING:
    from .ports import PushHooks

logger = logging.getLogger(__name__.replace("._internal", ""))

CANCEL_SLACK = 1.0
"""Seconds CancelTask waits beyond ``cancel_timeout`` before it ends the task itself."""
RECHECK_CONCURRENCY = 16
"""Tasks ``recheck_ownership`` reads at once."""


@dataclass(slots=True)
class Started:
    """What ``TaskEngine.send`` hands back once the execution is running.

    Attributes:
        live: The task being executed.
        snapshot: The task before this message's events (None for a new task).
        reader: The caller's reader of the task's log, made before the
            executor started (None when the caller did not ask for one).
        start_seq: The log's last sequence number before the executor started.
        run: The execution started for this message.
    """

    live: LiveTask
    snapshot: Task | None
    reader: LogReader | None
    start_seq: int
    run: ExecutionSupervisor

    @property
    def task_id(self) -> str:
        """The task the message started or continues."""
        return self.live.task_id

    @property
    def since(self) -> int:
        """The number of the task's last change before this message's run."""
        return self.start_seq

    async def outcome(self, *, immediately: bool) -> tuple[Task | Message, int]:
        """Wait for what a blocking SendMessage answers.

        Args:
            immediately: Answer as soon as the task exists.

        Returns:
            The executor's message-only answer, or a copy of the task once it
            is final, interrupted by this message's run, or idle again; and
            the sequence number of the last change the answer includes.
        """
        live, log = self.live, self.live.log
        while not log.closed and not self.run.finished:
            if immediately and live.task is not None:
                break
            if log.last_seq > self.start_seq and live.state in taskops.INTERRUPTED:
                break
            await log.wait_changed()
        if live.task is None and live.answer is not None:
            return live.answer, log.last_seq
        task, seq = await live.snapshot()
        # The log's snapshot covers a task the journal refused to create.
        task = task or (taskops.copy(log.snapshot) if log.snapshot is not None else None)
        assert task is not None, "a run that ends without an answer always leaves a task"
        return task, seq


def _no_more_messages(task: Task) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"task {quote(task.id)} is {taskops.state_name(task.status.state)} and accepts no more "
        "messages; start a new task (omit message.task_id)"
    )


def ended(task: Task) -> UnsupportedOperationError:
    """What a subscription to an ended task is answered (relays answer the same)."""
    return UnsupportedOperationError(
        f"task {quote(task.id)} is {taskops.state_name(task.status.state)}; "
        "a terminal task cannot be subscribed to (use GetTask)"
    )


class TaskEngine:
    """The operations on the tasks of this instance.

    Args:
        executor: The agent.
        tasks: The live tasks of this instance (their journal, limits and metrics).
        push: Push notifications (None: push is off); it listens to ``tasks``.
    """

    def __init__(
        self, executor: AgentExecutor, tasks: LiveTasks, *, push: PushHooks | None = None
    ) -> None:
        self.tasks = tasks
        """Which tasks are live here (see ``registry``)."""
        self.runs = Runs(executor, tasks.config, tasks.parking, tasks.quotas)
        """The executions of this instance (see ``runs``)."""
        self.push = push
        """Push notifications (None: push is off)."""
        if push is not None:
            tasks.listen(push)
        self._config = tasks.config
        self._accepting = True
        self._starting = 0
        """Messages accepted whose run is not spawned yet (shutdown waits for them)."""
        self._started = asyncio.Event()
        self._started.set()

    async def send(
        self,
        request: SendMessageRequest,
        call: Caller,
        *,
        subscribe: bool,
        resumable: bool = False,
        found: RecordedTask | None = None,
    ) -> Started:
        """Start executing a message: a new task, or a follow-up to an interrupted one.

        Args:
            request: The message and its configuration.
            call: The caller's context.
            subscribe: Give the caller a reader, made before the executor starts.
            resumable: The caller activated the resume extension (the task's
                frames are kept for the resume window).
            found: The follow-up's task as ``check_follow_up`` found it (None:
                look it up here).

        Raises:
            TaskNotFoundError: The message names a task the journal does not have.
            UnsupportedOperationError: That task has ended or is still working.
            InvalidParamsError: The message's context does not match the task's.
            ServerShuttingDownError: The server is draining.
            QuotaExceededError: A new task would exceed one of the caller's quotas.
        """
        if found is None and not self._accepting:  # (a follow-up: see _admit)
            raise ServerShuttingDownError("server is shutting down; retry on another instance")
        self._starting += 1  # (shutdown waits for it: see _wait_started)
        try:
            return await self._send(request, call, subscribe, resumable, found)
        finally:
            self._starting -= 1
            if not self._starting:
                self._started.set()

    async def _send(
        self,
        request: SendMessageRequest,
        call: Caller,
        subscribe: bool,
        resumable: bool,
        found: RecordedTask | None,
    ) -> Started:
        message = request.message
        follow_up = bool(message.task_id)
        if follow_up:
            recorded = found or await self.check_follow_up(
                message.task_id, message.context_id, call.scope
            )
            live = self._admit(recorded)
            message.context_id = live.context_id
        else:
            principal = call.principal.name if call.principal is not None else ""
            self.tasks.quotas.check_new_task(principal, self.tasks.parking)
            live = self.tasks.new(message, call.scope)
        snapshot, reader = None, None
        try:
            if follow_up and self._config.generation:
                expected = generation.if_generation_match(request.configuration)
                if expected is not None and expected != live.log.last_seq:
                    raise TaskGenerationMismatchError(live.task_id, expected, live.log.last_seq)
            if resumable:
                live.log.make_resumable()
            inline = request.configuration
            if inline.HasField("task_push_notification_config"):
                assert self.push is not None, "the servicer refuses it when push is off"
                await self.push.register(live, inline.task_push_notification_config)
            try:
                if follow_up:
                    try:
                        await live.add_user_message(message, act_by=call.act_by)
                    except TaskTooLargeError as exc:
                        raise InvalidFieldError(
                            "message", f"{exc.message}; start a new task (omit message.task_id)"
                        ) from None
                if live.log.closed:
                    raise LogClosedError(live.task_id)
                snapshot, reader = await live.subscribe() if subscribe else (None, None)
            except (LogClosedError, FinalTaskError):  # canceled as the message arrived
                raise UnsupportedOperationError(
                    f"task {quote(live.task_id)} ended before this message could start; "
                    "start a new task (omit message.task_id)"
                ) from None
            context = request_context(
                call,
                request=request,
                task_id=live.task_id,
                context_id=live.context_id,
                task=taskops.copy(live.task) if live.task else None,
            )
            start_seq = live.log.last_seq
            run = self.runs.spawn(live, context)
        except BaseException:
            if reader is not None:
                reader.close()
            if not follow_up:
                self.tasks.abandon(live)
            raise
        finally:
            live.admitting = False
        return Started(live, snapshot, reader, start_seq, run)

    async def read(self, task_id: str, scope: str, *, resumable: bool = False) -> tuple[Task, int]:
        """Return the task as recorded, and the seq of the last change it includes.

        Args:
            task_id: The task.
            scope: The caller's scope.
            resumable: The caller activated the resume extension.

        Raises:
            TaskNotFoundError: The journal has no such task (never had it, or
                it was dropped by retention), or it is another scope's.
        """
        live = self.tasks.live_in(task_id, scope)
        if live is not None and live.task is not None:
            if resumable:
                live.log.make_resumable()
            task, seq = await live.snapshot()
            if task is not None:
                return task, seq
        recorded = await self.tasks.recorded(task_id, scope)
        return recorded.task, recorded.seq

    @property
    def accepting(self) -> bool:
        """Whether new work is accepted (False once a shutdown began)."""
        return self._accepting

    async def cancel(
        self,
        task_id: str,
        call: Caller,
        *,
        found: RecordedTask | None = None,
        started: float | None = None,
    ) -> Task:
        """Cancel a task; every stream of it, on every instance, ends with CANCELED.

        The executor's ``cancel()`` gets ``cancel_timeout`` seconds to end the
        task; if it does not (no-op, raised, hung), the server ends it
        CANCELED itself and cancels the executor.

        Args:
            task_id: The task.
            call: The caller's context.
            found: The task as recorded, if the caller read it already.
            started: When the caller began (``time.monotonic()``), for ``cancel_seconds``.

        Raises:
            TaskNotFoundError: No such task.
            TaskNotCancelableError: The task already ended.
        """
        started = started if started is not None else time.monotonic()
        live = self.tasks.live_in(task_id, call.scope)
        if live is None or live.task is None or taskops.is_final(live.task):
            # Not running here (or not yet created): the journal decides.
            found = found or await self.tasks.recorded(task_id, call.scope)
            recorded = found.task
            live = self.tasks.revivable(found)
            if taskops.is_final(recorded) or live is None:
                raise TaskNotCancelableError(
                    f"task {quote(task_id)} is {taskops.state_name(recorded.status.state)} "
                    "and cannot be canceled"
                )
        run = self.runs.current(task_id)
        if run is None or not run.request_cancel():
            context = request_context(
                call,
                task_id=task_id,
                context_id=live.context_id,
                task=taskops.copy(live.task) if live.task else None,
            )
            self.runs.spawn(live, context, execute=False, cancel=True)
        try:
            # The run bounds cancel() by cancel_timeout and then ends the task
            # itself; this wait only guards against a run that cannot.
            async with asyncio.timeout(self._config.cancel_timeout + CANCEL_SLACK):
                while not live.log.closed:
                    await live.log.wait_changed()
        except TimeoutError:
            # The run ends a canceled task itself within cancel_timeout; only a loop
            # starved that long (an overloaded machine) gets here. The outcome is right.
            logger.warning("task %s: its run did not end it after cancel; ending it here", task_id)
            await live.finalize(TaskState.TASK_STATE_CANCELED, "task canceled by request")
        self.tasks.metrics.cancel_seconds.observe(time.monotonic() - started)
        final = (await self.tasks.recorded(task_id, call.scope)).task
        if final.status.state != TaskState.TASK_STATE_CANCELED:
            raise TaskNotCancelableError(
                f"task {quote(task_id)} ended {taskops.state_name(final.status.state)} "
                "before it could be canceled"
            )
        return final

    async def subscribe(
        self,
        task_id: str,
        scope: str,
        *,
        resumable: bool = False,
        found: RecordedTask | None = None,
    ) -> tuple[Task, LogReader]:
        """Join a live task's log at its current end.

        Returns:
            The task snapshot and a reader of every frame after it.

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
            UnsupportedOperationError: The task already ended.
            QuotaExceededError: The task has ``quota_subscribers`` subscribers here.
        """
        found = found or await self.tasks.recorded(task_id, scope)
        live = self.tasks.revivable(found)
        try:
            if live is None:
                raise LogClosedError(task_id)
            self.tasks.quotas.check_subscribers(live.log.readers)  # before the lock's wait
            if resumable:
                live.log.make_resumable()
            snapshot, reader = await live.subscribe()
        except LogClosedError:
            raise ended(found.task) from None
        try:
            self.tasks.quotas.check_subscribers(reader.followers - 1)  # others came meanwhile
        except BaseException:
            reader.close()
            raise
        return snapshot or found.task, reader

    async def recheck_ownership(self) -> int:
        """Let go of every live task another instance ended or took over meanwhile.

        Called after this instance was out of touch with the cluster for
        longer than its lease: a task ended elsewhere ends here with that
        outcome (see ``LiveTask.close_if_ended_elsewhere``); a waiting task a
        survivor released, or another instance claimed, is handed over (its
        readers here resubscribe through another instance).

        Returns:
            How many tasks had ended or moved elsewhere.
        """
        gate = asyncio.Semaphore(RECHECK_CONCURRENCY)

        async def check(live: LiveTask) -> bool:
            async with gate:
                if await live.close_if_ended_elsewhere():
                    return True
                if not self._waiting(live):
                    return False
                recorded = await self.tasks.journal.get(live.task_id)
                if recorded is None or not self.tasks.owned_elsewhere(recorded):
                    return False
                if not self._waiting(live) or taskops.is_final(recorded.task):
                    return False  # (a message arrived meanwhile, or it ended: not handed over)
                self.tasks.hand_over(live, "another instance took it over")
                return True

        moved = await asyncio.gather(*(check(live) for live in self.tasks.all()))
        return sum(moved)

    def _waiting(self, live: LiveTask) -> bool:
        """Whether ``live`` waits for input here with nothing running or arriving for it."""
        return (
            not live.log.closed
            and live.task is not None
            and live.state in taskops.INTERRUPTED
            and not live.admitting
            and self.runs.current(live.task_id) is None
        )

    async def watch(
        self, task_id: str, scope: str, after: int, found: RecordedTask | None = None
    ) -> LogReader | None:
        """A passive reader of a live task's next change (``LiveTask.watch``).

        Returns:
            None when the task has ended, is not live here, or moved past
            change ``after`` already.

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
        """
        found = found or await self.tasks.recorded(task_id, scope)
        live = None if taskops.is_final(found.task) else self.tasks.revivable(found)
        return live.watch(after) if live is not None else None

    async def resume(
        self,
        task_id: str,
        after: int,
        scope: str,
        replay: Callable[[RecordedTask, int], Awaitable[LogReader]] | None = None,
    ) -> LogReader:
        """A reader of exactly the task's frames after ``after`` (the resume extension).

        Served from this instance's log of the task when it still keeps frame
        ``after + 1``; in cluster mode from the shared event log otherwise. A
        reader resumed after an ended task's final frame ends at once.

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
            FrameNotKeptError: Frame ``after + 1`` is no longer kept (or
                ``after`` is past the task's last frame).
        """
        live = self.tasks.live_task(task_id)
        if live is not None and live.scope != scope:
            raise not_found(task_id)
        pool = self.tasks.pool
        log = live.log if live is not None else pool.retained(task_id)
        if log is not None and log.scope != scope:
            raise not_found(task_id)
        if log is not None and log.first_kept - 1 <= after <= log.last_seq:
            self.tasks.quotas.check_subscribers(log.readers)
            log.make_resumable()
            return log.reader(after + 1)
        recorded = await self.tasks.recorded(task_id, scope)
        last = max(recorded.seq, log.last_seq if log is not None else 0)
        if after > last:
            raise FrameNotKeptError(task_id, after + 1, log.first_kept if log else last + 1, last)
        if after == last and taskops.is_final(recorded.task):
            return TaskLog.ended(task_id, pool, last).reader(after + 1)
        if replay is not None:  # (cluster mode: the shared record has it)
            return await replay(recorded, after)
        first = log.first_kept if log is not None else last + 1
        raise FrameNotKeptError(task_id, after + 1, first, last)

    async def shutdown(
        self,
        grace: float,
        deadline: float | None = None,
        release: Callable[[str], Awaitable[Released]] | None = None,
    ) -> None:
        """Stop accepting work, let runs finish for ``grace`` s, then end the rest FAILED.

        Every live task is ended at once (concurrently), each with its final
        frame to every reader whether or not the journal can record it by
        ``deadline``; final states not recorded by then are given up on (in
        cluster mode a survivor ends those tasks once this instance's lease is
        released). With ``release`` (cluster mode), a task that waits for
        input is not ended: it is left to the cluster (``release(task_id)``
        records it as owned by nobody) and its readers here end with
        ``TaskHandedOverError``, to resubscribe through another instance.

        Args:
            grace: Seconds runs may take to finish on their own.
            deadline: Event-loop time by which shutdown returns (None: no bound
                beyond the journal's own retries).
            release: Leaves a waiting task to the cluster (see
                ``_release_waiting`` for what each answer does).
        """
        self._accepting = False
        self.tasks.close()
        loop = asyncio.get_running_loop()
        if deadline is not None:
            grace = min(grace, max(0.0, deadline - loop.time()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                # Messages accepted before the shutdown get their run (and then the grace).
                while self._starting:
                    self._started.clear()
                    await self._started.wait()
                await self.runs.wait_interrupted()
        if release is not None:
            await self._release_waiting(release, deadline)
        ending = [
            live.finalize(TaskState.TASK_STATE_FAILED, "server shutting down", deadline=deadline)
            for live in self.tasks.all()
        ]
        await asyncio.gather(*ending)
        finals = self.tasks.finals
        await finals.wait(deadline)
        finals.give_up()
        try:
            remaining = self._config.cancel_timeout
            if deadline is not None:
                remaining = min(remaining, max(0.0, deadline - loop.time()))
            async with asyncio.timeout(remaining):
                await self._wait_runs_idle()
        except TimeoutError:
            # Only an executor that swallows its cancellation gets here; its
            # streams already have their final frame.
            logger.error("%d run(s) ignored cancellation at shutdown", len(self.runs))
        if self.push is not None:  # webhooks get the final frames too, within the budget
            await self.push.close(deadline)
        self.tasks.pool.close()

    async def _release_waiting(
        self, release: Callable[[str], Awaitable[Released]], deadline: float | None
    ) -> None:
        """Leave every waiting task to the cluster, each handed over here (see ``shutdown``).

        A task the cluster keeps this instance's (an older version is
        present) is left for the FAILED ending, as before. One that moved on
        (another instance claimed it, or a survivor released it, while this
        one was out of touch: the copy here is out of date) is handed over,
        its readers to resubscribe and read what it became; so is one whose
        release could not be written (NATS did not answer): a survivor
        decides once this instance's lease is gone.
        """
        waiting = [live for live in self.tasks.all() if self._waiting(live)]
        kept: set[str] = set()

        async def one(live: LiveTask) -> None:
            try:
                released = await release(live.task_id)
                if released is Released.KEPT:
                    kept.add(live.task_id)
                    return
                if released is Released.MOVED_ON:
                    logger.info("task %s: moved on elsewhere; handed over", live.task_id)
                    return
                self.tasks.metrics.tasks_released += 1
            except StoreError as exc:
                logger.warning("task %s: not released (%s); a survivor will", live.task_id, exc)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await asyncio.gather(*(one(live) for live in waiting))
        for live in waiting:
            if live.task_id not in kept and self._waiting(live):
                self.tasks.hand_over(live, "this instance is shutting down")

    async def wait_idle(self) -> None:
        """Wait until runs, final-state recorders and webhooks of ended tasks are done.

        Webhooks of an ended task are done once they got (or gave up) every frame.
        """
        await self._wait_runs_idle()
        if self.push is not None:
            await self.push.wait_ended()

    async def _wait_runs_idle(self) -> None:
        await self.runs.wait_idle()
        await self.tasks.finals.wait_done()

    async def check_follow_up(self, task_id: str, context_id: str, scope: str) -> RecordedTask:
        """The task a follow-up message names, if it may take one (its scope checked first).

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
            InvalidParamsError: The message's context is not the task's.
            UnsupportedOperationError: The task has ended.
        """
        found = await self.tasks.recorded(task_id, scope)
        recorded = found.task
        if context_id and context_id != recorded.context_id:
            raise InvalidParamsError(
                f"message.context_id {quote(context_id)} does not match task {quote(task_id)}'s "
                f"context {quote(recorded.context_id)}; omit it or send the task's own"
            )
        if taskops.is_final(recorded):
            raise _no_more_messages(recorded)
        return found

    def _admit(self, found: RecordedTask) -> LiveTask:
        if not self._accepting:
            # (Checked again here: a follow-up whose read began before the shutdown
            # must not run while this instance leaves its waiting tasks to the cluster.)
            raise ServerShuttingDownError("server is shutting down; retry on another instance")
        recorded = found.task
        if self.tasks.live_task(recorded.id) is None and not taskops.is_final(recorded):
            # Brought back into memory: it counts against the instance's limits again
            # (a follow-up is never refused by the caller's own quota; by these, it is).
            self.tasks.quotas.check_live_limit(principal_of(found.scope))
        live = self.tasks.revivable(found)
        if live is None or live.log.closed:
            raise _no_more_messages(recorded)
        run = self.runs.current(recorded.id)
        if live.admitting:
            raise UnsupportedOperationError(
                f"task {quote(recorded.id)} is taking another follow-up; retry once that "
                "one has started"
            )
        if run is not None and not run.finished:
            raise UnsupportedOperationError(
                f"task {quote(recorded.id)} is still {taskops.state_name(recorded.status.state)}; "
                "send follow-ups only when it asks for input, or cancel it"
            )
        # Held until the follow-up's run is spawned: one executor per task.
        live.admitting = True
        return live

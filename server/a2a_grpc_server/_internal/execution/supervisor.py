"""ExecutionSupervisor: one execution of an executor for one task, under one TaskGroup.

Who runs what: the engine's ``Runs`` start ``ExecutionSupervisor.run()`` as an asyncio
task. Inside it one ``asyncio.TaskGroup`` owns every coroutine of the execution:

* the producer, ``executor.execute(context, queue)``; it is the group's own
  body, running in the run's task (one task fewer per run);
* a canceller, ``executor.cancel(context, queue)``, once CancelTask asks;
* the consumer, which takes events off the run's queue in order and hands
  them to ``LiveTask.commit`` (validate, persist, append to the task's log),
  as many as are waiting at once (up to ``COMMIT_BATCH``), so a burst costs
  one journal write, not one per event. It runs only
  while the queue holds something: the first event put into an empty queue
  starts it, and it ends when it has drained the queue, so a task parked in
  ``execute()`` keeps one asyncio task, not two.

In a burst the producer (before each event it queues, past its first
``FREE_EVENTS``) and the consumer (after each batch it commits) ask the
pacer of the engine's ``Runs`` whether the loop has run bulk work long enough without polling
its I/O, and wait if so (see ``pacing``).

Producer and canceller never write the task themselves: they enqueue, and
when they end they enqueue a marker saying how. The consumer turns markers
into outcomes: ``execute()`` raised -> FAILED naming the error class;
``execute()`` returned with the task neither final nor interrupted -> FAILED;
``cancel()`` ended with the task not final -> CANCELED. When the task's
log closes it cancels the producer, the canceller and the consumer
(``ExecutionSupervisor.stop``; cancelling the producer cancels the run's task, and the group
cancels its children with it); the group then exits, which is the only way
they end.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.types.a2a_pb2 import (
    Task,
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import InvalidAgentResponseError

from ..journal import StoreError
from ..model import taskops
from ..model.names import TASK_PREFIX
from ..model.taskops import Event
from ..obs import tracing
from ..obs.logs import task_fields
from .live import LiveTask
from .mailbox import Mailbox
from .pacing import Pacer

logger = logging.getLogger(__name__.replace("._internal", ""))


COMMIT_BATCH = 256
"""Most events the consumer commits in one journal write."""

YIELD_EVERY = 8
"""Events the consumer commits in one step of the loop while streams read the task;
then it lets their writers run (a producer that never waits would otherwise have
its whole burst appended before any stream sent a frame)."""

UNPACED = Pacer(0.0)
"""The pacer of a run given none: it never makes anything wait."""

FREE_EVENTS = 16
"""Events a run queues before the pacer may hold its executor up: a short task (a unary
answer, a stream's first frames) goes on at once in a burst, and only bulk work queues.
Another caller's SendMessage during a burst to 20 unread streams (``python -m bench``):
p99 ~200 ms when its executor queued behind the burst's, 33 ms with this (raw: 36)."""


def _asks_for_input(event: Event) -> bool:
    """Whether ``event`` sets its task's state to one that waits for input (or auth)."""
    if isinstance(event, (Task, TaskStatusUpdateEvent)):
        return event.status.state in taskops.INTERRUPTED
    return False


@dataclass(frozen=True, slots=True)
class _SourceDone:
    kind: Literal["execute", "cancel"]
    error: BaseException | None


class ExecutorQueue(EventQueue):
    """The ``EventQueue`` an executor writes to; bounded, so a fast executor waits.

    It refers to its run weakly: the run refers to it, and a cycle would keep
    the run, its task and everything the task ever held until a full garbage
    collection, long after the task ended.
    """

    def __init__(self, run: ExecutionSupervisor, maxsize: int, max_bytes: int) -> None:
        self._run = weakref.ref(run)
        self._live = run.live
        self._pacer = run.pacer
        self._free = FREE_EVENTS
        self._queue: Mailbox[Event | _SourceDone] = Mailbox(maxsize, max_bytes)

    async def enqueue_event(self, event: Event) -> None:
        """Queue ``event`` for the consumer; after the task ended, drop it.

        An executor still emitting after its task ended has ignored its
        cancellation: the event is dropped and logged, and the calling
        coroutine is cancelled again so it stops.
        """
        if self._free:
            self._free -= 1
        elif self._pacer.due():  # a burst: the loop polls its I/O first (see ``pacing``)
            await self._pacer.wait()
        run = self._run()
        if self._live.log.closed:
            self._live.drop(event, "the task already ended")
            current = asyncio.current_task()
            if current is not None and run is not None and current in run.sources:
                current.cancel()
            return
        if run is None or run.finished:
            # execute() returned (e.g. the task is waiting for input) and
            # something it left behind is still emitting.
            self._live.drop(event, "its execute() had already returned")
            return
        await self.put(event, event.ByteSize() if isinstance(event, taskops.EVENT_TYPES) else 0)

    async def put(self, item: Event | _SourceDone, size: int = 0) -> None:
        """Queue ``item`` and make sure a consumer is draining the queue."""
        await self._queue.put(item, size)
        run = self._run()
        if run is not None:
            run.wake_consumer()


class ExecutionSupervisor:
    """Supervises one execution (or cancellation) of the executor for one task.

    Args:
        live: The task being executed.
        executor: The agent.
        context: The request context handed to the executor.
        queue_size: Most events in the event queue.
        queue_bytes: Most bytes of events in the event queue.
        cancel_timeout: Seconds the executor's ``cancel()`` may take; after
            that it is cancelled and the task ends CANCELED regardless.
        pacer: Shares the loop between bursts and everything else (that of
            the engine's ``Runs``; None: never waits).
        execute: Whether to call ``execute()``; False for a run that only
            cancels an idle interrupted task.
        cancel: Whether to call ``cancel()`` as soon as the run starts.
        may_wait: Asked before an event that has the task ask for input (or
            auth) is recorded: None lets it wait (and counts it as waiting),
            a text refuses, and the task ends FAILED with that status message
            instead (None: every task may wait).
    """

    __slots__ = (
        "__weakref__",
        "_cancel_requested",
        "_cancel_timeout",
        "_consumer",
        "_context",
        "_execute",
        "_executor",
        "_group",
        "_may_wait",
        "_queue",
        "_run_context",
        "_start_seq",
        "finished",
        "live",
        "pacer",
        "sources",
    )

    def __init__(
        self,
        live: LiveTask,
        executor: AgentExecutor,
        context: RequestContext,
        queue_size: int,
        queue_bytes: int,
        cancel_timeout: float,
        *,
        pacer: Pacer | None = None,
        execute: bool = True,
        cancel: bool = False,
        may_wait: Callable[[LiveTask], str | None] | None = None,
    ) -> None:
        self.live = live
        self.pacer = pacer or UNPACED
        self._executor = executor
        self._context = context
        self._queue = ExecutorQueue(self, queue_size, queue_bytes)
        self._execute = execute
        self._cancel_timeout = cancel_timeout
        self._group: asyncio.TaskGroup | None = None
        self._run_context: contextvars.Context | None = None
        """The run's context (its task ids for logs, its span), for the coroutines it starts:
        the canceller and the consumer are started from other calls' tasks too."""
        self._cancel_requested = cancel
        self.sources: list[asyncio.Task[None]] = []
        """The producer and canceller tasks still running (a list: at most two)."""
        self._consumer: asyncio.Task[None] | None = None
        self.finished = False
        """The run has ended (its TaskGroup exited)."""
        self._start_seq = live.log.last_seq
        self._may_wait = may_wait

    async def run(self) -> None:
        """Execute under the run's TaskGroup until the task ends or is interrupted."""
        log = self.live.log
        task_fields(self.live.task_id, self.live.context_id)  # in every log line of the run
        if log.closed:
            self.finished = True
            return
        log.on_close(self.stop)
        try:
            with tracing.execution(
                self.live.task_id, self.live.context_id, cancel=not self._execute
            ):
                await self._supervised()
        except Exception:
            # A fault of ours (the consumer handles the executor's and the
            # journal's): the streams still get their final frame.
            logger.exception("run of task %s failed", self.live.task_id)
            await self.live.finalize(TaskState.TASK_STATE_FAILED, "internal server error")
        finally:
            self._group = self._run_context = None
            self.finished = True
            log.remove_on_close(self.stop)
            log.notify()

    async def _supervised(self) -> None:
        """The run itself: its TaskGroup, the executor inline as the group's body."""
        self._run_context = contextvars.copy_context()
        async with asyncio.TaskGroup() as group:
            self._group = group
            if self._cancel_requested:
                self._start_canceller()
            if self._execute:
                # The group's own body is the producer (one task fewer per
                # run): the group still supervises it, and cancelling it
                # (``stop``) cancels the canceller and the consumer with it.
                body = asyncio.current_task()
                assert body is not None
                self.sources.append(body)
                # (Inline rather than in a task of its own: a parked task
                # keeps this frame for as long as it waits.)
                try:
                    error: BaseException | None = None
                    try:
                        await self._executor.execute(self._context, self._queue)
                    except asyncio.CancelledError:
                        raise  # the run is being stopped: never an outcome
                    except BaseException as exc:  # even SystemExit: see _failed
                        error = self._failed("execute", exc)
                    await self._queue.put(_SourceDone("execute", error))
                finally:
                    self._source_ended(body)  # stop() cancels it until here
            # Leaving the block waits for the consumer and the canceller.

    def request_cancel(self) -> bool:
        """Have the executor's ``cancel()`` run inside this run.

        Returns:
            False if the run has ended or is ending (the caller starts a new one).
        """
        if self.finished or self.live.log.closed:
            return False
        if self._cancel_requested:
            return True
        if self._group is not None:
            try:
                self._start_canceller()
            except RuntimeError:  # the group is exiting: its children have all ended
                return False
        self._cancel_requested = True
        return True

    def stop(self) -> None:
        """Cancel every coroutine of the run except the caller (the log closed)."""
        current = asyncio.current_task()
        for task in (*self.sources, self._consumer):
            if task is not None and task is not current and not task.done():
                task.cancel()

    def _start_canceller(self) -> None:
        assert self._group is not None
        task = self._group.create_task(
            self._cancel(),
            name=f"{TASK_PREFIX}:cancel:{self.live.task_id}",
            context=self._run_context,
        )
        self.sources.append(task)
        task.add_done_callback(self._source_ended)

    def _source_ended(self, task: asyncio.Task[None]) -> None:
        if task in self.sources:
            self.sources.remove(task)

    async def _cancel(self) -> None:
        error: BaseException | None = None
        try:
            async with asyncio.timeout(self._cancel_timeout):
                await self._executor.cancel(self._context, self._queue)
        except asyncio.CancelledError:
            raise  # the run is being stopped: never turned into an outcome
        except BaseException as exc:  # even SystemExit: see _failed
            error = self._failed("cancel", exc)
        await self._queue.put(_SourceDone("cancel", error))

    def _failed(self, kind: Literal["execute", "cancel"], exc: BaseException) -> BaseException:
        """Log what the executor's ``kind()`` raised and return it.

        An agent's error, even SystemExit, becomes the task's outcome, never
        the server's.
        """
        logger.warning(
            "executor %s() of task %s raised %s",
            kind,
            self.live.task_id,
            type(exc).__name__,
            exc_info=exc,
        )
        return exc

    def wake_consumer(self) -> None:
        """Start the consumer unless it is running (something was just queued)."""
        consumer = self._consumer
        if (consumer is not None and not consumer.done()) or self._group is None:
            return  # (a consumer cancelled before its first step never clears itself)
        try:
            self._consumer = self._group.create_task(
                self._consume(),
                name=f"{TASK_PREFIX}:consume:{self.live.task_id}",
                context=self._run_context,
            )
        except RuntimeError:
            # The group is shutting down (the run is being stopped, or a fault
            # of ours that run() ends FAILED): nothing more is consumed.
            return

    async def _consume(self) -> None:
        queue = self._queue._queue
        log = self.live.log
        step = 0
        try:
            while not queue.empty() and not log.closed:
                item = queue.get_nowait()
                if isinstance(item, _SourceDone):
                    await self._settle(item)
                    step += 1
                    continue
                batch = [item]
                while (
                    len(batch) < COMMIT_BATCH
                    and not queue.empty()
                    and not isinstance(queue.peek(), _SourceDone)
                ):
                    batch.append(queue.get_nowait())  # type: ignore[arg-type]
                await self._commit(batch)
                step += len(batch)
                if not queue.empty() and self.pacer.due():
                    step = 0
                    await self.pacer.wait()  # (the loop re-checks the queue and the log)
                elif step >= YIELD_EVERY and log.readers and not queue.empty():
                    # Let the streams send what was appended. With no stream at
                    # all the burst goes on in the same step: the producer cannot
                    # queue more meanwhile, so it is bounded by the queue.
                    step = 0
                    await asyncio.sleep(0)
        finally:
            # No await between the last emptiness check and this: whatever is
            # queued after it starts a new consumer (wake_consumer).
            self._consumer = None

    async def _commit(self, events: list[Event]) -> None:
        if self._may_wait is not None:
            asks = next((i for i, event in enumerate(events) if _asks_for_input(event)), None)
            if asks is not None:
                refused = self._may_wait(self.live)
                if refused is not None:
                    # The events before it are the task's; the ask and what follows are
                    # not: the task ends FAILED instead of waiting past a bound.
                    if asks:
                        await self._commit(events[:asks])
                    logger.warning("task %s: %s", self.live.task_id, refused)
                    await self.live.finalize(TaskState.TASK_STATE_FAILED, refused)
                    return
        try:
            await self.live.commit(events)
        except InvalidAgentResponseError as exc:
            logger.warning("task %s: %s", self.live.task_id, exc.message)
            await self.live.finalize(
                TaskState.TASK_STATE_FAILED, f"agent sent an invalid event: {exc.message}"
            )
        except StoreError:
            if self.live.log.closed:  # it ended elsewhere: its streams got that outcome
                logger.warning(
                    "task %s: the journal refused an event: the task had ended elsewhere",
                    self.live.task_id,
                )
                return
            logger.exception("task %s: the journal refused an event", self.live.task_id)
            await self.live.finalize(
                TaskState.TASK_STATE_FAILED, "server could not record the agent's progress"
            )

    async def _settle(self, done: _SourceDone) -> None:
        live = self.live
        if live.log.closed or taskops.is_final_state(live.state):
            return
        if done.kind == "cancel":
            await live.finalize(TaskState.TASK_STATE_CANCELED, "task canceled by request")
        elif done.error is not None:
            await live.finalize(
                TaskState.TASK_STATE_FAILED,
                f"agent failed with {type(done.error).__name__}",
            )
        elif self._cancel_requested:
            return
        elif live.state not in taskops.INTERRUPTED:
            await live.finalize(TaskState.TASK_STATE_FAILED, "agent ended without an outcome")
        elif live.state_seq <= self._start_seq and live.task is not None:
            # Still waiting for input, but this run never said so: its streams
            # (and relays) get the state again, as a status update, and end with it.
            await self._commit([taskops.status_event(live.task, live.state, None)])

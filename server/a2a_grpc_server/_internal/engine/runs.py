"""Runs: the executions of this instance, and which one currently feeds each task.

Each message that starts work (and each cancel of a task nothing runs for)
gets one ``ExecutionSupervisor``, run as an asyncio task kept here until it
ends. ``current(task_id)`` is the run feeding a task now: the engine asks it
to cancel, and refuses a follow-up while it has not finished. When a run
ends with its task waiting for input, the task parks (``ParkingLot``).

Who runs what: ``spawn`` creates the asyncio task; its done callback (on the
event loop, in a fresh context) forgets the run, parks the task and logs a
crash.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

from a2a.server.agent_execution import AgentExecutor, RequestContext

from ..config import ServerConfig
from ..execution.live import LiveTask
from ..execution.pacing import Pacer
from ..execution.parking import ParkedTasksLimitError, ParkingLot
from ..execution.quotas import QuotaExceededError, Quotas
from ..execution.supervisor import ExecutionSupervisor
from ..model import taskops
from ..model.names import TASK_PREFIX
from ..model.scope import principal_of

logger = logging.getLogger(__name__.replace("._internal", ""))


class Runs:
    """The executions of this instance (see the module docstring).

    Args:
        executor: The agent.
        config: Limits (event queue, ``cancel_timeout``, ``loop_slice``).
        parking: Where a task waiting for input parks once its run ended.
        quotas: What a principal may hold, its waiting tasks included.
    """

    def __init__(
        self, executor: AgentExecutor, config: ServerConfig, parking: ParkingLot, quotas: Quotas
    ) -> None:
        self.executor = executor
        """The agent."""
        self._config = config
        self._parking = parking
        self._quotas = quotas
        self.pacer = Pacer(config.loop_slice)
        """Shares the event loop between bursts and everything else (see ``pacing``)."""
        self._runs: dict[asyncio.Task[None], ExecutionSupervisor] = {}
        self._current: dict[str, ExecutionSupervisor] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._runs)

    def current(self, task_id: str) -> ExecutionSupervisor | None:
        """The execution currently feeding ``task_id`` here, if any."""
        return self._current.get(task_id)

    def spawn(
        self,
        live: LiveTask,
        context: RequestContext,
        *,
        execute: bool = True,
        cancel: bool = False,
    ) -> ExecutionSupervisor:
        """Start a run for ``live`` (see ``ExecutionSupervisor`` for ``execute`` and ``cancel``)."""
        run = ExecutionSupervisor(
            live,
            self.executor,
            context,
            self._config.event_queue_size,
            self._config.event_queue_bytes,
            self._config.cancel_timeout,
            pacer=self.pacer,
            execute=execute,
            cancel=cancel,
            may_wait=None if self._parking.durable else self._may_wait,
        )
        self._current[live.task_id] = run
        self._parking.unpark(live.task_id)
        task = asyncio.create_task(run.run(), name=f"{TASK_PREFIX}:run:{live.task_id}")
        self._runs[task] = run
        self._idle.clear()
        task.add_done_callback(self._done, context=contextvars.Context())
        return run

    def _may_wait(self, live: LiveTask) -> str | None:
        """Whether ``live`` may wait for input here (see ``ExecutionSupervisor``).

        With the in-memory journal a waiting task costs memory until it is
        continued, so asking for input is held to the same bounds as a new task
        (``Quotas.check_waiting``); past one, the task ends FAILED instead.
        """
        if self._parking.counts(live.task_id):
            return None  # counted already (asked twice in one run)
        try:
            self._quotas.check_waiting(principal_of(live.scope), self._parking)
        except (QuotaExceededError, ParkedTasksLimitError) as exc:
            return f"no room to wait for input on this server ({exc.reason}): {exc}"
        self._parking.reserve(live)
        return None

    async def wait_idle(self) -> None:
        """Wait until no run is alive."""
        await self._idle.wait()

    async def wait_interrupted(self) -> None:
        """Wait until every run ended (each as soon as its task is final or interrupted)."""
        while self._runs:
            await asyncio.wait(list(self._runs), return_when=asyncio.FIRST_COMPLETED)

    def _done(self, task: asyncio.Task[None]) -> None:
        run = self._runs.pop(task)
        live = run.live
        if self._current.get(live.task_id) is run:
            del self._current[live.task_id]
            if not live.log.closed and live.state in taskops.INTERRUPTED and not live.admitting:
                self._parking.park(live)
        if not task.cancelled() and task.exception() is not None:
            logger.error("run of task %s crashed", run.live.task_id, exc_info=task.exception())
        if not self._runs:
            self._idle.set()

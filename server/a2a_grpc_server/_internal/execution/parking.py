"""ParkingLot: the tasks waiting for input on this instance, and which of them leave memory.

A task is *parked* when its run ended with the task INPUT_REQUIRED or
AUTH_REQUIRED: nothing runs for it until a follow-up message (or a cancel)
comes, which may be never. Parked tasks cost memory (the live task, its log,
its lock) for as long as they wait, so:

* a parked task nobody reads leaves memory after ``parked_timeout`` seconds
  (``evict_idle``, run by a timer every quarter of it): its record stays in
  the journal, and a follow-up, a subscription or a cancel brings it back
  (``TaskEngine`` revives it from the record);
* at most ``max_parked_tasks`` are held. With a durable journal (cluster
  mode) a new task over the cap makes the longest-parked unread task leave
  memory early; with the in-memory journal, where the record itself is
  memory, the new task is refused (``ParkedTasksLimitError``,
  RESOURCE_EXHAUSTED) until some parked task is continued or canceled.
* the bound holds for tasks that start to wait later too: a task counts
  from the moment its executor asks for input (``reserve``, before its run
  ends); with the in-memory journal the engine's ``Runs`` ask
  ``Quotas.check_waiting`` first and end a task past it FAILED; with a
  durable one ``park`` has the longest-parked unread tasks leave memory.

Who runs what: everything here runs on the event loop, synchronously; the
engine's ``Runs`` call ``reserve`` when an executor asks for input, ``park``
when a run ends and ``unpark`` when work
resumes on the task, and its ``LiveTasks`` call ``make_room`` before they
create a task (and ``unpark`` when it ends).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import (  # re-exported: the error tree lives in errors
    ParkedTasksLimitError as ParkedTasksLimitError,
)
from ..model.scope import principal_of

if TYPE_CHECKING:
    from .live import LiveTask

logger = logging.getLogger(__name__.replace("._internal", ""))


class ParkingLot:
    """Parked tasks in the order they parked (see the module docstring).

    Args:
        timeout: Seconds a parked, unread task stays in memory (``parked_timeout``).
        most: Most parked tasks held (``max_parked_tasks``).
        durable: The journal is not in this process's memory: a task that
            leaves memory costs nothing here.
        evict: Takes a task out of memory (its record stays).
        clock: Monotonic clock.
    """

    def __init__(
        self,
        timeout: float,
        most: int,
        *,
        durable: bool,
        evict: Callable[[LiveTask], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._timeout = timeout
        self._most = most
        self._durable = durable
        self._evict = evict
        self._clock = clock
        self._parked: OrderedDict[str, tuple[LiveTask, float]] = OrderedDict()
        self._held: set[str] = set()
        """Parked tasks out of memory whose record is in this process (in-memory journal)."""
        self._principals: dict[str, str] = {}
        """The principal of each task counted in ``count`` (see ``scope``)."""
        self._per_principal: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None
        self.evicted = 0
        """Parked tasks that left memory so far."""

    @property
    def count(self) -> int:
        """Parked tasks this instance holds (in memory, or in its in-memory journal).

        A task that asked for input counts from then on (``reserve``), before
        its run has ended and it parks.
        """
        return len(self._principals)

    def count_of(self, principal: str) -> int:
        """Parked tasks of ``principal`` this instance holds (as ``count``)."""
        return self._per_principal[principal]

    def counts(self, task_id: str) -> bool:
        """Whether the task is counted as parked (or as about to park) here."""
        return task_id in self._principals

    @property
    def holders(self) -> int:
        """Principals with parked tasks here."""
        return len(self._per_principal)

    @property
    def most(self) -> int:
        """``max_parked_tasks``."""
        return self._most

    @property
    def durable(self) -> bool:
        """Whether a parked task can leave memory at no cost (the journal is elsewhere)."""
        return self._durable

    def reserve(self, live: LiveTask) -> bool:
        """Count ``live`` as parked from now on (it asked for input; its run still ends).

        Its run's end parks it, or whatever ends the wait (a follow-up's run, the
        task's end) ``unpark``s it, as for a parked task.

        Returns:
            False if it was counted already.
        """
        if live.task_id in self._principals:
            return False
        principal = principal_of(live.scope)
        self._principals[live.task_id] = principal
        self._per_principal[principal] += 1
        return True

    def park(self, live: LiveTask) -> None:
        """``live`` is waiting for input from now on.

        With a durable journal, while more than ``max_parked_tasks`` are held the
        longest-parked unread tasks leave memory (not this one: it may be coming
        back for a caller; when every other is being read, the cap is exceeded by
        tasks being read, which ``max_streams`` bounds).
        """
        self._held.discard(live.task_id)
        self.reserve(live)
        self._parked[live.task_id] = (live, self._clock())
        self._parked.move_to_end(live.task_id)
        if self._durable and self.count > self._most:
            for waiting, _ in list(self._parked.values()):
                if self.count <= self._most:
                    break
                if waiting is not live:
                    self._leave(waiting)
        self._schedule()

    def unpark(self, task_id: str) -> None:
        """Work resumes on the task (or it ended): it is no longer parked."""
        self._parked.pop(task_id, None)
        self._held.discard(task_id)
        self._uncount(task_id)

    def _uncount(self, task_id: str) -> None:
        principal = self._principals.pop(task_id, None)
        if principal is not None:
            self._per_principal[principal] -= 1
            if not self._per_principal[principal]:
                del self._per_principal[principal]

    def make_room(self) -> None:
        """Before a new task: keep the parked tasks under ``max_parked_tasks``.

        Raises:
            ParkedTasksLimitError: At the limit, and no parked task can leave
                (in-memory journal, or every parked task is being read).
        """
        if self.count < self._most:
            return
        if self._durable:
            for live, _ in list(self._parked.values()):
                if self._leave(live):
                    return
        raise ParkedTasksLimitError(self._most)

    def evict_idle(self, now: float | None = None) -> int:
        """Take out of memory every task parked unread for ``timeout`` s; return how many.

        Args:
            now: The clock's current time (None: read it).
        """
        horizon = (self._clock() if now is None else now) - self._timeout
        left = 0
        for live, since in list(self._parked.values()):
            if since > horizon:
                break
            if live.log.readers:  # read right now: its wait starts again
                self._parked[live.task_id] = (live, horizon + self._timeout)
                self._parked.move_to_end(live.task_id)
                continue
            left += self._leave(live)
        return left

    def close(self) -> None:
        """Stop the timer (the server is shutting down)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _leave(self, live: LiveTask) -> bool:
        if live.log.readers or live.log.closed or live.admitting:
            return False  # read, ended, or a follow-up is being admitted
        self._parked.pop(live.task_id, None)
        if not self._durable:
            self._held.add(live.task_id)
        else:
            self._uncount(live.task_id)
        self.evicted += 1
        self._evict(live)
        return True

    def _schedule(self) -> None:
        if self._timer is None and self._parked:
            period = max(self._timeout / 4, 0.05)
            # (In a context of its own: not the call or run that happened to arm it.)
            self._timer = asyncio.get_running_loop().call_later(
                period, self._tick, context=contextvars.Context()
            )

    def _tick(self) -> None:
        self._timer = None
        self.evict_idle()
        self._schedule()

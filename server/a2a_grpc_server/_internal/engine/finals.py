"""FinalRetries: final states every stream got that the journal has not recorded yet.

A task's log closes with its final frame whether or not the journal could
record the final state (the streams must not wait on a store outage). The
registry hands such a task here when its log closes; one asyncio task per
such task retries recording it, with growing, jittered pauses, until the
journal holds it. Meanwhile this instance keeps the task (its lease says it
is alive, so no survivor ends it): reads of it answer the final state, and
it accepts no subscription, cancel or message.

Who runs what: ``retry`` starts a retrier on the event loop; the engine's
shutdown ``wait``s for them until its deadline and then ``give_up``s.
"""

from __future__ import annotations

import asyncio
import logging
import random

from a2a.types.a2a_pb2 import Task

from ..execution.live import LiveTask
from ..journal import StoreError
from ..model.names import TASK_PREFIX

logger = logging.getLogger(__name__.replace("._internal", ""))

FINAL_RETRY_PAUSE = 0.25
"""Seconds before the first retry of a final state the journal could not record."""
FINAL_RETRY_MAX_PAUSE = 5.0
"""Most seconds between two such retries (each attempt retries for its own budget too)."""


class FinalRetries:
    """The final states being retried (see the module docstring)."""

    def __init__(self) -> None:
        self._unrecorded: dict[str, LiveTask] = {}
        self._retriers: set[asyncio.Task[None]] = set()
        self._all_recorded = asyncio.Event()
        self._all_recorded.set()

    def live(self, task_id: str) -> LiveTask | None:
        """The ended task whose final state is not recorded yet (None: none such)."""
        return self._unrecorded.get(task_id)

    def final(self, task_id: str) -> Task | None:
        """The final task of ``task_id`` if the journal does not hold it yet."""
        live = self._unrecorded.get(task_id)
        return live.log.snapshot if live is not None else None

    def retry(self, live: LiveTask) -> None:
        """Retry recording ``live``'s final state until the journal holds it."""
        self._unrecorded[live.task_id] = live
        self._all_recorded.clear()
        task = asyncio.create_task(
            self._record(live), name=f"{TASK_PREFIX}:record-final:{live.task_id}"
        )
        self._retriers.add(task)
        task.add_done_callback(self._retriers.discard)

    async def wait(self, deadline: float | None) -> None:
        """Wait until every final state is recorded, or until ``deadline`` (loop time)."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._all_recorded.wait()
        except TimeoutError:
            pass

    async def wait_done(self) -> None:
        """Wait until no retrier runs."""
        while self._retriers:
            await asyncio.wait(list(self._retriers))

    def give_up(self) -> None:
        """Stop retrying (shutdown); say which final states are not recorded."""
        for task in list(self._retriers):
            task.cancel()
        if self._unrecorded:
            logger.error(
                "shutting down with %d final state(s) not recorded (tasks %s); in cluster mode "
                "a survivor ends them FAILED",
                len(self._unrecorded),
                ", ".join(list(self._unrecorded)[:10]),
            )

    async def _record(self, live: LiveTask) -> None:
        pause = FINAL_RETRY_PAUSE
        try:
            while True:
                try:
                    await live.record_final()
                    logger.warning("task %s: its final state is recorded now", live.task_id)
                    return
                except StoreError as exc:
                    logger.warning(
                        "task %s: its final state is not recorded yet (%s); retrying",
                        live.task_id,
                        exc,
                    )
                await asyncio.sleep(pause * random.uniform(0.5, 1.0))  # jitter: spread out
                pause = min(pause * 2, FINAL_RETRY_MAX_PAUSE)
        finally:
            self._unrecorded.pop(live.task_id, None)
            if not self._unrecorded:
                self._all_recorded.set()

"""Agents the benchmarks serve (the same code in every server under test).

``Ticker`` understands two messages:

* ``tick <count> <period_ms> <delay_ms>``: WORKING, wait ``delay_ms`` (so the
  benchmark's subscribers can attach), then ``count`` artifact updates, one
  every ``period_ms``, each carrying the wall-clock nanoseconds at which it
  was produced, then COMPLETED;
* ``park``: WORKING, then nothing until canceled; ``cancel()`` emits CANCELED.
"""

from __future__ import annotations

import asyncio
import time

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import Part


class Ticker(AgentExecutor):
    """See the module docstring."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        words = context.get_user_input().split()
        await updater.start_work()
        if words[:1] != ["tick"]:
            await asyncio.Event().wait()  # parked until canceled
        count, period, delay = (int(w) for w in words[1:4])
        await asyncio.sleep(delay / 1000)
        for i in range(count):
            await updater.add_artifact(
                [Part(text=str(time.time_ns()))], artifact_id=f"t{i}", name="tick"
            )
            await asyncio.sleep(period / 1000)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()

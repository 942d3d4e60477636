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

from a2a.helpers.proto_helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import Part, TaskState


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


class Workload(AgentExecutor):
    """The agent of the comparison benchmark (``python -m bench``), by message text:

    * ``unary``: one artifact, COMPLETED (SendMessage answers the task);
    * ``stream``: WORKING, 10 artifact updates, COMPLETED (13 frames with the task);
    * ``fanout <count> <delay_ms>``: WORKING, wait ``delay_ms`` for subscribers,
      ``count`` artifact updates stamped with their production time, COMPLETED;
    * ``park``: WORKING, then nothing until canceled (``cancel()`` emits CANCELED).
    """

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        words = context.get_user_input().split()
        kind = words[0] if words else "unary"
        if context.current_task is None and context.message is not None:
            # The Task first, as a2a-sdk's request handler requires of an agent.
            await event_queue.enqueue_event(
                new_task(
                    context.task_id,
                    context.context_id,
                    TaskState.TASK_STATE_SUBMITTED,
                    history=[context.message],
                )
            )
        if kind == "unary":
            await updater.add_artifact([Part(text=PAYLOAD)], artifact_id="a0")
            await updater.complete()
            return
        await updater.start_work()
        if kind == "stream":
            for i in range(10):
                await updater.add_artifact([Part(text=PAYLOAD)], artifact_id=f"a{i}")
            await updater.complete()
        elif kind == "fanout":
            count, delay = int(words[1]), int(words[2])
            await asyncio.sleep(delay / 1000)
            for i in range(count):
                await updater.add_artifact([Part(text=str(time.time_ns()))], artifact_id=f"f{i}")
            await updater.complete()
        else:
            await asyncio.Event().wait()  # parked until canceled

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


PAYLOAD = "x" * 100
"""The text of every artifact the workload produces (raw's canned frames use the same)."""

"""Countdown agent: streams one progress artifact per tick, and can be cancelled.

Send it a number (default 10); it counts down to zero, one tick every
``COUNTDOWN_TICK`` seconds (default 0.5), then completes. CancelTask stops it
at once with CANCELED on every stream.

Run it: ``a2a-grpc-server serve --agent examples.countdown_agent:CountdownAgent``
"""

from __future__ import annotations

import asyncio
import os

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import AgentCapabilities, AgentCard, AgentSkill, Part

MAX_COUNT = 1000


def agent_card() -> AgentCard:
    """The card ``serve`` publishes."""
    return AgentCard(
        name="Countdown",
        description="Counts down from the number it is sent, streaming each step.",
        version="1.0.0",
        capabilities=AgentCapabilities(streaming=True),  # push: the server says (serve --push)
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[
            AgentSkill(id="countdown", name="Countdown", description="Streams N..0.", tags=["demo"])
        ],
    )


class CountdownAgent(AgentExecutor):
    """Counts down, one artifact update per tick.

    Args:
        tick: Seconds between steps (default: ``COUNTDOWN_TICK`` or 0.5).
    """

    def __init__(self, tick: float | None = None) -> None:
        self.tick = tick if tick is not None else float(os.environ.get("COUNTDOWN_TICK", "0.5"))

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Count down from the number in the message."""
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        text = context.get_user_input().strip()
        start = int(text) if text.isdigit() else 10
        if start > MAX_COUNT:
            await updater.reject(updater.new_agent_message([Part(text=f"at most {MAX_COUNT}")]))
            return
        await updater.start_work()
        for n in range(start, -1, -1):
            await updater.add_artifact(
                [Part(text=str(n))], artifact_id="countdown", append=n != start
            )
            if n:
                await asyncio.sleep(self.tick)
        await updater.complete(updater.new_agent_message([Part(text="liftoff")]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Stop counting: the server cancels ``execute``; this reports CANCELED."""
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.cancel(updater.new_agent_message([Part(text="countdown aborted")]))

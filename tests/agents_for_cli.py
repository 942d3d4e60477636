"""Agent references in every shape ``serve --agent`` accepts (used by test_cli)."""

from __future__ import annotations

import asyncio

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import Part

from a2a_grpc_server.agents.echo import EchoAgent

instance = EchoAgent()


def factory() -> EchoAgent:
    """A zero-argument factory."""
    return EchoAgent()


not_an_agent = 42


class Hanging(AgentExecutor):
    """Emits WORKING and then works forever (until its process dies); cancel is a no-op."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).start_work()
        await asyncio.Event().wait()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


class Ticking(AgentExecutor):
    """Keeps working through whatever happens: WORKING, then an artifact every period.

    The user message's text says how long: ``"<count> <period>"`` (default
    ``"40 0.1"``): ``count`` artifacts, ``period`` seconds apart, then COMPLETED.
    With ``"ask <count> <period>"`` it asks for input after the artifacts
    (INPUT_REQUIRED); the follow-up's text says the same of the second half,
    which then completes. ``cancel()`` is cooperative (CANCELED). The hardest
    agent for a fault: its next event always meets whatever the fault left.
    """

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        words = (context.get_user_input() or "").split()
        ask = bool(words) and words[0] == "ask"
        words = words[1:] if ask else words
        count = int(words[0]) if words and words[0].isdigit() else 40
        period = float(words[1]) if len(words) > 1 else 0.1
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        for i in range(count):
            await asyncio.sleep(period)  # sync-ok: the agent's pace is its work
            await updater.add_artifact([Part(text=f"tick {i}")], artifact_id=f"tick-{i}")
        if ask:
            await updater.requires_input()
        else:
            await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()

"""Agent references in every shape ``serve --agent`` accepts (used by test_cli)."""

from __future__ import annotations

import asyncio

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater

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

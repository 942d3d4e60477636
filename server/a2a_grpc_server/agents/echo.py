"""The echo agent (the default of ``serve``): answers every message with its text."""

from __future__ import annotations

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import AgentCapabilities, AgentCard, AgentSkill, Part

__all__ = ["EchoAgent", "agent_card"]


def agent_card() -> AgentCard:
    """The card ``serve`` publishes (it fills in the gRPC endpoint)."""
    return AgentCard(
        name="Echo",
        description="Answers with the text it was sent.",
        version="1.0.0",
        capabilities=AgentCapabilities(streaming=True),  # push: the server says (serve --push)
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="Echo", description="Echoes text.", tags=["echo"])],
    )


class EchoAgent(AgentExecutor):
    """Echoes the user's text back as an artifact, then completes the task."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Emit WORKING, one artifact with the echoed text, then COMPLETED."""
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        text = context.get_user_input()
        await updater.add_artifact([Part(text=text)], name="echo")
        await updater.complete(updater.new_agent_message([Part(text=text)]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Echo finishes at once; a cancel simply confirms it."""
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()

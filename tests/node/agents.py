"""The agent the Node.js client suite (``tests/node``) serves, driven by message text.

A test in another process cannot set an agent's events, so this agent takes its cues
from messages: a task waits at its gate until a later message names it. Nothing here
waits on time.
"""

from __future__ import annotations

import asyncio

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import Message, Part, Role


class Scripted(AgentExecutor):
    """Does what its message's first word says; a held task waits for its release.

    * ``complete``: WORKING, one artifact, COMPLETED.
    * ``hold``: WORKING, then waits for its release; then one artifact and COMPLETED.
    * ``crash``: WORKING, then waits for its release; then raises (the server ends it FAILED).
    * ``release <task id>``: releases that task (before or after it reached its gate) and
      answers with a Message: no task is created.

    ``cancel()`` is cooperative: it emits CANCELED.
    """

    def __init__(self) -> None:
        self._gates: dict[str, asyncio.Event] = {}

    def _gate(self, task_id: str) -> asyncio.Event:
        return self._gates.setdefault(task_id, asyncio.Event())

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        words = context.get_user_input().split()
        if words[:1] == ["release"] and len(words) == 2:
            self._gate(words[1]).set()
            await event_queue.enqueue_event(
                Message(
                    message_id=f"released-{words[1]}",
                    role=Role.ROLE_AGENT,
                    context_id=context.context_id or "",
                    parts=[Part(text=f"released {words[1]}")],
                )
            )
            return
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        if words[:1] in (["hold"], ["crash"]):
            try:
                await self._gate(context.task_id).wait()
            finally:
                self._gates.pop(context.task_id, None)
            if words[0] == "crash":
                raise RuntimeError("scripted crash")
        await updater.add_artifact([Part(text="result")], artifact_id="result")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()

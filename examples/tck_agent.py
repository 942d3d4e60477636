"""The agent the A2A conformance kit (a2a-tck) expects, keyed by message-id prefix.

Run it, then point the kit at the card's HTTP address::

    a2a-grpc-server serve --agent examples.tck_agent:TckAgent --port 9998 --http-port 9999
    ./run_tck.py --sut-host http://127.0.0.1:9999 --transport grpc
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import AgentCapabilities, AgentCard, AgentProvider, AgentSkill, Part
from google.protobuf import struct_pb2

RESUBSCRIBE_WORK_SECONDS = 4.0
"""How long the resubscription scenario stays WORKING (the kit waits 2x its 2 s timeout)."""
DELAYED_COMPLETE_SECONDS = 2.0
"""How long tck-delayed-complete works before it completes (the kit's SUT waits 2 s)."""

Step = Callable[[TaskUpdater, EventQueue], Awaitable[None]]


def agent_card() -> AgentCard:
    """The card the kit reads: streaming, no push notifications."""
    return AgentCard(
        name="a2a-grpc-server TCK agent",
        description="Behaves as the A2A conformance kit's scenarios expect.",
        version="1.0.0",
        provider=AgentProvider(organization="a2a-grpc-server", url="https://example.invalid"),
        capabilities=AgentCapabilities(streaming=True),  # push: the server says (serve --push)
        # The scenarios route on the message id, whatever the parts hold.
        default_input_modes=["*/*"],
        default_output_modes=["text/plain"],
        skills=[
            AgentSkill(id="tck", name="TCK", description="Conformance scenarios.", tags=["tck"])
        ],
    )


async def _complete_with_hello(u: TaskUpdater, q: EventQueue) -> None:
    await u.complete(u.new_agent_message([Part(text="Hello from TCK")]))


def _artifact_then_complete(*parts: Part, working: bool) -> Step:
    async def step(u: TaskUpdater, q: EventQueue) -> None:
        if working:
            await u.start_work()
        await u.add_artifact(list(parts))
        await u.complete()

    return step


async def _chunked(u: TaskUpdater, q: EventQueue) -> None:
    await u.start_work()
    await u.add_artifact([Part(text="chunk-1 ")], artifact_id="chunked")
    await u.add_artifact(
        [Part(text="chunk-2")], artifact_id="chunked", append=True, last_chunk=True
    )
    await u.complete()


async def _message(u: TaskUpdater, q: EventQueue) -> None:
    await q.enqueue_event(u.new_agent_message([Part(text="Direct message response")]))


async def _input_required(u: TaskUpdater, q: EventQueue) -> None:
    await u.requires_input(u.new_agent_message([Part(text="more input, please")]))


async def _reject(u: TaskUpdater, q: EventQueue) -> None:
    await u.reject(u.new_agent_message([Part(text="rejected")]))


async def _long_running(u: TaskUpdater, q: EventQueue) -> None:
    await u.start_work()
    await asyncio.sleep(RESUBSCRIBE_WORK_SECONDS)
    await u.complete()


async def _complete_only(u: TaskUpdater, q: EventQueue) -> None:
    await u.complete()


async def _delayed_complete(u: TaskUpdater, q: EventQueue) -> None:
    # The kit's execution-mode scenarios (a2a-tck PR #217): a blocking SendMessage must
    # answer terminal, a returnImmediately one must not.
    await u.start_work()
    await asyncio.sleep(DELAYED_COMPLETE_SECONDS)
    await u.complete(u.new_agent_message([Part(text="Done after delay")]))


async def _auth_required(u: TaskUpdater, q: EventQueue) -> None:
    # The kit's AUTH_REQUIRED scenarios (a2a-tck PR #212): the task waits for credentials.
    await u.requires_auth()


def _data() -> Part:
    value = struct_pb2.Value()
    value.struct_value.update({"key": "value", "count": 42})
    return Part(data=value)


_FILE = Part(raw=b"tck", media_type="text/plain", filename="output.txt")
_FILE_URL = Part(
    url="https://example.com/output.txt", media_type="text/plain", filename="output.txt"
)

# Longest prefixes first: "tck-artifact-file-url" must win over "tck-artifact-file".
SCENARIOS: list[tuple[str, Step]] = sorted(
    [
        ("tck-complete-task", _complete_with_hello),
        (
            "tck-artifact-text",
            _artifact_then_complete(Part(text="Generated text content"), working=False),
        ),
        ("tck-artifact-file-url", _artifact_then_complete(_FILE_URL, working=False)),
        ("tck-artifact-file", _artifact_then_complete(_FILE, working=False)),
        ("tck-artifact-data", _artifact_then_complete(_data(), working=False)),
        ("tck-message-response", _message),
        ("tck-input-required", _input_required),
        ("tck-reject-task", _reject),
        (
            "tck-stream-001",
            _artifact_then_complete(Part(text="Stream hello from TCK"), working=True),
        ),
        ("tck-stream-002", _complete_only),
        (
            "tck-stream-003",
            _artifact_then_complete(Part(text="Stream task lifecycle"), working=True),
        ),
        (
            "tck-stream-ordering-001",
            _artifact_then_complete(Part(text="Ordered output"), working=True),
        ),
        (
            "tck-stream-artifact-text",
            _artifact_then_complete(Part(text="Streamed text content"), working=True),
        ),
        ("tck-stream-artifact-file", _artifact_then_complete(_FILE, working=True)),
        ("tck-stream-artifact-chunked", _chunked),
        ("test-resubscribe-message-id", _long_running),
        ("tck-delayed-complete", _delayed_complete),
        ("tck-auth-required", _auth_required),
    ],
    key=lambda item: -len(item[0]),
)


class TckAgent(AgentExecutor):
    """Routes on the message id's prefix; anything else completes with an echo."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Play the scenario the message id names."""
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        message_id = context.message.message_id if context.message is not None else ""
        for prefix, step in SCENARIOS:
            if message_id.startswith(prefix):
                await step(updater, event_queue)
                return
        await updater.complete(
            updater.new_agent_message([Part(text=f"Unhandled messageId prefix: {message_id}")])
        )

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Confirm the cancel."""
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()

"""Every executor the tests share: each plays one row of the outcome table, on cue, or
one way an agent behaves (the agents ``serve --agent`` is given in subprocess tests are
here too, in every shape it accepts: ``tests.support.agents:Hanging``)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Literal

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import (
    Message,
    Part,
    Role,
    Task,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)

from a2a_grpc_server.agents.echo import EchoAgent

CancelMode = Literal["cooperative", "noop", "raises", "hangs"]


def _updater(context: RequestContext, queue: EventQueue) -> TaskUpdater:
    assert context.task_id is not None and context.context_id is not None
    return TaskUpdater(queue, context.task_id, context.context_id)


class GatedAgent(AgentExecutor):
    """Emits WORKING, waits for ``release``, then one artifact and COMPLETED.

    Its ``cancel()`` behaves as ``cancel_mode`` says. ``working`` is set once
    WORKING has been enqueued; ``cancel_called`` once ``cancel()`` runs;
    ``execute_cancelled`` once ``execute()`` saw its cancellation.
    """

    def __init__(self, cancel_mode: CancelMode = "cooperative") -> None:
        self.cancel_mode = cancel_mode
        self.release = asyncio.Event()
        self.working = asyncio.Event()
        self.cancel_called = asyncio.Event()
        self.execute_cancelled = asyncio.Event()
        self.finish_state: TaskState = TaskState.TASK_STATE_COMPLETED

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.start_work()
        self.working.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.execute_cancelled.set()
            raise
        await updater.add_artifact([Part(text="result")], artifact_id="a1")
        await updater.update_status(self.finish_state)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.cancel_called.set()
        if self.cancel_mode == "cooperative":
            await _updater(context, event_queue).cancel()
        elif self.cancel_mode == "raises":
            raise RuntimeError("cancel exploded")
        elif self.cancel_mode == "hangs":
            await asyncio.Event().wait()


class EndingAgent(AgentExecutor):
    """Emits WORKING, waits for ``release``, then ends without an outcome.

    With ``crash`` it raises (with a secret in the text); without, it returns.
    """

    def __init__(self, *, crash: bool) -> None:
        self.crash = crash
        self.release = asyncio.Event()
        self.working = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).start_work()
        self.working.set()
        await self.release.wait()
        if self.crash:
            raise ValueError("db password is hunter2")

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class StubbornAgent(AgentExecutor):
    """Ignores cancellation: keeps emitting WORKING and COMPLETED after being cancelled."""

    def __init__(self) -> None:
        self.working = asyncio.Event()
        self.emitted_late = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.start_work()
        self.working.set()
        with contextlib.suppress(asyncio.CancelledError):  # misbehaves on purpose
            await asyncio.Event().wait()
        for _ in range(3):
            await event_queue.enqueue_event(_status(context, TaskState.TASK_STATE_WORKING))
        self.emitted_late.set()
        await event_queue.enqueue_event(_status(context, TaskState.TASK_STATE_COMPLETED))
        await asyncio.Event().wait()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


class MessageAgent(AgentExecutor):
    """Answers with a single Message: no task is created."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        await event_queue.enqueue_event(
            Message(
                message_id="answer-1",
                role=Role.ROLE_AGENT,
                context_id=context.context_id or "",
                parts=[Part(text=f"you said {context.get_user_input()}")],
            )
        )

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


class TaskFirstAgent(AgentExecutor):
    """Enqueues the Task object first (with or without the user's message), then completes it."""

    def __init__(self, *, with_history: bool = True) -> None:
        self.with_history = with_history

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        task = Task(
            id=context.task_id,
            context_id=context.context_id,
            status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED),
        )
        if context.message is not None and self.with_history:
            task.history.append(context.message)
        await event_queue.enqueue_event(task)
        updater = _updater(context, event_queue)
        await updater.add_artifact([Part(text="done")], artifact_id="x")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class InputAgent(AgentExecutor):
    """Asks for input (or auth) on the first message; completes on the follow-up.

    With ``pad``, it first adds an artifact of that many bytes.
    """

    def __init__(self, ask: TaskState = TaskState.TASK_STATE_INPUT_REQUIRED, pad: int = 0) -> None:
        self.ask, self.pad = ask, pad

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        if context.current_task is None:
            await updater.start_work()
            if self.pad:
                await updater.add_artifact([Part(text="p" * self.pad)], artifact_id="pad")
            await updater.update_status(
                self.ask, updater.new_agent_message([Part(text="your name?")])
            )
            return
        await updater.start_work()
        await updater.complete(
            updater.new_agent_message([Part(text=f"hello {context.get_user_input()}")])
        )

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class HeldFollowUpAgent(AgentExecutor):
    """Asks for input; completes on the follow-up after a WORKING and an artifact.

    A follow-up whose text is ``held`` first sets ``holding``, then waits for
    ``go``: its run is live (its message recorded) but has emitted nothing yet,
    as an owner's run is while the instance is paused.
    """

    def __init__(self) -> None:
        self.holding = asyncio.Event()
        self.go = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        if context.current_task is None:
            await updater.requires_input(updater.new_agent_message([Part(text="your name?")]))
            return
        text = context.get_user_input()
        if text == "held":
            self.holding.set()
            await self.go.wait()
        await updater.start_work()
        await updater.add_artifact([Part(text=f"for {text}")], artifact_id="a")
        await updater.complete(updater.new_agent_message([Part(text=f"hello {text}")]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class FloodAgent(AgentExecutor):
    """Emits ``count`` artifact updates of ``size`` bytes once released, then completes.

    Each update first takes a credit from ``credits``: the test hands credits
    back as its reading streams receive frames, so the agent runs as fast as
    healthy readers read, and no faster.
    """

    def __init__(self, count: int, size: int, window: int) -> None:
        self.count, self.size = count, size
        self.release = asyncio.Event()
        self.credits = asyncio.Semaphore(window)

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.start_work()
        await self.release.wait()
        payload = "x" * self.size
        for i in range(self.count):
            await self.credits.acquire()
            await updater.add_artifact([Part(text=payload)], artifact_id=f"chunk-{i}")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


def _status(context: RequestContext, state: TaskState) -> TaskStatusUpdateEvent:
    return TaskStatusUpdateEvent(
        task_id=context.task_id or "",
        context_id=context.context_id or "",
        status=TaskStatus(state=state),
    )


class MisbehavingAgent(AgentExecutor):
    """Emits WORKING, waits for ``release``, then does ``how``: enqueue something that is
    not an A2A event, call ``sys.exit``, or append to an artifact it never created."""

    def __init__(self, how: Literal["garbage", "exit", "bad-append"]) -> None:
        self.how = how
        self.release = asyncio.Event()
        self.working = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.start_work()
        self.working.set()
        await self.release.wait()
        if self.how == "garbage":
            await event_queue.enqueue_event("not an event")  # type: ignore[arg-type]
        elif self.how == "exit":
            sys.exit(3)
        else:
            await updater.add_artifact([Part(text="x")], artifact_id="never-made", append=True)
        await asyncio.Event().wait()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class LeakyAgent(AgentExecutor):
    """Asks for input and returns, leaving a background task that keeps emitting."""

    def __init__(self) -> None:
        self.leaked_emitted = asyncio.Event()
        self.release = asyncio.Event()
        self.background: set[asyncio.Task[None]] = set()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.requires_input()

        async def keep_emitting() -> None:
            await self.release.wait()
            await event_queue.enqueue_event(_status(context, TaskState.TASK_STATE_COMPLETED))
            self.leaked_emitted.set()

        task = asyncio.create_task(keep_emitting())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class CallerAgent(AgentExecutor):
    """Records what it sees of each call (headers, extensions, tenant); asks for
    input on a new task, completes on the follow-up."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], set[str], str, bool]] = []

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        call = context.call_context
        self.seen.append(
            (
                dict(call.state["headers"]),
                set(context.requested_extensions),
                context.tenant,
                call is context.call_context,
            )
        )
        updater = _updater(context, event_queue)
        if context.current_task is None:
            await updater.requires_input()
        else:
            await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class BurstAgent(AgentExecutor):
    """Emits WORKING, waits for ``release``, then ``count`` artifact updates of ``size``
    bytes at once (as fast as the consumer takes them), then COMPLETED."""

    def __init__(self, count: int, size: int = 16) -> None:
        self.count, self.size = count, size
        self.release = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.start_work()
        await self.release.wait()
        payload = "x" * self.size
        for i in range(self.count):
            await updater.add_artifact([Part(text=payload)], artifact_id=f"chunk-{i}")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class ChunkAgent(AgentExecutor):
    """Emits WORKING, waits for ``release``, then appends ``count`` chunks to one
    artifact (``append: true``), then waits for ``finish`` and completes: a
    duplicated frame shows as a longer artifact."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.release = asyncio.Event()
        self.finish = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.start_work()
        await self.release.wait()
        await updater.add_artifact([Part(text="start;")], artifact_id="doc")
        for i in range(self.count):
            await updater.add_artifact([Part(text=f"{i};")], artifact_id="doc", append=True)
        await self.finish.wait()
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class StepAgent(AgentExecutor):
    """Emits WORKING, then one artifact update per ``step()`` of the test, and COMPLETED
    on ``finish()``: the test decides where every frame falls."""

    def __init__(self) -> None:
        self._steps: asyncio.Queue[bool] = asyncio.Queue()
        self.working = asyncio.Event()

    def step(self, count: int = 1) -> None:
        """Have the agent emit ``count`` more artifact updates."""
        for _ in range(count):
            self._steps.put_nowait(True)

    def finish(self) -> None:
        """Have the agent complete the task (after the steps already asked for)."""
        self._steps.put_nowait(False)

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.start_work()
        self.working.set()
        i = 0
        while await self._steps.get():
            await updater.add_artifact([Part(text=str(i))], artifact_id=f"step-{i}")
            i += 1
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class PayloadAgent(AgentExecutor):
    """Emits artifacts as its message's text says: ``"<add|replace> <bytes> <count>"``.

    ``add``: ``count`` artifacts of ``bytes`` each; ``replace``: one artifact
    replaced ``count`` times (``append: false``, the same id). Then COMPLETED.
    """

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        mode, size, count = context.get_user_input().split()
        await updater.start_work()
        for i in range(int(count)):
            artifact_id = "doc" if mode == "replace" else f"part-{i}"
            payload = f"{i:08d}" + "x" * (int(size) - 8)
            await updater.add_artifact([Part(text=payload)], artifact_id=artifact_id)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class GatedPerTask(AgentExecutor):
    """Emits WORKING, then waits for its task's gate; on release one artifact and COMPLETED.

    ``working(task_id)`` is set once WORKING is enqueued. ``cancel()`` is
    cooperative (emits CANCELED) or a no-op, as ``cooperative`` says.
    With ``crash`` the executor raises instead of completing.
    """

    def __init__(self, *, cooperative: bool = True, crash: bool = False) -> None:
        self.cooperative = cooperative
        self.crash = crash
        self._working: dict[str, asyncio.Event] = {}
        self._release: dict[str, asyncio.Event] = {}

    def working(self, task_id: str) -> asyncio.Event:
        """Set once the task's WORKING was enqueued."""
        return self._working.setdefault(task_id, asyncio.Event())

    def release(self, task_id: str) -> None:
        """Let the task finish."""
        self._release.setdefault(task_id, asyncio.Event()).set()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        self.working(context.task_id).set()
        await self._release.setdefault(context.task_id, asyncio.Event()).wait()
        if self.crash:
            raise RuntimeError("executor crashed")
        await updater.add_artifact([Part(text="result")], artifact_id="a1")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        if self.cooperative:
            await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


class AskWhenReleased(AgentExecutor):
    """Emits WORKING, waits until the test releases the message's text, then asks for input;
    completes on the follow-up. The test decides when each task starts to wait."""

    def __init__(self) -> None:
        self._working: dict[str, asyncio.Event] = {}
        self._release: dict[str, asyncio.Event] = {}

    def working(self, text: str) -> asyncio.Event:
        """Set once the task started by the message ``text`` is WORKING."""
        return self._working.setdefault(text, asyncio.Event())

    def release(self, text: str) -> None:
        """Let the task started by ``text`` ask for input."""
        self._release.setdefault(text, asyncio.Event()).set()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = _updater(context, event_queue)
        await updater.start_work()
        if context.current_task is not None:  # the follow-up
            await updater.complete()
            return
        text = context.get_user_input()
        self.working(text).set()
        await self._release.setdefault(text, asyncio.Event()).wait()
        await updater.requires_input(updater.new_agent_message([Part(text="your name?")]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()


class WhoAgent(AgentExecutor):
    """Completes each task; records who the call context says is calling."""

    def __init__(self) -> None:
        self.users: list[tuple[str, bool]] = []

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        user = context.call_context.user
        self.users.append((user.user_name, user.is_authenticated))
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


# What ``serve --agent`` accepts (test_cli): an instance, a factory, a class; and not an agent.

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


class CountingAgent(AgentExecutor):
    """Counts its runs: WORKING, then waits for ``gate``, then COMPLETED with one artifact.

    ``runs`` lists the message id of each run; ``started`` is set at each
    run's WORKING (clear it to wait for the next).
    """

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        self.runs.append(context.message.message_id)
        updater = _updater(context, event_queue)
        await updater.start_work()
        self.started.set()
        await self.gate.wait()
        await updater.add_artifact([Part(text="done")], artifact_id="a1")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await _updater(context, event_queue).cancel()

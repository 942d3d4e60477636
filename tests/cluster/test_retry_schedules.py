"""Safe retries over seeded schedules, on a real nats-server and two instances: a new task's
message sent, maybe cut by its client at some point, and retried through the other
instance, one attempt after another or all at once, blocking or streaming, while its agent
is quick, slow or silent for a while. Each message runs once and every answer is its task
(``rpc.idempotency``)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import SendMessageRequest, TaskState

from tests.support.clusterharness import Instance, instances
from tests.support.harness import KEYED, copy, send_request

S = TaskState


class Paced(AgentExecutor):
    """Silent for the seconds its message's text says, then WORKING and COMPLETED.

    ``by_message`` counts its runs per message id.
    """

    def __init__(self) -> None:
        self.by_message: dict[str, int] = {}

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        assert context.task_id is not None and context.context_id is not None
        ident = context.message.message_id
        self.by_message[ident] = self.by_message.get(ident, 0) + 1
        await asyncio.sleep(float(context.get_user_input()))  # sync-ok: the agent's own pace
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


async def attempt(
    instance: Instance, request: SendMessageRequest, streaming: bool, cut_after: float | None
) -> str | None:
    """One attempt: the task id it was answered (None: cut by its client first)."""
    call = (
        instance.stub.SendStreamingMessage(copy(request), metadata=KEYED)
        if streaming
        else instance.stub.SendMessage(copy(request), metadata=KEYED)
    )
    if cut_after is not None:
        try:
            async with asyncio.timeout(cut_after):
                await (call.read() if streaming else call)  # type: ignore[union-attr]
        except TimeoutError:
            call.cancel()  # its connection broke
            return None
        call.cancel()
        return None
    if not streaming:
        task = (await call).task  # type: ignore[misc]
        assert task.status.state == S.TASK_STATE_COMPLETED
        return str(task.id)
    frames = [frame async for frame in call]  # type: ignore[union-attr]
    assert frames[-1].WhichOneof("payload") in ("task", "status_update")
    ids = {f.task.id if f.HasField("task") else f.status_update.task_id for f in frames}
    assert len(ids) == 1, ids
    return str(ids.pop())


async def test_sends_cut_and_retried_run_each_message_once_over_seeded_schedules(
    nats_url: str,
) -> None:
    """The promise under many interleavings: a new task's message sent, maybe cut, and
    retried through the other instance or all at once, blocking or streaming, its agent
    quick, slow or silent for a while: each runs once, every answer is its task."""
    agent = Paced()
    async with asyncio.timeout(90), instances(agent, [nats_url]) as (a, b):
        answered: dict[str, set[str]] = {}
        for seed in range(6):
            rng = random.Random(seed)
            schedules = []
            for _ in range(8):
                pace = rng.choice([0.0, 0.0, 0.005, 0.05, 1.2])
                request = send_request(f"{pace}")
                first, other = rng.sample([a, b], 2)
                cut = rng.choice([None, 0.0, 0.01, 0.1])
                tries = [(first, rng.random() < 0.5, cut)]
                tries += [(other, rng.random() < 0.5, None) for _ in range(rng.randint(1, 2))]
                schedules.append((request, tries, rng.random() < 0.5))

            async def run(request: SendMessageRequest, tries: list[Any], together: bool) -> None:
                ident = request.message.message_id
                got = answered.setdefault(ident, set())
                if together:  # every attempt at once
                    found = await asyncio.gather(*(attempt(i, request, s, c) for i, s, c in tries))
                else:  # one after another
                    found = [await attempt(i, request, s, c) for i, s, c in tries]
                got.update(f for f in found if f is not None)

            await asyncio.gather(*(run(*s) for s in schedules))
        assert answered and all(len(ids) == 1 for ids in answered.values()), answered
        assert agent.by_message == {ident: 1 for ident in answered}, "each message ran once"

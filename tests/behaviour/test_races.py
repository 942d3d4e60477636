"""Endings racing subscriptions: whatever the interleaving, every stream ends with the outcome."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import pytest
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import TaskNotCancelableError, UnsupportedOperationError

from a2a_grpc_server import ServerConfig
from tests.support.agents import GatedAgent
from tests.support.harness import Harness, send_request, serve

S = TaskState
ENDINGS = ["complete", "cancel-cooperative", "cancel-noop", "cancel-raises"]


async def watch(h: Harness, task_id: str) -> list[StreamResponse] | None:
    """Subscribe and read to the end; None if the task had already ended."""
    try:
        return [f async for f in h.client.subscribe(SubscribeToTaskRequest(id=task_id))]
    except UnsupportedOperationError:
        return None


async def read(stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
    return [f async for f in stream]


async def one_round(h: Harness, agent: GatedAgent, rng: random.Random, ending: str) -> None:
    sender = h.client.send_message_streaming(send_request("go"))
    task_id = (await anext(sender)).task.id
    sender_rest = asyncio.ensure_future(read(sender))
    watchers = [asyncio.ensure_future(watch(h, task_id)) for _ in range(rng.randint(0, 3))]
    for _ in range(rng.randint(0, 3)):
        await asyncio.sleep(0)  # sync-ok: yields a random number of loop turns to vary the race
    if ending == "complete":
        agent.release.set()
    else:
        with contextlib.suppress(TaskNotCancelableError):  # it may have ended first
            await h.client.cancel_task(CancelTaskRequest(id=task_id))
    late = [asyncio.ensure_future(watch(h, task_id)) for _ in range(rng.randint(0, 2))]
    sender_frames = await sender_rest  # ends with the task, so the store is final now
    stored = (await h.client.get_task(GetTaskRequest(id=task_id))).status.state
    assert stored in (S.TASK_STATE_COMPLETED, S.TASK_STATE_CANCELED)
    streams = [sender_frames, *[await w for w in (*watchers, *late)]]
    for frames in streams:
        if frames is None:
            continue  # subscribed after the end: refused, which is the contract
        assert frames, "a stream closed without any frame"
        last = frames[-1]
        assert last.WhichOneof("payload") == "status_update", last
        assert last.status_update.status.state == stored


@pytest.mark.parametrize("seed", range(5))
async def test_every_stream_ends_with_the_stored_outcome_whatever_the_interleaving(
    seed: int,
) -> None:
    rng = random.Random(seed)
    async with asyncio.timeout(30):
        for _ in range(10):
            ending = rng.choice(ENDINGS)
            mode = ending.removeprefix("cancel-") if ending != "complete" else "cooperative"
            agent = GatedAgent(cancel_mode=mode)  # type: ignore[arg-type]
            async with serve(agent, ServerConfig(cancel_timeout=0.5)) as h:
                await one_round(h, agent, rng, ending)

"""A new task's claim reserves its id (``journal.keys``), on a real nats-server.

The claim is the key's only write; a retry that finds the reservation before its task
exists waits for it, runs if the first request let the key go, and takes the key over if
the task never came; while an instance that does not read reservations is in the cluster,
claims are pending records settled once the run started, as before; and over seeded
schedules of sends, cuts and retries each message runs once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import SendMessageRequest, TaskState
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from a2a_grpc_server.jetstream import formats
from a2a_grpc_server.jetstream.conn import KEYS_BUCKET
from a2a_grpc_server.jetstream.formats import FEATURES, RESERVED_KEYS
from a2a_grpc_server.jetstream.keys import JetStreamSentKeys
from a2a_grpc_server.jetstream.retry import Retry
from a2a_grpc_server.journal.keys import PENDING_FOR, KeyRecord
from a2a_grpc_server.model.scope import scope_key
from a2a_grpc_server.rpc.idempotency import CONFIRM_AFTER, body_digest, stored_key
from tests.support.clusterharness import Instance, instances
from tests.support.harness import V1, send_request

S = TaskState
WINDOW = 86_400.0
"""The instances' ``idempotency_window`` (the default): the bucket's max age."""


class QuietFirst(AgentExecutor):
    """Says nothing until ``gate`` (its task does not exist before), then COMPLETED.

    ``runs`` lists the task id of each run, ``by_message`` counts runs per message id;
    ``running`` is set when a run began.
    """

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.by_message: dict[str, int] = {}
        self.running = asyncio.Event()
        self.gate = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        assert context.task_id is not None and context.context_id is not None
        ident = context.message.message_id
        self.runs.append(context.task_id)
        self.by_message[ident] = self.by_message.get(ident, 0) + 1
        self.running.set()
        await self.silence(context)
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        await updater.complete()

    async def silence(self, context: RequestContext) -> None:
        """What the run does before its first event."""
        await self.gate.wait()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def copy(request: SendMessageRequest) -> SendMessageRequest:
    again = SendMessageRequest()
    again.CopyFrom(request)
    return again


def key_for(request: SendMessageRequest) -> str:
    """The key an anonymous caller's request is kept under (by its message id)."""
    return stored_key(scope_key("", ""), "message.message_id", request.message.message_id)


class KeyWrites:
    """Every write to one key of ``A2A_KEYS`` as a subscriber to its subject sees it (a
    compare-and-set JetStream refuses included); a delete is None."""

    def __init__(self, nc: Client, sub: Subscription) -> None:
        self._nc, self._sub = nc, sub

    async def next(self) -> KeyRecord | None:
        msg = await self._sub.next_msg(timeout=10)
        return KeyRecord.decode(msg.data) if msg.data else None

    async def rest(self) -> list[KeyRecord | None]:
        """The writes seen so far (a round trip to the server first: none is on its way)."""
        await self._nc.flush()
        return [await self.next() for _ in range(self._sub.pending_msgs)]


@contextlib.asynccontextmanager
async def key_writes(nats_url: str, key: str) -> AsyncIterator[KeyWrites]:
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(f"$KV.{KEYS_BUCKET}.{key}")
        await nc.flush()
        yield KeyWrites(nc, sub)
    finally:
        await nc.close()


async def retries_waiting(writes: KeyWrites, first: KeyRecord) -> None:
    """Until a retry claimed the key, found ``first``'s reservation and no task, and
    claimed it again (its claims: two writes each, both refused)."""
    claims = 0
    while claims < 3:
        seen = await writes.next()
        if seen is not None and seen.reserved and seen.task_id != first.task_id:
            claims += 1


@contextlib.asynccontextmanager
async def cluster(
    nats_url: str, *, gated: bool = False
) -> AsyncIterator[tuple[QuietFirst, Instance, Instance]]:
    """A ``QuietFirst`` agent (its gate open unless ``gated``) on two instances, both
    reserving (within 30 s for the whole test)."""
    agent = QuietFirst()
    if not gated:
        agent.gate.set()
    async with asyncio.timeout(30), instances(agent, [nats_url]) as (a, b):
        await reserving(a, b)
        yield agent, a, b


def keys_of(instance: Instance, clock: Callable[[], float] = time.time) -> JetStreamSentKeys:
    """The shared keys, as another instance (on ``instance``'s connection) reads them."""
    return JetStreamSentKeys(instance.cluster.conn.js, WINDOW, 1, Retry(5.0), clock)


async def reserving(*some: Instance) -> None:
    """Until each instance has heard every instance, which all read reservations."""
    for instance in some:
        await instance.cluster.formats.wait_for(formats.CURRENT)
        assert instance.cluster.formats.everyone(RESERVED_KEYS)


async def test_a_new_task_s_claim_reserves_its_id_and_is_the_key_s_only_write(
    nats_url: str,
) -> None:
    async with cluster(nats_url) as (agent, a, b):
        request = send_request("book it")
        async with key_writes(nats_url, key_for(request)) as writes:
            task = (await a.stub.SendMessage(copy(request), metadata=V1)).task
            seen = await writes.rest()
        assert task.status.state == S.TASK_STATE_COMPLETED
        assert seen == [KeyRecord.reserving(body_digest(request), task.id, seen[0].at)]  # type: ignore[union-attr]
        again = (await b.stub.SendMessage(copy(request), metadata=V1)).task
        assert again.id == task.id and again.status.state == S.TASK_STATE_COMPLETED
        assert agent.runs == [task.id], "the retry through B ran nothing"


async def test_claims_are_settled_as_before_while_an_instance_does_not_read_reservations(
    nats_url: str,
) -> None:
    async with cluster(nats_url) as (_, a, _b):
        older = {"formats": [1, 2], "version": "x", "features": sorted(FEATURES - {RESERVED_KEYS})}
        a.cluster.formats.heard("older", json.dumps(older).encode())  # (its heartbeat)
        assert not a.cluster.formats.everyone(RESERVED_KEYS)
        request = send_request("book it")
        async with key_writes(nats_url, key_for(request)) as writes:
            task = (await a.stub.SendMessage(copy(request), metadata=V1)).task
            seen = await writes.rest()
        digest = body_digest(request)
        assert [(r.digest, r.task_id, r.after, r.reserved) for r in seen if r] == [
            (digest, "", -1, False),
            (digest, task.id, 0, False),
        ], "a pending claim, then its record once the run started"
        assert len(seen) == 2
        a.cluster.formats.gone("older")
        assert a.cluster.formats.everyone(RESERVED_KEYS)


async def test_a_retry_that_finds_a_reservation_before_its_task_exists_waits_for_it(
    nats_url: str,
) -> None:
    async with cluster(nats_url, gated=True) as (agent, a, b):
        request = send_request("quiet at first")
        async with key_writes(nats_url, key_for(request)) as writes:
            first = asyncio.ensure_future(a.stub.SendMessage(copy(request), metadata=V1))
            claim = await writes.next()
            assert claim is not None and claim.reserved
            await agent.running.wait()  # (its task does not exist yet)
            retry = asyncio.ensure_future(b.stub.SendMessage(copy(request), metadata=V1))
            await retries_waiting(writes, claim)
            agent.gate.set()
            answers = [(await first).task, (await retry).task]
        assert [t.id for t in answers] == [claim.task_id] * 2
        assert [t.status.state for t in answers] == [S.TASK_STATE_COMPLETED] * 2
        assert agent.runs == [claim.task_id]


async def test_a_retry_runs_when_the_first_request_lets_its_reservation_go(
    nats_url: str,
) -> None:
    async with cluster(nats_url) as (agent, a, b):
        request = send_request("refused at first")
        key = key_for(request)
        store = keys_of(a)
        async with key_writes(nats_url, key) as writes:
            # A first request's claim; it is then refused before its run (say, a quota).
            reserved = KeyRecord.reserving(body_digest(request), str(uuid.uuid4()), 0.0)
            assert await store.claim(key, reserved) is None
            await writes.next()
            retry = asyncio.ensure_future(b.stub.SendMessage(copy(request), metadata=V1))
            await retries_waiting(writes, reserved)
            await store.release(key)
            task = (await retry).task
        assert task.status.state == S.TASK_STATE_COMPLETED
        assert task.id != reserved.task_id and agent.runs == [task.id]


async def test_a_reservation_whose_task_never_came_is_taken_over_by_a_retry(
    nats_url: str,
) -> None:
    async with cluster(nats_url) as (agent, a, b):
        request = send_request("its instance died")
        key = key_for(request)
        past = keys_of(a, clock=lambda: time.time() - PENDING_FOR - 1)
        lost = KeyRecord.reserving(body_digest(request), str(uuid.uuid4()), 0.0)
        assert await past.claim(key, lost) is None  # (its instance died before the run)
        task = (await b.stub.SendMessage(copy(request), metadata=V1)).task
        assert task.status.state == S.TASK_STATE_COMPLETED
        assert task.id != lost.task_id and agent.runs == [task.id]
        now = await keys_of(a).claim(key, KeyRecord("another body"))
        assert now is not None and (now.task_id, now.reserved) == (task.id, True)
        again = (await a.stub.SendMessage(copy(request), metadata=V1)).task
        assert again.id == task.id and agent.runs == [task.id]


async def test_a_run_silent_after_its_start_has_its_reservation_confirmed(
    nats_url: str,
) -> None:
    """A retry never takes over the key of a run that is alive: a reservation whose task is
    not recorded soon after its run started is confirmed (a started record, as before)."""
    async with cluster(nats_url, gated=True) as (agent, a, b):
        request = send_request("thinking")
        async with key_writes(nats_url, key_for(request)) as writes:
            first = asyncio.ensure_future(a.stub.SendMessage(copy(request), metadata=V1))
            claim = await writes.next()
            assert claim is not None and claim.reserved
            confirmed = await writes.next()  # (CONFIRM_AFTER after its run started)
            assert confirmed is not None
            assert (confirmed.digest, confirmed.task_id, confirmed.after, confirmed.reserved) == (
                claim.digest,
                claim.task_id,
                0,
                False,
            )
            assert agent.runs == [claim.task_id] and not agent.gate.is_set()
            agent.gate.set()
            task = (await first).task
            again = (await b.stub.SendMessage(copy(request), metadata=V1)).task
        assert task.id == again.id == claim.task_id and agent.runs == [task.id]


class Paced(QuietFirst):
    """Silent for the seconds its message's text says, then WORKING and COMPLETED."""

    async def silence(self, context: RequestContext) -> None:
        await asyncio.sleep(float(context.get_user_input()))  # sync-ok: the agent's own pace


async def attempt(
    instance: Instance, request: SendMessageRequest, streaming: bool, cut_after: float | None
) -> str | None:
    """One attempt: the task id it was answered (None: cut by its client first)."""
    call = (
        instance.stub.SendStreamingMessage(copy(request), metadata=V1)
        if streaming
        else instance.stub.SendMessage(copy(request), metadata=V1)
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


async def test_retries_of_new_tasks_run_each_message_once_over_seeded_schedules(
    nats_url: str,
) -> None:
    """The promise under many interleavings: a new task's message sent, maybe cut, and
    retried through the other instance or both at once, blocking or streaming, its agent
    quick, slow, or silent past CONFIRM_AFTER: each runs once, every answer is its task."""
    agent = Paced()
    async with asyncio.timeout(90), instances(agent, [nats_url]) as (a, b):
        await reserving(a, b)
        answered: dict[str, set[str]] = {}
        for seed in range(6):
            rng = random.Random(seed)
            schedules = []
            for _ in range(8):
                pace = rng.choice([0.0, 0.0, 0.005, 0.05, CONFIRM_AFTER + 0.2])
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

"""Retry keys are kept per caller: a caller sending many keyed messages forgets its own
oldest keys first, never another caller's, so a retry inside the window still runs nothing
twice (``journal.keys.MemorySentKeys``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from a2a.types.a2a_pb2 import TaskState

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.journal.keys import KeyRecord, MemorySentKeys
from a2a_grpc_server._internal.rpc import idempotency
from tests.support.agents import CountingAgent
from tests.support.harness import ALICE, BOB, copy, send_request, serve, tokens

S = TaskState
ALICE_KEYED = (*ALICE, ("a2a-extensions", idempotency.URI))
BOB_KEYED = (*BOB, ("a2a-extensions", idempotency.URI))


async def test_another_callers_many_ids_do_not_evict_alices_key(tmp_path: Path) -> None:
    agent = CountingAgent()
    agent.gate.set()
    config = ServerConfig(idempotency_max_keys=100, cancel_timeout=1.0)
    async with asyncio.timeout(60), serve(agent, config, auth=tokens(tmp_path)) as h:
        mine = send_request("pay alice's bill")
        first = (await h.stub.SendMessage(copy(mine), metadata=ALICE_KEYED)).task
        assert first.status.state == S.TASK_STATE_COMPLETED
        bobs = [send_request(f"bob's {n}") for n in range(150)]
        for request in bobs:  # (bounded: 150 sends, inside the test's timeout)
            await h.stub.SendMessage(copy(request), metadata=BOB_KEYED)
        again = (await h.stub.SendMessage(copy(mine), metadata=ALICE_KEYED)).task
        assert again.id == first.id, "alice's retry is answered her first task"
        assert agent.runs.count(mine.message.message_id) == 1, "and runs nothing again"
        latest = (await h.stub.SendMessage(copy(bobs[-1]), metadata=BOB_KEYED)).task
        assert agent.runs.count(bobs[-1].message.message_id) == 1, "bob's latest key is kept"
        assert latest.status.state == S.TASK_STATE_COMPLETED
        await h.stub.SendMessage(copy(bobs[0]), metadata=BOB_KEYED)
        assert agent.runs.count(bobs[0].message.message_id) == 2, "bob's oldest went first"


async def test_answers_past_their_bytes_go_from_the_caller_keeping_the_most_bytes() -> None:
    keys = MemorySentKeys(window=60.0, most=100, most_bytes=2500)
    alice = KeyRecord("a", caller="alice")
    assert await keys.claim("alice-1", alice) is None
    await keys.settle("alice-1", alice.answered(b"a" * 1000))
    for n in range(2):  # bob's second answer passes the bytes: his first goes
        bob = KeyRecord(f"b{n}", caller="bob")
        assert await keys.claim(f"bob-{n}", bob) is None
        await keys.settle(f"bob-{n}", bob.answered(b"b" * 1000))
    assert len(keys) == 2
    kept = await keys.claim("alice-1", KeyRecord("a", caller="alice"))
    assert kept is not None and kept.answer == b"a" * 1000, "alice's answer is kept"
    assert await keys.claim("bob-0", KeyRecord("b0", caller="bob")) is None, "bob's went"


async def test_keys_past_the_most_go_oldest_first_from_the_caller_keeping_the_most() -> None:
    keys = MemorySentKeys(window=60.0, most=4)
    assert await keys.claim("alice-1", KeyRecord("a1", caller="alice")) is None
    for n in range(5):
        assert await keys.claim(f"bob-{n}", KeyRecord(f"b{n}", caller="bob")) is None
    assert len(keys) == 4
    assert await keys.claim("alice-1", KeyRecord("a1", caller="alice")) is not None
    assert await keys.claim("bob-4", KeyRecord("b4", caller="bob")) is not None
    assert await keys.claim("bob-0", KeyRecord("b0", caller="bob")) is None, "bob's oldest went"
    assert len(keys) == 4, "and his next oldest (bob-2) made room for it"
    assert await keys.claim("bob-3", KeyRecord("b3", caller="bob")) is not None
    for key in ("bob-0", "alice-1"):
        await keys.release(key)
    assert len(keys) == 2

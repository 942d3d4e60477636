"""Retry keys in ``A2A_KEYS`` are bounded per caller (issue 42, hole 4, on NATS).

JetStream cannot bound a group of subjects, so each instance bounds the keys it claimed
(``jetstream.keys.Claimed``): past ``idempotency_max_keys``, the oldest key of the caller
that claimed the most through it is deleted from the bucket. A caller's flood of keyed
messages thus shrinks its own protection, never another caller's, and the bucket holds
at most ``idempotency_max_keys`` records per instance. Real nats-server, two instances.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.jetstream.conn import KEYS_BUCKET
from tests.behaviour.test_retry_keys import ALICE_KEYED, BOB_KEYED
from tests.support.agents import CountingAgent
from tests.support.clusterharness import instances
from tests.support.harness import copy, send_request, tokens

MOST = 40


async def test_a_callers_flood_of_keys_is_bounded_and_evicts_only_its_own(
    nats_url: str, tmp_path: Path
) -> None:
    agent = CountingAgent()
    agent.gate.set()
    config = ServerConfig(idempotency_max_keys=MOST, cancel_timeout=1.0)
    async with (
        asyncio.timeout(60),
        instances(agent, [nats_url], config=config, auth=tokens(tmp_path)) as [a, b],
    ):
        mine = send_request("pay alice's bill")
        first = (await a.stub.SendMessage(copy(mine), metadata=ALICE_KEYED)).task
        bobs = [send_request(f"bob's {n}") for n in range(MOST + 20)]
        for request in bobs:  # (bounded: 60 sends, inside the test's timeout)
            await a.stub.SendMessage(copy(request), metadata=BOB_KEYED)
        await a.cluster.wait_idle()  # (the deletes past the bound are done)
        kv = await a.cluster.conn.js.key_value(KEYS_BUCKET)
        assert len(await kv.keys()) == MOST, "the bucket keeps what the bound allows"
        again = (await b.stub.SendMessage(copy(mine), metadata=ALICE_KEYED)).task
        assert again.id == first.id, "alice's retry, through B, is answered her first task"
        assert agent.runs.count(mine.message.message_id) == 1, "and runs nothing again"
        await b.stub.SendMessage(copy(bobs[-1]), metadata=BOB_KEYED)
        assert agent.runs.count(bobs[-1].message.message_id) == 1, "bob's latest key is kept"
        await b.stub.SendMessage(copy(bobs[0]), metadata=BOB_KEYED)
        assert agent.runs.count(bobs[0].message.message_id) == 2, "bob's oldest went first"

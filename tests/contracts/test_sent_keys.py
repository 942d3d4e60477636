"""The SentKeys contract (``journal.keys``), run against both stores: in memory, and the
JetStream KV bucket ``A2A_KEYS`` on a real nats-server. One claimer wins however many race;
a settled record is found by later claims; a released key is claimed afresh; a pending
record is taken over once abandoned, and any record once past the window."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from a2a_grpc_server._internal.jetstream.conn import KEYS_BUCKET, NatsConfig, connect
from a2a_grpc_server._internal.jetstream.keys import JetStreamSentKeys
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.retry import Retry
from a2a_grpc_server._internal.journal.keys import (
    ANSWER_KEPT,
    PENDING_FOR,
    KeyRecord,
    MemorySentKeys,
    SentKeys,
)
from tests.support import natsserver

WINDOW = 3600.0


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "nats", "nats-lean"])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[tuple[list[SentKeys], Clock]]:
    """Two stores on one shared state (two instances), and the clock both read.

    ``nats-lean``: as the server makes them, claims and records through the lean
    publishes (``JetStreamRequests``); ``nats``: nats-py's KV alone.
    """
    clock = Clock()
    if request.param == "memory":
        one = MemorySentKeys(WINDOW, 100, clock)
        yield [one, one], clock
        return
    conn = await connect(NatsConfig(servers=[request.getfixturevalue("nats_url")]))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    lean = requests if request.param == "nats-lean" else None
    try:
        yield (
            [
                JetStreamSentKeys(conn.js, WINDOW, 1, Retry(5.0), clock, requests=lean)
                for _ in range(2)
            ],
            clock,
        )
    finally:
        await requests.close()
        await conn.js.delete_key_value(KEYS_BUCKET)
        await conn.close()


def new_key() -> str:
    return uuid.uuid4().hex


async def test_one_claimer_wins_however_many_race(
    stores: tuple[list[SentKeys], Clock],
) -> None:
    (a, b), _ = stores
    key = new_key()
    results = await asyncio.gather(
        *(s.claim(key, KeyRecord(f"d{n}")) for n, s in enumerate([a, b] * 5))
    )
    winners = [n for n, r in enumerate(results) if r is None]
    assert len(winners) == 1
    assert all(r is not None and r.digest == f"d{winners[0]}" for r in results if r is not None)


async def test_a_settled_record_is_what_later_claims_find(
    stores: tuple[list[SentKeys], Clock],
) -> None:
    (a, b), _ = stores
    key = new_key()
    mine = KeyRecord("d", "")
    assert await a.claim(key, mine) is None
    pending = await b.claim(key, KeyRecord("d"))
    assert pending is not None and pending.pending
    await a.settle(key, mine.started("t-1", 7))
    found = await b.claim(key, KeyRecord("d"))
    assert found is not None and (found.task_id, found.after, found.pending) == ("t-1", 7, False)
    await a.settle(key, mine.answered(b"message"))
    found = await b.claim(key, KeyRecord("d"))
    assert found is not None and found.answer == b"message"
    settled = mine.started("t-2", 9).answered(b"message")
    await a.settle(key, settled)
    found = await b.claim(key, KeyRecord("d"))
    assert found is not None and found == settled.stamped(found.at), "every field as settled"
    dropped = mine.answered(b"x" * (ANSWER_KEPT + 1))
    await a.settle(key, dropped)
    found = await b.claim(key, KeyRecord("d"))
    assert found is not None and found.dropped and not found.pending and not found.answer


async def test_a_released_key_is_claimed_afresh(stores: tuple[list[SentKeys], Clock]) -> None:
    (a, b), _ = stores
    key = new_key()
    assert await a.claim(key, KeyRecord("d")) is None
    await a.release(key)
    assert await b.claim(key, KeyRecord("d")) is None


async def test_an_abandoned_pending_record_and_one_past_the_window_are_taken_over(
    stores: tuple[list[SentKeys], Clock],
) -> None:
    (a, b), clock = stores
    key = new_key()
    assert await a.claim(key, KeyRecord("d1")) is None
    clock.now += PENDING_FOR - 1
    assert await b.claim(key, KeyRecord("d2")) is not None, "still starting: kept"
    clock.now += 2
    assert await b.claim(key, KeyRecord("d2")) is None, "abandoned: taken over"
    await b.settle(key, KeyRecord("d2").started("t", 0))
    clock.now += WINDOW - 1
    assert await a.claim(key, KeyRecord("d3")) is not None, "settled, within the window"
    clock.now += 2
    assert await a.claim(key, KeyRecord("d3")) is None, "past the window: a new request"


async def test_an_abandoned_follow_up_is_returned_for_its_task_to_be_looked_at(
    stores: tuple[list[SentKeys], Clock],
) -> None:
    # Its message may be in the task already (its writer died after the owner recorded
    # it): the retry looks (``rpc.idempotency``) before it takes the key over.
    (a, b), clock = stores
    key = new_key()
    assert await a.claim(key, KeyRecord("d", "t-1")) is None
    clock.now += PENDING_FOR + 1
    found = await b.claim(key, KeyRecord("d", "t-1"))
    assert found is not None and found.pending and found.abandoned(clock.now)
    assert await b.claim(key, KeyRecord("d", "t-1"), found) is None, "taken over, named"


async def test_an_uncertain_record_is_kept_and_taken_over_only_unchanged(
    stores: tuple[list[SentKeys], Clock],
) -> None:
    # A follow-up routed with no trusted answer (``rpc.idempotency``): later claims find
    # it; one claim that names it as found replaces it, and only one of two racing.
    (a, b), _ = stores
    key = new_key()
    mine = KeyRecord("d", "t-1")
    assert await a.claim(key, mine) is None
    await a.settle(key, mine.uncertain("t-1", 4, "owner-1", 1, 99.0))
    found = await b.claim(key, KeyRecord("d", "t-1"))
    assert found is not None and (found.asked, found.after, found.pending) == ("owner-1", 4, False)
    assert await b.claim(key, KeyRecord("d", "t-1"), found.started("t-1", 4)) == found
    results = await asyncio.gather(
        a.claim(key, KeyRecord("d", "t-1"), found), b.claim(key, KeyRecord("d", "t-1"), found)
    )
    assert sorted(r is None for r in results) == [False, True], "one takes it over"
    taken = await b.claim(key, KeyRecord("d", "t-1"))
    assert taken is not None and taken.pending and not taken.asked

"""Push configs' delivery entries on a real nats-server: a survivor finds the configs a lost
instance delivered through that instance's entries (counted reads, not the bucket), the
same ones reading every config finds; stale and duplicate entries are dropped; and the
entries are trusted only while every instance publishes them and the push marker stands
(configs written before, by a version without them, are indexed first)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from a2a.types.a2a_pb2 import TaskPushNotificationConfig

from a2a_grpc_server._internal.errors import UnknownFormatError
from a2a_grpc_server._internal.jetstream.conn import (
    INDEX_STREAM,
    PUSH_BUCKET,
    PUSH_CALLERS_BUCKET,
    NatsConfig,
    connect,
)
from a2a_grpc_server._internal.jetstream.deliveries import (
    PUSH_FRESH,
    PUSH_MARKER,
    DeliveryIndex,
    delivered_by,
)
from a2a_grpc_server._internal.jetstream.formats import FEATURES, Formats
from a2a_grpc_server._internal.jetstream.index import TaskIndex
from a2a_grpc_server._internal.jetstream.pushstore import (
    DeliveryCoverage,
    JetStreamPushConfigs,
    Orphans,
)
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.retry import Retry
from tests.support import natsserver


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]


class Assets:
    """A store with delivery entries, one without (a version before them), and the index."""

    def __init__(
        self, store: JetStreamPushConfigs, older: JetStreamPushConfigs, index: TaskIndex
    ) -> None:
        self.store, self.older, self.index = store, older, index
        self.reads: list[str] = []
        read = store._get

        async def counted(key: str) -> tuple[int, bytes] | None:
            self.reads.append(key)
            return await read(key)

        store._get = counted  # type: ignore[method-assign]


@pytest.fixture
async def assets(nats_url: str) -> AsyncIterator[Assets]:
    conn = await connect(NatsConfig(servers=[nats_url]))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    index = TaskIndex(requests, Retry(5.0))
    try:
        yield Assets(
            JetStreamPushConfigs(conn.js, conn.push, Retry(5.0), index=index),
            JetStreamPushConfigs(conn.js, conn.push, Retry(5.0)),
            index,
        )
    finally:
        await index.close()
        await requests.close()
        await conn.js.delete_key_value(PUSH_BUCKET)
        await conn.js.delete_key_value(PUSH_CALLERS_BUCKET)
        await conn.js.delete_stream(INDEX_STREAM)
        await conn.close()


def config(task_id: str, config_id: str = "hook") -> TaskPushNotificationConfig:
    return TaskPushNotificationConfig(task_id=task_id, id=config_id, url="https://x.test/h")


def found(orphans: Orphans) -> list[tuple[str, str, str]]:
    return sorted((o.task_id, o.config.id, o.deliverer) for o in orphans)


def heartbeat(features: frozenset[str]) -> bytes:
    return json.dumps({"formats": [1, 2], "version": "x", "features": sorted(features)}).encode()


async def test_orphans_are_found_through_the_lost_deliverers_entries_alone(
    assets: Assets,
) -> None:
    """200 configs delivered by a live instance, 10 by a lost one: the indexed lookup reads
    the lost one's 10 configs (counted) and finds what reading every config finds."""
    store = assets.store
    for n in range(200):
        await store.put(config(f"live-{n}"), most=10, seq=0, deliverer="i-1")
    for n in range(10):
        await store.put(config(f"lost-{n}"), most=10, seq=0, deliverer="gone")
    await store.put(config("nobody"), most=10, seq=0)  # (no deliverer: no entry)
    assets.reads.clear()
    indexed = await store.orphans({"i-1"}, indexed=True)
    assert sorted(assets.reads) == sorted(f"lost-{n}.aG9vaw" for n in range(10))
    assert found(indexed) == found(await store.orphans({"i-1"}))
    assert found(indexed) == sorted((f"lost-{n}", "hook", "gone") for n in range(10))
    assert all(o.entry for o in indexed), "each knows its entry"


async def test_reading_every_config_finds_each_past_one_fetch_with_its_revision(
    assets: Assets,
) -> None:
    """The read of the whole bucket (the lookup when the entries are not trusted) goes on
    past one fetch (300 configs): each lost config once, deleted ones not, and with the
    revision an adoption's compare-and-set needs."""
    store = assets.store
    for n in range(300):
        await store.put(config(f"lost-{n}"), most=10, seq=0, deliverer="gone")
    for n in range(0, 300, 50):
        assert await store.delete(f"lost-{n}", "hook")
    orphans = await store.orphans({"i-1"})
    expected = sorted((f"lost-{n}", "hook", "gone") for n in range(300) if n % 50)
    assert found(orphans) == expected
    assert await store.adopt(orphans[0], "i-1"), "the revision read is the config's last"
    assert not await store.adopt(orphans[0], "i-2"), "and only once"


async def test_an_adopted_replaced_or_deleted_config_is_no_orphan_and_its_entries_go(
    assets: Assets,
) -> None:
    """Adopted by a survivor: its entry under the lost instance is deleted at once. A
    config replaced (two entries under one deliverer): found once, the older entry goes.
    Deleted: not found; its entry, once older than STALE_AFTER, goes."""
    store, index = assets.store, assets.index
    for name in ("adopted", "replaced", "deleted"):
        await store.put(config(name), most=10, seq=0, deliverer="gone")
    await store.put(config("replaced"), most=10, seq=1, deliverer="gone")
    await store.delete("deleted", "hook")
    orphans = await store.orphans({"i-1"}, indexed=True)
    assert found(orphans) == [("adopted", "hook", "gone"), ("replaced", "hook", "gone")]
    [adopted] = [o for o in orphans if o.task_id == "adopted"]
    assert await store.adopt(adopted, "i-1")
    await index.close()  # (the deletes asked for are done)
    left = [
        e.key
        for batch in [b async for b in DeliveryIndex(index).deliveries(delivered_by("gone"))]
        for e in batch
    ]
    assert sorted(left) == ["deleted.aG9vaw", "replaced.aG9vaw"], (
        "adopted's and one replaced's gone"
    )
    assert found(await store.orphans({"i-1"}, indexed=True)) == [("replaced", "hook", "gone")]
    mine = await DeliveryIndex(index).deliverers()
    assert "i-1" in mine, "the adopter's own entry was published before the config named it"


async def test_entries_are_trusted_once_every_instance_publishes_them_and_the_marker_stands(
    assets: Assets,
) -> None:
    """A config written by a version without delivery entries is found only by reading every
    config, until the smallest instance indexes the bucket and writes the marker; an
    instance without them heard removes it; a marker older than PUSH_FRESH is rebuilt."""
    store, older, index = assets.store, assets.older, assets.index
    await older.put(config("old"), most=10, seq=0, deliverer="gone")
    formats = Formats()
    coverage = DeliveryCoverage(store, index, formats, "i-1")
    assert not await coverage.trusted(), "not settled: not trusted"
    formats.settle()
    formats.heard("i-2", heartbeat(FEATURES))
    assert not await coverage.trusted() and coverage.due()
    await DeliveryCoverage(store, index, formats, "i-2").keep({"i-1", "i-2"})
    assert not await coverage.trusted(), "only the smallest live instance builds it"
    await coverage.keep({"i-1", "i-2"})
    assert await coverage.trusted() and coverage.covered.is_set() and not coverage.due()
    assert found(await store.orphans({"i-1"}, indexed=True)) == [("old", "hook", "gone")]

    formats.heard("i-0", heartbeat(FEATURES - {"deliverers"}))  # an older version joins
    assert coverage.due()
    await coverage.keep({"i-0", "i-1", "i-2"})
    assert not await coverage.trusted() and not coverage.covered.is_set()
    assert not coverage.due(), "removed once while it is heard"
    formats.gone("i-0")
    await older.put(config("while-it-ran"), most=10, seq=0, deliverer="gone")
    await coverage.keep({"i-1", "i-2"})
    assert found(await store.orphans({"i-1"}, indexed=True)) == [
        ("old", "hook", "gone"),
        ("while-it-ran", "hook", "gone"),
    ]

    stale = json.dumps({"format": 1, "by": "i-1", "at": time.time_ns() - PUSH_FRESH - 10**9})
    await index._requests.publish(PUSH_MARKER, stale.encode(), {"Nats-Rollup": "sub"}, 5.0)
    assert not await coverage.trusted(), "a marker not renewed for PUSH_FRESH is not trusted"
    await older.put(config("alone"), most=10, seq=0, deliverer="gone")
    await coverage.keep({"i-1"})
    assert await coverage.trusted()
    assert ("alone", "hook", "gone") in found(await store.orphans({"i-1"}, indexed=True))


async def test_an_entry_in_a_format_this_version_does_not_read_is_refused(
    assets: Assets,
) -> None:
    """Formats are versioned: an entry of format 2 is not guessed at."""
    await assets.index._requests.publish(delivered_by("i-1"), b"3\nfrom the future", {}, 5.0)
    assert await assets.store.orphans({"i-1"}, indexed=True) == [], "a live one's: never read"
    await assets.index._requests.publish(delivered_by("gone"), b"2\np\ngone\nk.x\n1", {}, 5.0)
    with pytest.raises(UnknownFormatError):
        await assets.store.orphans({"i-1"}, indexed=True)
    await assets.index._requests.publish(delivered_by("bad"), b"1\np\nbad\nk.x\nsoon", {}, 5.0)
    with pytest.raises(UnknownFormatError):
        await DeliveryIndex(assets.index).deliverers({"i-1", "gone"})


async def test_a_config_whose_cursor_moves_past_half_the_ttl_publishes_its_entry_again(
    nats_url: str,
) -> None:
    """A config written again lives on (its max age restarts), so its entry, which would
    expire first, is published again once half the index's max age old."""
    conn = await connect(NatsConfig(servers=[nats_url]))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    index = TaskIndex(requests, Retry(5.0))
    now = [100.0]
    store = JetStreamPushConfigs(
        conn.js, conn.push, Retry(5.0), index=index, entry_ttl=60.0, clock=lambda: now[0]
    )
    try:
        await store.put(config("long"), most=10, seq=0, deliverer="A")

        async def entries() -> int:
            return sum([len(b) async for b in DeliveryIndex(index).deliveries(delivered_by("A"))])

        assert await entries() == 1
        assert await store.confirm("long", "hook", 1)
        now[0] += 29
        assert await store.confirm("long", "hook", 2)
        assert await entries() == 1, "younger than half the max age: kept"
        now[0] += 2
        assert await store.confirm("long", "hook", 3)
        assert await entries() == 2, "published again"
    finally:
        await index.close()
        await requests.close()
        await conn.js.delete_key_value(PUSH_BUCKET)
        await conn.js.delete_stream(INDEX_STREAM)
        await conn.close()


async def test_an_older_instance_that_came_and_left_between_two_keeps_is_not_missed(
    assets: Assets,
) -> None:
    """An instance without entries heard, writing a config, and gone before the next keep:
    the marker is not trusted, and the next keep indexes its config."""
    store, older, index = assets.store, assets.older, assets.index
    formats = Formats()
    formats.settle()
    coverage = DeliveryCoverage(store, index, formats, "i-1")
    await coverage.keep({"i-1"})
    assert await coverage.trusted()
    formats.heard("i-0", heartbeat(FEATURES - {"deliverers"}))
    await older.put(config("by-the-old-one"), most=10, seq=0, deliverer="gone")
    formats.gone("i-0")
    assert not await coverage.trusted() and coverage.due()
    await coverage.keep({"i-1"})
    assert await coverage.trusted()
    assert found(await store.orphans({"i-1"}, indexed=True)) == [("by-the-old-one", "hook", "gone")]

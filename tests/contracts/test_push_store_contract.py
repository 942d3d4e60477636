"""The PushConfigStore contract, run against every implementation: in memory, and in the
JetStream KV on a real nats-server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from a2a.types.a2a_pb2 import TaskPushNotificationConfig

from a2a_grpc_server._internal.errors import InvalidFieldError, QuotaExceededError
from a2a_grpc_server._internal.jetstream.conn import (
    PUSH_BUCKET,
    PUSH_CALLERS_BUCKET,
    NatsConfig,
    connect,
)
from a2a_grpc_server._internal.jetstream.pushstore import JetStreamPushConfigs, caller_key
from a2a_grpc_server._internal.jetstream.retry import Retry
from a2a_grpc_server._internal.push.configs import (
    MemoryPushConfigs,
    PushConfigLimitError,
    PushConfigStore,
)
from tests.support import natsserver


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]


@pytest.fixture(params=["memory", "nats"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[PushConfigStore]:
    if request.param == "memory":
        yield MemoryPushConfigs()
        return
    conn = await connect(NatsConfig(servers=[request.getfixturevalue("nats_url")]))
    try:
        yield JetStreamPushConfigs(conn.js, conn.push, Retry(5.0), callers=conn.push_callers)
    finally:
        await conn.js.delete_key_value(PUSH_BUCKET)
        await conn.js.delete_key_value(PUSH_CALLERS_BUCKET)
        await conn.close()


def config(
    task_id: str, config_id: str, url: str = "https://example.test/hook"
) -> TaskPushNotificationConfig:
    return TaskPushNotificationConfig(task_id=task_id, id=config_id, url=url)


def new_task() -> str:
    return str(uuid.uuid4())


async def test_a_config_put_is_got_back_as_a_copy(store: PushConfigStore) -> None:
    task_id = new_task()
    await store.put(config(task_id, "a"), most=10, seq=3)
    got = await store.get(task_id, "a")
    assert got == config(task_id, "a")
    assert got is not None
    got.url = "https://changed.test/"
    assert await store.get(task_id, "a") == config(task_id, "a"), "the store keeps its own"
    assert await store.get(task_id, "missing") is None
    assert await store.get(new_task(), "a") is None


async def test_the_cursor_starts_at_the_seq_given_and_moves_with_confirm(
    store: PushConfigStore,
) -> None:
    task_id = new_task()
    await store.put(config(task_id, "a"), most=10, seq=3)
    assert await store.cursor(task_id, "a") == 3
    assert await store.confirm(task_id, "a", 7)
    assert await store.cursor(task_id, "a") == 7
    assert await store.cursor(task_id, "missing") is None


async def test_putting_an_existing_config_replaces_it_and_resets_its_cursor(
    store: PushConfigStore,
) -> None:
    task_id = new_task()
    await store.put(config(task_id, "a"), most=1, seq=3)
    await store.confirm(task_id, "a", 9)
    await store.put(config(task_id, "a", "https://other.test/hook"), most=1, seq=4)
    assert await store.get(task_id, "a") == config(task_id, "a", "https://other.test/hook")
    assert await store.cursor(task_id, "a") == 4
    page = await store.list(task_id, 10, "")
    assert [c.id for c in page.configs] == ["a"], "replaced, not added (and within most=1)"


async def test_a_task_holds_at_most_the_configs_it_may(store: PushConfigStore) -> None:
    task_id = new_task()
    await store.put(config(task_id, "a"), most=2, seq=0)
    await store.put(config(task_id, "b"), most=2, seq=0)
    with pytest.raises(PushConfigLimitError):
        await store.put(config(task_id, "c"), most=2, seq=0)
    assert await store.get(task_id, "c") is None
    await store.put(config(new_task(), "c"), most=2, seq=0)  # (another task's count is its own)


async def test_a_principals_configs_are_counted_over_all_its_tasks(
    store: PushConfigStore,
) -> None:
    # In cluster mode only push_max_configs per task bounded a caller: its configs over many
    # tasks were not counted (issue 22).
    alice = ("alice", 2)
    first, second = new_task(), new_task()
    await store.put(config(first, "a"), most=10, seq=0, caller=alice)
    await store.put(config(second, "b"), most=10, seq=0, caller=alice)
    with pytest.raises(QuotaExceededError) as caught:
        await store.put(config(new_task(), "c"), most=10, seq=0, caller=alice)
    assert caught.value.reason == "PUSH_CONFIGS_QUOTA"
    await store.put(config(first, "a", "https://new.test/"), most=10, seq=0, caller=alice)
    await store.put(config(new_task(), "c"), most=10, seq=0, caller=("bob", 2))  # his own count
    assert await store.delete(second, "b")
    await store.put(config(new_task(), "d"), most=10, seq=0, caller=alice)  # room again


async def test_a_principals_configs_created_at_once_keep_to_its_quota(
    store: PushConfigStore,
) -> None:
    dave = (f"dave-{uuid.uuid4()}", 2)
    made = await asyncio.gather(
        *(store.put(config(new_task(), "a"), most=10, seq=0, caller=dave) for _ in range(20)),
        return_exceptions=True,
    )
    refused = [r for r in made if isinstance(r, QuotaExceededError)]
    assert len(refused) == 18, made


async def test_a_principal_past_one_read_of_its_configs_is_counted_exactly(
    store: PushConfigStore,
) -> None:
    # More configs than one fetch of the count reads (READ_BATCH), and deleted ones not
    # counted. Counting once stopped at the watch's early "initial values done" marker.
    erin = (f"erin-{uuid.uuid4()}", 300)
    tasks = [new_task() for _ in range(300)]
    for task_id in tasks:
        await store.put(config(task_id, "a"), most=10, seq=0, caller=erin)
    with pytest.raises(QuotaExceededError):
        await store.put(config(new_task(), "a"), most=10, seq=0, caller=erin)
    assert await store.delete(tasks[0], "a")
    await store.put(config(new_task(), "a"), most=10, seq=0, caller=erin)  # room again
    with pytest.raises(QuotaExceededError):
        await store.put(config(new_task(), "a"), most=10, seq=0, caller=erin)


async def test_configs_are_listed_oldest_first_page_by_page(store: PushConfigStore) -> None:
    task_id = new_task()
    for name in ("a", "b", "c", "d", "e"):
        await store.put(config(task_id, name), most=10, seq=0)
    seen, token = [], ""
    for _ in range(5):
        page = await store.list(task_id, 2, token)
        seen += [c.id for c in page.configs]
        token = page.next_token
        if not token:
            break
    assert seen == ["a", "b", "c", "d", "e"]
    empty = await store.list(new_task(), 2, "")
    assert (empty.configs, empty.next_token) == ([], "")


async def test_a_page_token_it_did_not_issue_is_refused(store: PushConfigStore) -> None:
    with pytest.raises(InvalidFieldError):
        await store.list(new_task(), 2, "not-a-token")


async def test_a_deleted_config_is_gone_and_its_delivery_told_to_stop(
    store: PushConfigStore,
) -> None:
    task_id = new_task()
    await store.put(config(task_id, "a"), most=10, seq=0)
    assert await store.delete(task_id, "a")
    assert not await store.delete(task_id, "a"), "a second delete finds nothing"
    assert await store.get(task_id, "a") is None
    assert await store.cursor(task_id, "a") is None
    assert not await store.confirm(task_id, "a", 5), "the delivery learns it was deleted"
    assert (await store.list(task_id, 10, "")).configs == []


async def test_forgetting_a_task_leaves_the_others_configs(store: PushConfigStore) -> None:
    kept, dropped = new_task(), new_task()
    await store.put(config(kept, "a"), most=10, seq=0)
    await store.put(config(dropped, "a"), most=10, seq=0)
    store.forget(dropped)
    assert await store.get(kept, "a") == config(kept, "a")


async def test_a_count_left_over_by_a_crash_is_set_right_when_it_refuses(nats_url: str) -> None:
    # A crash between a config's index key and the config leaves the key alone: the count runs
    # over. When it would refuse, keys whose config is gone are purged (once per 30 s).
    conn = await connect(NatsConfig(servers=[nats_url]))
    now = [0.0]
    store = JetStreamPushConfigs(
        conn.js, conn.push, Retry(5.0), callers=conn.push_callers, clock=lambda: now[0]
    )
    try:
        carol, first = ("carol", 2), new_task()
        await store.put(config(first, "a"), most=10, seq=0, caller=carol)
        for lost in ("x", "y"):  # two creations that crashed after counting themselves
            await conn.push_callers.put(f"{caller_key('carol')}.{new_task()}.{lost}", b"")
        await store.put(config(new_task(), "b"), most=10, seq=0, caller=carol)  # set right
        with pytest.raises(QuotaExceededError):  # a and b: at the quota
            await store.put(config(new_task(), "c"), most=10, seq=0, caller=carol)
        await conn.push_callers.put(f"{caller_key('carol')}.{new_task()}.z", b"")  # one more
        assert await store.delete(first, "a")
        with pytest.raises(QuotaExceededError):  # b and z: not set right again within 30 s
            await store.put(config(new_task(), "c"), most=10, seq=0, caller=carol)
        now[0] += 30.0
        await store.put(config(new_task(), "c"), most=10, seq=0, caller=carol)
    finally:
        await conn.js.delete_key_value(PUSH_BUCKET)
        await conn.js.delete_key_value(PUSH_CALLERS_BUCKET)
        await conn.close()

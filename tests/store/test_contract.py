"""The TaskStore contract, run against every implementation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from a2a.types.a2a_pb2 import Task, TaskState

from a2a_grpc_server import taskops
from a2a_grpc_server.cluster.natsconn import TASKS_BUCKET, NatsConfig, connect
from a2a_grpc_server.store import (
    FinalTaskError,
    InvalidPageTokenError,
    TaskExistsError,
    TaskQuery,
    TaskStore,
    UnknownTaskError,
    VersionConflictError,
)
from a2a_grpc_server.store.memory import InMemoryTaskStore
from a2a_grpc_server.store.nats import NatsTaskStore
from tests import natsserver

S = TaskState


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]


@pytest.fixture(params=["memory", "nats"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[TaskStore]:
    """Every implementation, empty: in memory, and a KV bucket on a real nats-server."""
    if request.param == "memory":
        yield InMemoryTaskStore()
        return
    conn = await connect(NatsConfig(servers=[request.getfixturevalue("nats_url")]))
    try:
        yield NatsTaskStore(conn.js, TASKS_BUCKET, conn.tasks, "instance-1")
    finally:
        await conn.js.delete_key_value(TASKS_BUCKET)
        await conn.close()


def task(task_id: str, context: str = "c", state: TaskState = S.TASK_STATE_SUBMITTED) -> Task:
    t = taskops.new_task(task_id, context, None)
    t.status.state = state
    return t


async def test_create_then_get_returns_a_copy_at_the_created_version(store: TaskStore) -> None:
    version = await store.create(task("a"))
    assert version >= 1
    got = await store.get("a")
    assert got is not None
    assert got.version == version
    got.task.status.state = S.TASK_STATE_FAILED
    again = await store.get("a")
    assert again is not None
    assert again.task.status.state == S.TASK_STATE_SUBMITTED
    assert await store.get("missing") is None


async def test_create_refuses_an_existing_id(store: TaskStore) -> None:
    await store.create(task("a"))
    with pytest.raises(TaskExistsError):
        await store.create(task("a"))


async def test_update_is_a_compare_and_set_on_the_version(store: TaskStore) -> None:
    v1 = await store.create(task("a"))
    v2 = await store.update(task("a", state=S.TASK_STATE_WORKING), v1)
    assert v2 > v1
    with pytest.raises(VersionConflictError):
        await store.update(task("a", state=S.TASK_STATE_WORKING), v1)
    with pytest.raises(UnknownTaskError):
        await store.update(task("zzz"), v2)


async def test_a_final_task_is_never_overwritten(store: TaskStore) -> None:
    v1 = await store.create(task("a"))
    v2 = await store.update(task("a", state=S.TASK_STATE_CANCELED), v1)
    with pytest.raises(FinalTaskError):
        await store.update(task("a", state=S.TASK_STATE_WORKING), v2)
    with pytest.raises(FinalTaskError):
        await store.update(task("a", state=S.TASK_STATE_WORKING), v1)
    got = await store.get("a")
    assert got is not None
    assert got.task.status.state == S.TASK_STATE_CANCELED


async def test_list_filters_pages_and_counts_most_recent_update_first(store: TaskStore) -> None:
    for i in range(7):
        await store.create(task(f"t{i}", context="even" if i % 2 == 0 else "odd"))
    first = await store.get("t0")
    assert first is not None
    await store.update(task("t0", context="even", state=S.TASK_STATE_WORKING), first.version)
    page = await store.list(TaskQuery(page_size=3))
    assert [t.id for t in page.tasks] == ["t0", "t6", "t5"]
    assert page.total_size == 7
    rest = await store.list(TaskQuery(page_size=10, page_token=page.next_page_token))
    assert [t.id for t in rest.tasks] == ["t4", "t3", "t2", "t1"]
    assert rest.next_page_token == ""
    odd = await store.list(TaskQuery(context_id="odd"))
    assert {t.id for t in odd.tasks} == {"t1", "t3", "t5"}
    working = await store.list(TaskQuery(state=S.TASK_STATE_WORKING))
    assert [t.id for t in working.tasks] == ["t0"]
    with pytest.raises(InvalidPageTokenError):
        await store.list(TaskQuery(page_token="not-a-token"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_store_keeps_at_most_max_final_tasks_oldest_evicted_first() -> None:
    store = InMemoryTaskStore(max_final_tasks=3, final_task_ttl=3600)
    for i in range(5):
        await store.create(task(f"t{i}", state=S.TASK_STATE_COMPLETED))
    assert [await store.get(f"t{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    await store.create(task("live"))
    assert len(store) == 4, "non-final tasks are never evicted"


async def test_memory_store_drops_final_tasks_after_their_ttl() -> None:
    clock = FakeClock()
    store = InMemoryTaskStore(max_final_tasks=100, final_task_ttl=60, clock=clock)
    await store.create(task("old", state=S.TASK_STATE_FAILED))
    await store.create(task("running"))
    clock.now += 61
    await store.create(task("new", state=S.TASK_STATE_COMPLETED))
    assert await store.get("old") is None
    assert await store.get("running") is not None
    assert await store.get("new") is not None


async def test_memory_store_size_stays_flat_under_sustained_load() -> None:
    store = InMemoryTaskStore(max_final_tasks=500, final_task_ttl=3600)
    for i in range(20_000):
        await store.create(task(f"t{i}"))
        await store.update(task(f"t{i}", state=S.TASK_STATE_COMPLETED), 1)
        assert len(store) <= 501
    assert len(store) == 500


async def test_a_handed_over_task_changed_and_updated_again_reads_back_each_version(
    store: TaskStore,
) -> None:
    live = task("a")
    v1 = await store.create(live)
    live.status.state = S.TASK_STATE_WORKING
    v2 = await store.update(live, v1)
    got = await store.get("a")
    assert got is not None
    assert (got.version, got.task.status.state) == (v2, S.TASK_STATE_WORKING)
    live.status.state = S.TASK_STATE_COMPLETED
    v3 = await store.update(live, v2)
    live.status.state = S.TASK_STATE_FAILED  # after a final write: must not show
    final = await store.get("a")
    assert final is not None
    assert (final.version, final.task.status.state) == (v3, S.TASK_STATE_COMPLETED)


async def test_a_task_updated_in_place_lists_by_its_new_state_time_and_recency(
    store: TaskStore,
) -> None:
    live = task("a")
    version = await store.create(live)
    await store.create(task("b"))
    live.status.state = S.TASK_STATE_WORKING
    live.status.timestamp.FromSeconds(4_000_000_000)  # later than any other task's
    await store.update(live, version)
    everything = await store.list(TaskQuery())
    assert [t.id for t in everything.tasks] == ["a", "b"], "most recently updated first"
    working = await store.list(TaskQuery(state=S.TASK_STATE_WORKING))
    assert [t.id for t in working.tasks] == ["a"]
    later = await store.list(TaskQuery(status_after_ns=4_000_000_000 * 10**9))
    assert [t.id for t in later.tasks] == ["a"]
    submitted = await store.list(TaskQuery(state=S.TASK_STATE_SUBMITTED))
    assert [t.id for t in submitted.tasks] == ["b"]

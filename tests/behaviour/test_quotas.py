"""Quotas per principal, each enforced while other callers proceed; and the transport settings
(a stream cut by the connection age limit resumes with the resume extension)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    ListTasksRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.app.service import grpc_options
from a2a_grpc_server._internal.journal import StoreUnavailableError
from a2a_grpc_server._internal.rpc.auth import TokenFile
from a2a_grpc_server._internal.rpc.resume import RESUME_AFTER_KEY
from tests.support.agents import AskWhenReleased, InputAgent, StepAgent
from tests.support.harness import (
    ALICE,
    BOB,
    RESUME,
    V1,
    Harness,
    error_of,
    rich_status,
    send_request,
    seq_of,
    serve,
    tokens,
)

S = TaskState


def config(
    *, live: int = 0, parked: int = 0, streams: int = 0, subscribers: int = 0
) -> ServerConfig:
    """Only the quotas given (0: off)."""
    return ServerConfig(
        cancel_timeout=1.0,
        quota_live_tasks=live,
        quota_parked_tasks=parked,
        quota_streams=streams,
        quota_subscribers=subscribers,
    )


async def refused(attempt: Any, reason: str) -> None:
    """The call fails RESOURCE_EXHAUSTED, its ErrorInfo naming the quota."""
    error = await error_of(attempt)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _, info = rich_status(error)
    assert info.reason == reason
    assert info.metadata["quota"] in (error.details() or "")


async def count_tasks(h: Harness, metadata: Any) -> int:
    return int((await h.stub.ListTasks(ListTasksRequest(), metadata=metadata)).total_size)


async def parked(h: Harness, metadata: Any) -> str:
    task = (await h.stub.SendMessage(send_request("hi"), metadata=metadata)).task
    assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
    return str(task.id)


async def test_live_tasks_quota(tmp_path: Path) -> None:
    auth = tokens(tmp_path)
    async with asyncio.timeout(20), serve(InputAgent(), config(live=2), auth=auth) as h:
        first = await parked(h, ALICE)
        await parked(h, ALICE)
        await refused(h.stub.SendMessage(send_request("hi"), metadata=ALICE), "LIVE_TASKS_QUOTA")
        assert await count_tasks(h, ALICE) == 2, "the refused message made no task"
        await parked(h, BOB)  # another principal is not held up
        done = await h.stub.SendMessage(send_request("me", task_id=first), metadata=ALICE)
        assert done.task.status.state == S.TASK_STATE_COMPLETED  # a follow-up is never refused
        await parked(h, ALICE)  # one ended: room again


async def test_parked_tasks_quota(tmp_path: Path) -> None:
    auth = tokens(tmp_path)
    async with (
        asyncio.timeout(20),
        serve(InputAgent(), config(parked=1), auth=auth) as h,
    ):
        first = await parked(h, ALICE)
        await refused(h.stub.SendMessage(send_request("hi"), metadata=ALICE), "PARKED_TASKS_QUOTA")
        await parked(h, BOB)
        await h.stub.SendMessage(send_request("me", task_id=first), metadata=ALICE)
        await parked(h, ALICE)


async def test_streams_quota(tmp_path: Path) -> None:
    auth = tokens(tmp_path)
    async with asyncio.timeout(20), serve(InputAgent(), config(streams=2), auth=auth) as h:
        mine, theirs = await parked(h, ALICE), await parked(h, BOB)
        streams = []
        for metadata, task_id in ((ALICE, mine), (ALICE, mine), (BOB, theirs)):
            stream = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=metadata)
            assert (await stream.read()).task.id == task_id
            streams.append(stream)
        await refused(
            h.stub.SubscribeToTask(SubscribeToTaskRequest(id=mine), metadata=ALICE),
            "STREAMS_QUOTA",
        )
        await refused(
            h.stub.SendStreamingMessage(send_request("hi"), metadata=ALICE), "STREAMS_QUOTA"
        )
        assert await count_tasks(h, ALICE) == 1, "the refused stream made no task"
        streams[0].cancel()
        await h.service.servicer.wait_streams_closed(at_most=2)
        again = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=mine), metadata=ALICE)
        assert (await again.read()).task.id == mine
        for stream in (*streams[1:], again):
            stream.cancel()


async def test_subscribers_quota(tmp_path: Path) -> None:
    auth = tokens(tmp_path)
    async with (
        asyncio.timeout(20),
        serve(InputAgent(), config(subscribers=2), auth=auth) as h,
    ):
        task_id, other = await parked(h, ALICE), await parked(h, ALICE)
        streams = []
        for _ in range(2):
            stream = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=ALICE)
            await stream.read()
            streams.append(stream)
        await refused(
            h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=ALICE),
            "SUBSCRIBERS_QUOTA",
        )
        elsewhere = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=other), metadata=ALICE)
        assert (await elsewhere.read()).task.id == other
        for stream in (*streams, elsewhere):
            stream.cancel()


def test_transport_settings_become_grpc_options() -> None:
    options = dict(grpc_options(ServerConfig()))
    assert options["grpc.max_concurrent_streams"] == 1000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
    assert "grpc.max_connection_age_ms" not in options, "off by default"
    aged = dict(grpc_options(ServerConfig(grpc_max_connection_age=60, grpc_max_connection_idle=0)))
    assert (aged["grpc.max_connection_age_ms"], aged["grpc.max_connection_age_grace_ms"]) == (
        60_000,
        300_000,
    )
    assert "grpc.max_connection_idle_ms" not in aged
    with pytest.raises(ValueError, match="quotas"):
        ServerConfig(quota_streams=-1)


async def test_a_stream_cut_by_the_connection_age_limit_resumes_where_it_was() -> None:
    agent = StepAgent()
    aged = ServerConfig(
        cancel_timeout=1.0, grpc_max_connection_age=0.5, grpc_max_connection_age_grace=0.5
    )
    async with asyncio.timeout(30), serve(agent, aged) as h:
        stream = h.stub.SendStreamingMessage(send_request("go"), metadata=RESUME)
        frames: list[StreamResponse] = [await stream.read()]
        task_id = frames[0].task.id
        agent.step(2)
        cut = await error_of(stream, frames)
        assert cut.code() == grpc.StatusCode.UNAVAILABLE  # after the age limit and its grace
        last = seq_of(frames[-1])
        agent.step(1)
        agent.finish()
        resumed = h.stub.SubscribeToTask(
            SubscribeToTaskRequest(id=task_id),
            metadata=(*RESUME, (RESUME_AFTER_KEY, str(last))),
        )
        rest = [frame async for frame in resumed]
        seqs = [seq_of(f) for f in frames[1:] + rest]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "no gap, no duplicate"
        assert rest[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        updates = [f.artifact_update.artifact.artifact_id for f in frames + rest]
        artifacts = [artifact_id for artifact_id in updates if artifact_id]
        assert artifacts == ["step-0", "step-1", "step-2"]


async def test_a_new_task_that_fails_before_its_run_gives_its_slot_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ServerConfig(cancel_timeout=1.0, quota_live_tasks=1, push_allow_private=True)
    async with asyncio.timeout(20), serve(InputAgent(), config, auth=tokens(tmp_path)) as h:
        push = h.service.push
        assert push is not None

        async def unavailable(*args: object, **kwargs: object) -> None:
            raise StoreUnavailableError("push store down")  # (NATS down, in cluster mode)

        with monkeypatch.context() as patch:
            patch.setattr(push.store, "put", unavailable)
            request = send_request("hi")
            request.configuration.task_push_notification_config.CopyFrom(
                TaskPushNotificationConfig(url="http://127.0.0.1:9/hook")
            )
            failed = await error_of(h.stub.SendMessage(request, metadata=ALICE))
            assert failed.code() == grpc.StatusCode.UNAVAILABLE
        assert await count_tasks(h, ALICE) == 0
        assert h.service.engine.tasks.count == 0, "nothing of the failed task is left"
        await parked(h, ALICE)  # the quota's one slot is free


async def test_over_long_tenants_and_principals_are_refused(tmp_path: Path) -> None:
    names = tmp_path / "long-names"
    names.write_text(f"{'p' * 257}:long-token\n")
    with pytest.raises(ValueError, match="has 257 characters"):  # refused as the file loads
        TokenFile(names)
    async with asyncio.timeout(20), serve(InputAgent(), auth=tokens(tmp_path)) as h:
        long_tenant = send_request("hi")
        long_tenant.tenant = "t" * 257
        failed = await error_of(h.stub.SendMessage(long_tenant, metadata=ALICE))
        assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tenant" in (failed.details() or "")


def many(tmp_path: Path, names: list[str]) -> tuple[TokenFile, dict[str, Any]]:
    """A tokens file for ``names``, and each one's call metadata."""
    path = tmp_path / "many-tokens"
    path.write_text("".join(f"{n}:{n}-token\n" for n in names))
    return TokenFile(path), {n: (*V1, ("authorization", f"Bearer {n}-token")) for n in names}


async def test_the_live_task_limit_is_shared_fairly_among_principals(tmp_path: Path) -> None:
    # Within their quotas (100 each), principals could take every live task of the
    # instance (8). Once half is taken, each gets at most its fair share: the other half
    # split among the principals holding some (issue 22).
    names = ["alice", "bob", "carol", "dave", "erin"]
    auth, who = many(tmp_path, names)
    limits = ServerConfig(cancel_timeout=1.0, quota_live_tasks=100, max_live_tasks=8)
    async with asyncio.timeout(30), serve(InputAgent(), limits, auth=auth) as h:
        for _ in range(4):  # alone, alice reaches half of the limit...
            await parked(h, who["alice"])
        request = send_request("hi")
        await refused(h.stub.SendMessage(request, metadata=who["alice"]), "LIVE_TASKS_FAIR_SHARE")
        for _ in range(2):  # ...and newcomers still get in: bob's share is 8 // (2 * 2)
            await parked(h, who["bob"])
        await refused(h.stub.SendMessage(request, metadata=who["bob"]), "LIVE_TASKS_FAIR_SHARE")
        await parked(h, who["carol"])  # 8 // (2 * 3) = 1
        await parked(h, who["dave"])  # 8 // (2 * 4) = 1
        await refused(h.stub.SendMessage(request, metadata=who["erin"]), "LIVE_TASKS_LIMIT")
        assert h.service.engine.tasks.quotas.live_total == 8


async def test_the_anonymous_principal_has_the_whole_instance() -> None:
    limits = ServerConfig(cancel_timeout=1.0, max_live_tasks=4)
    async with asyncio.timeout(30), serve(InputAgent(), limits) as h:
        for _ in range(4):
            await parked(h, V1)
        await refused(h.stub.SendMessage(send_request("hi"), metadata=V1), "LIVE_TASKS_LIMIT")


async def test_parked_tasks_of_a_few_principals_do_not_block_the_others(tmp_path: Path) -> None:
    # In memory, max_parked_tasks refuses every new task once reached: three principals
    # parking their quota used to make everyone else's new task fail PARKED_TASKS_LIMIT.
    names = ["alice", "bob", "carol", "dave"]
    auth, who = many(tmp_path, names)
    limits = ServerConfig(cancel_timeout=1.0, quota_parked_tasks=100, max_parked_tasks=12)
    async with asyncio.timeout(30), serve(InputAgent(), limits, auth=auth) as h:
        request = send_request("hi")
        for name, share in (("alice", 6), ("bob", 3), ("carol", 2)):  # 12 // (2 * holders)
            for _ in range(share):
                await parked(h, who[name])
            await refused(
                h.stub.SendMessage(request, metadata=who[name]), "PARKED_TASKS_FAIR_SHARE"
            )
        assert h.service.engine.tasks.parking.count < 12, "the three did not fill it"
        await parked(h, who["dave"])  # someone else still gets in


async def test_open_streams_are_shared_fairly(tmp_path: Path) -> None:
    auth, who = many(tmp_path, ["alice", "bob", "carol", "dave"])
    limits = ServerConfig(cancel_timeout=1.0, quota_streams=100, max_streams=4)
    async with asyncio.timeout(30), serve(InputAgent(), limits, auth=auth) as h:
        tasks = {name: await parked(h, metadata) for name, metadata in who.items()}
        streams = []

        def subscribe(name: str) -> Any:
            request = SubscribeToTaskRequest(id=tasks[name])
            return h.stub.SubscribeToTask(request, metadata=who[name])

        for name in ("alice", "alice", "bob", "carol"):  # contended from the third on
            stream = subscribe(name)
            assert (await stream.read()).task.id == tasks[name], name
            streams.append(stream)
        await refused(subscribe("alice"), "STREAMS_LIMIT")
        streams.pop().cancel()  # carol's: 3 of 4 open, contended; alice is past her share
        await h.service.servicer.wait_streams_closed(at_most=3)
        await refused(subscribe("alice"), "STREAMS_FAIR_SHARE")
        await refused(subscribe("bob"), "STREAMS_FAIR_SHARE")  # 4 // (2 * 2): he holds 1
        stream = subscribe("dave")  # a newcomer below his share gets in
        assert (await stream.read()).task.id == tasks["dave"]
        streams.append(stream)
        for stream in streams:
            stream.cancel()


async def test_tasks_brought_back_into_memory_count_against_the_limit() -> None:
    # Waiting tasks that left memory count nowhere; a follow-up to each, all at once,
    # used to bring every one of them back past max_live_tasks (issue 22).
    limits = ServerConfig(cancel_timeout=1.0, max_live_tasks=2)
    async with asyncio.timeout(30), serve(InputAgent(), limits) as h:
        gone = [await parked(h, V1) for _ in range(2)]
        assert h.service.engine.tasks.parking.evict_idle(now=float("inf")) == 2
        here = [await parked(h, V1) for _ in range(2)]  # the limit, in memory
        follow_up = send_request("Ada", task_id=gone[0])
        await refused(h.stub.SendMessage(follow_up, metadata=V1), "LIVE_TASKS_LIMIT")
        done = await h.stub.SendMessage(send_request("Ada", task_id=here[0]), metadata=V1)
        assert done.task.status.state == S.TASK_STATE_COMPLETED, "one in memory goes on"
        again = await h.stub.SendMessage(follow_up, metadata=V1)  # room again: it comes back
        assert again.task.status.state == S.TASK_STATE_COMPLETED


async def asked(h: Harness, agent: AskWhenReleased, texts: list[str], metadata: Any) -> list[Any]:
    """Start a task per text (all WORKING at once), then have each ask for input in turn;
    return each task's status when its SendMessage answered."""
    calls = []
    for text in texts:
        calls.append(h.stub.SendMessage(send_request(text), metadata=metadata))  # (under way)
        await agent.working(text).wait()
    statuses = []
    for text, call in zip(texts, calls, strict=True):
        agent.release(text)
        statuses.append((await call).task)
    return statuses


async def test_tasks_that_ask_for_input_later_are_held_to_the_fair_share(tmp_path: Path) -> None:
    # The share of max_parked_tasks was checked only when a task was created: alice's tasks,
    # all created while none waited, then all parked past it (issue 22). Now a task that
    # would wait past it ends FAILED, saying why, and the share holds.
    auth, who = many(tmp_path, ["alice", "bob"])
    limits = ServerConfig(cancel_timeout=1.0, quota_parked_tasks=100, max_parked_tasks=4)
    agent = AskWhenReleased()
    async with asyncio.timeout(30), serve(agent, limits, auth=auth) as h:
        tasks = await asked(h, agent, ["a0", "a1", "a2", "a3"], who["alice"])
        states = [task.status.state for task in tasks]
        waiting, failed = S.TASK_STATE_INPUT_REQUIRED, S.TASK_STATE_FAILED
        assert states == [waiting, waiting, failed, failed]  # her share: 4 // (2 * 1)
        why = tasks[2].status.message.parts[0].text
        assert "PARKED_TASKS_FAIR_SHARE" in why and "max_parked_tasks" in why
        recorded = await h.stub.GetTask(GetTaskRequest(id=tasks[3].id), metadata=who["alice"])
        assert recorded.status.state == failed
        parking = h.service.engine.tasks.parking
        assert parking.count == 2 and parking.count_of("alice") == 2
        (bobs,) = await asked(h, agent, ["b0"], who["bob"])  # below his share, he waits
        assert bobs.status.state == waiting
        follow_up = send_request("Ada", task_id=tasks[0].id)  # hers go on as before
        done = await h.stub.SendMessage(follow_up, metadata=who["alice"])
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        assert parking.count == 2


async def test_tasks_that_ask_for_input_later_are_held_to_max_parked_tasks() -> None:
    limits = ServerConfig(cancel_timeout=1.0, max_parked_tasks=2)
    agent = AskWhenReleased()
    async with asyncio.timeout(30), serve(agent, limits) as h:
        tasks = await asked(h, agent, ["t0", "t1", "t2"], V1)
        states = [task.status.state for task in tasks]
        assert states == [S.TASK_STATE_INPUT_REQUIRED] * 2 + [S.TASK_STATE_FAILED]
        assert "PARKED_TASKS_LIMIT" in tasks[2].status.message.parts[0].text
        assert h.service.engine.tasks.parking.count == 2
        done = await h.stub.SendMessage(send_request("Ada", task_id=tasks[0].id), metadata=V1)
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        (again,) = await asked(h, agent, ["t3"], V1)  # one was continued: room again
        assert again.status.state == S.TASK_STATE_INPUT_REQUIRED

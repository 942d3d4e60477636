"""v1.1 long-polls (GetTask with ``current_generation``) are held like streams (issue 42, hole 3).

A waiting poll counts against its caller's ``quota_streams``, the instance's ``max_streams``
and the fair share of it; a refused poll answers RESOURCE_EXHAUSTED with the quota's reason.
Polls of one task have ``quota_subscribers`` slots of their own, so a SubscribeToTask is
never refused because of them, and a burst never holds more. A poll answers with the task
before its caller's deadline, alone (gRPC's timeout header reads a little long) and in a
burst sharing one deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.model import generation
from a2a_grpc_server._internal.rpc.auth import TokenFile
from tests.support.agents import InputAgent
from tests.support.harness import (
    ALICE,
    BOB,
    V1,
    Harness,
    error_of,
    read_all,
    rich_status,
    send_request,
    serve,
    tokens,
    varint,
)

S = TaskState
GET_TASK = "/lf.a2a.v1.A2AService/GetTask"
Polls = list["asyncio.Future[Task]"]


def poll(h: Harness, task_id: str, current: int, metadata: Any, timeout: float) -> Any:
    """A GetTask call that waits for the task to move past ``current`` (v1.1's long-poll)."""
    request = poll_request(task_id, current)
    call = h.channel.unary_unary(
        GET_TASK, request_serializer=lambda b: b, response_deserializer=Task.FromString
    )
    return asyncio.ensure_future(call(request, metadata=metadata, timeout=timeout))


def poll_request(task_id: str, current: int) -> bytes:
    """A GetTaskRequest with v1.1's ``current_generation`` (field 4), on the v1.0 types."""
    field = varint(generation.CURRENT_FIELD << 3) + varint(current)
    return GetTaskRequest(id=task_id).SerializeToString() + field


async def waiting_task(h: Harness, metadata: Any = V1) -> tuple[str, int]:
    """A new task waiting for input, and its generation."""
    task = (await h.stub.SendMessage(send_request("hi"), metadata=metadata)).task
    assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
    current = generation.generation_of(task)
    assert current is not None
    return task.id, current


async def follow_up(h: Harness, task_id: str, metadata: Any = V1) -> None:
    """Complete a waiting task (InputAgent completes on the follow-up)."""
    answer = await h.stub.SendMessage(send_request("ada", task_id=task_id), metadata=metadata)
    assert answer.task.status.state == S.TASK_STATE_COMPLETED


def refusal(done: asyncio.Future[Task]) -> str:
    """The ErrorInfo reason of a RESOURCE_EXHAUSTED poll (fails on anything else)."""
    error = done.exception()
    assert isinstance(error, grpc.aio.AioRpcError), f"answered, not refused: {done}"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    return rich_status(error)[1].reason


async def first_refused(polls: Polls, within: float) -> str:
    """The reason the first poll to finish was refused with (it must finish ``within`` s)."""
    done, _ = await asyncio.wait(polls, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, f"{len(done)} polls finished at once; expected one refused at once"
    return refusal(done.pop())


async def moved(polls: Iterable[asyncio.Future[Task]], past: int) -> None:
    """Every poll answers with the task moved past ``past`` (it completed)."""
    for task in await asyncio.gather(*polls):
        assert task.status.state == S.TASK_STATE_COMPLETED
        assert (generation.generation_of(task) or 0) > past


async def refused_stream(call: Any, reason: str) -> None:
    """A stream call ends RESOURCE_EXHAUSTED with ``reason`` before any frame."""
    error = await error_of(call)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rich_status(error)[1].reason == reason


async def test_a_callers_long_polls_count_against_its_stream_quota(tmp_path: Path) -> None:
    limits = ServerConfig(cancel_timeout=1.0, quota_streams=3)
    async with asyncio.timeout(30), serve(InputAgent(), limits, auth=tokens(tmp_path)) as h:
        (mine, at), (theirs, _) = await waiting_task(h, ALICE), await waiting_task(h, BOB)
        stream = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=mine), metadata=ALICE)
        frames: list[StreamResponse] = [await stream.read()]
        polls = [poll(h, mine, at, ALICE, timeout=5) for _ in range(3)]
        assert await first_refused(polls, within=3) == "STREAMS_QUOTA"
        waiting = [p for p in polls if not p.done()]
        assert len(waiting) == 2, "a stream and two polls: her three"
        again = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=mine), metadata=ALICE)
        await refused_stream(again, "STREAMS_QUOTA")
        other = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=theirs), metadata=BOB)
        assert (await other.read()).task.id == theirs, "another caller is not held up"
        other.cancel()
        await follow_up(h, mine, ALICE)
        await moved(waiting, past=at)
        await read_all(stream, frames)


async def test_long_polls_count_against_max_streams() -> None:
    limits = ServerConfig(cancel_timeout=1.0, max_streams=2)
    async with asyncio.timeout(30), serve(InputAgent(), limits) as h:
        task_id, at = await waiting_task(h)
        polls = [poll(h, task_id, at, V1, timeout=5) for _ in range(3)]
        assert await first_refused(polls, within=3) == "STREAMS_LIMIT"
        stream = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        await refused_stream(stream, "STREAMS_LIMIT")
        await follow_up(h, task_id)
        await moved([p for p in polls if not p.done()], past=at)


async def test_long_polls_are_held_to_the_fair_share_of_max_streams(tmp_path: Path) -> None:
    path = tmp_path / "many-tokens"
    path.write_text("".join(f"{n}:{n}-token\n" for n in ("alice", "bob", "carol")))
    who = {n: (*V1, ("authorization", f"Bearer {n}-token")) for n in ("alice", "bob", "carol")}
    limits = ServerConfig(cancel_timeout=1.0, quota_streams=100, max_streams=4)
    async with asyncio.timeout(30), serve(InputAgent(), limits, auth=TokenFile(path)) as h:
        tasks = {name: await waiting_task(h, metadata) for name, metadata in who.items()}
        streams = []
        for name in ("alice", "alice", "bob", "carol"):  # contended from the third on
            request = SubscribeToTaskRequest(id=tasks[name][0])
            stream = h.stub.SubscribeToTask(request, metadata=who[name])
            assert (await stream.read()).task.id == tasks[name][0]
            streams.append(stream)
        alice_id, alice_at = tasks["alice"]
        assert refusal(await _done(poll(h, alice_id, alice_at, who["alice"], 5))) == (
            "STREAMS_LIMIT"
        )
        streams.pop().cancel()  # carol's: 3 of 4 open; alice (2) is past her share (1)
        await h.service.servicer.wait_streams_closed(at_most=3)
        assert refusal(await _done(poll(h, alice_id, alice_at, who["alice"], 5))) == (
            "STREAMS_FAIR_SHARE"
        )
        for stream in streams:
            stream.cancel()


async def _done(call: asyncio.Future[Task], within: float = 3) -> asyncio.Future[Task]:
    """``call`` once it finished (it must within ``within`` s, well before its deadline)."""
    done, _ = await asyncio.wait([call], timeout=within)
    assert done, "the poll waits: it was not refused"
    return call


async def test_a_subscriber_is_accepted_while_the_tasks_poll_slots_are_full() -> None:
    limits = ServerConfig(cancel_timeout=1.0, quota_subscribers=2)
    async with asyncio.timeout(30), serve(InputAgent(), limits) as h:
        task_id, at = await waiting_task(h)
        polls = [poll(h, task_id, at, V1, timeout=5) for _ in range(3)]
        done, _ = await asyncio.wait(polls, timeout=3, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "two polls wait, the third has no slot"
        as_it_is = done.pop().result()
        assert generation.generation_of(as_it_is) == at, "no slot: the task as it is"
        stream = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        frames: list[StreamResponse] = [await stream.read()]
        assert frames[0].task.id == task_id, "polls do not take the subscribers' slots"
        await follow_up(h, task_id)
        await moved([p for p in polls if p is not as_it_is and not p.done()], past=at)
        await read_all(stream, frames)
        assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED


async def test_a_burst_of_polls_never_holds_more_than_the_tasks_slots() -> None:
    slots, burst = 64, 100
    limits = ServerConfig(cancel_timeout=1.0, quota_subscribers=slots)
    async with asyncio.timeout(30), serve(InputAgent(), limits) as h:
        task_id, at = await waiting_task(h)
        polls = [poll(h, task_id, at, V1, timeout=8) for _ in range(burst)]
        answered = 0
        async with asyncio.timeout(5):  # those without a slot answer at once, as it is
            for next_done in asyncio.as_completed(polls):
                task = await next_done
                assert generation.generation_of(task) == at
                answered += 1
                if answered == burst - slots:
                    break
        await follow_up(h, task_id)
        tasks = await asyncio.gather(*polls)
        changed = [t for t in tasks if (generation.generation_of(t) or 0) > at]
        assert len(changed) == slots, f"{len(changed)} polls waited for {slots} slots"


async def test_a_long_poll_with_a_ten_second_deadline_answers_with_the_task() -> None:
    # gRPC's timeout header reads up to 1 % long (10 s reads as 10.1 s): a server that
    # answers 50 ms before the deadline it reads answers after the caller gave up.
    async with asyncio.timeout(20), serve(InputAgent()) as h:
        task_id, at = await waiting_task(h)
        task = await poll(h, task_id, at, V1, timeout=10)
        assert generation.generation_of(task) == at
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED


async def test_a_burst_of_polls_sharing_one_deadline_is_answered_in_time() -> None:
    # 960 polls (of the anonymous caller's 1000 streams), on two connections (each takes
    # at most 1000 calls at once), all ending at the same moment: each must be answered.
    burst, tasks = 960, 4
    async with asyncio.timeout(20), serve(InputAgent()) as h:
        waiting = [await waiting_task(h) for _ in range(tasks)]
        channels = [
            grpc.aio.insecure_channel(h.address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(2)
        ]
        try:
            calls = [
                c.unary_unary(
                    GET_TASK, request_serializer=lambda b: b, response_deserializer=Task.FromString
                )
                for c in channels
            ]
            results = await asyncio.gather(
                *(
                    calls[i % 2](poll_request(*waiting[i % tasks]), metadata=V1, timeout=2)
                    for i in range(burst)
                ),
                return_exceptions=True,
            )
        finally:
            for channel in channels:
                await channel.close()
        late = [r for r in results if not isinstance(r, Task)]
        assert not late, f"{len(late)} of {burst} not answered in time: {late[0]!r}"

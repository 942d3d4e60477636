"""Each RPC's contract, through a2a-sdk's gRPC client and the generated stubs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import TaskNotCancelableError, TaskNotFoundError, UnsupportedOperationError

from a2a_grpc_server import ServerConfig
from a2a_grpc_server.agents.echo import EchoAgent
from tests.support.agents import CallerAgent, GatedAgent, InputAgent, MessageAgent, TaskFirstAgent
from tests.support.harness import V1, kinds, last_state, send_request, serve, user_message

S = TaskState


async def test_blocking_send_returns_the_completed_task_with_artifacts_and_history() -> None:
    async with asyncio.timeout(10), serve(EchoAgent()) as h:
        response = await h.client.send_message(send_request("ping"))
        task = response.task
        assert task.status.state == S.TASK_STATE_COMPLETED
        assert task.artifacts[0].parts[0].text == "ping"
        assert task.history[0].parts[0].text == "ping"
        assert task.status.message.parts[0].text == "ping"
        await h.settle()


async def test_return_immediately_answers_before_the_task_ends() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        response = await h.client.send_message(send_request("go", immediately=True))
        assert response.task.status.state in (S.TASK_STATE_SUBMITTED, S.TASK_STATE_WORKING)
        sub = h.client.subscribe(SubscribeToTaskRequest(id=response.task.id))
        await anext(sub)
        agent.release.set()
        frames = await _collect(sub)
        assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        await h.settle()


async def test_executor_answering_with_a_message_gets_a_message_only_response_and_stream() -> None:
    async with asyncio.timeout(10), serve(MessageAgent()) as h:
        response = await h.client.send_message(send_request("hi"))
        assert response.WhichOneof("payload") == "message"
        assert response.message.parts[0].text == "you said hi"
        frames = [f async for f in h.client.send_message_streaming(send_request("yo"))]
        assert kinds(frames) == ["message"]
        listed = await h.client.list_tasks(ListTasksRequest())
        assert listed.total_size == 0, "a message-only answer creates no task"
        await h.settle()


@pytest.mark.parametrize("with_history", [True, False])
async def test_executor_enqueuing_the_task_first_streams_one_task_frame_then_updates(
    with_history: bool,
) -> None:
    async with asyncio.timeout(10), serve(TaskFirstAgent(with_history=with_history)) as h:
        frames = [f async for f in h.client.send_message_streaming(send_request("t"))]
        assert kinds(frames) == [
            f"task:{S.TASK_STATE_SUBMITTED}",
            "artifact_update",
            f"status:{S.TASK_STATE_COMPLETED}",
        ]
        task = await h.client.get_task(GetTaskRequest(id=frames[0].task.id))
        assert [m.parts[0].text for m in task.history] == ["t"]
        await h.settle()


async def test_follow_up_with_only_task_id_continues_the_task_and_keeps_its_context() -> None:
    async with asyncio.timeout(10), serve(InputAgent()) as h:
        first = await h.client.send_message(send_request("hi"))
        task = first.task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        follow = await h.client.send_message(send_request("Ada", task_id=task.id))
        assert follow.task.id == task.id
        assert follow.task.context_id == task.context_id
        assert follow.task.status.state == S.TASK_STATE_COMPLETED
        assert follow.task.status.message.parts[0].text == "hello Ada"
        texts = [m.parts[0].text for m in follow.task.history]
        assert texts == ["hi", "your name?", "Ada"]
        await h.settle()


@pytest.mark.parametrize("ask", [S.TASK_STATE_INPUT_REQUIRED, S.TASK_STATE_AUTH_REQUIRED])
async def test_streaming_send_ends_when_interrupted_but_subscribe_stays_open(
    ask: TaskState,
) -> None:
    async with asyncio.timeout(10), serve(InputAgent(ask)) as h:
        frames = [f async for f in h.client.send_message_streaming(send_request("hi"))]
        assert kinds(frames)[-1] == f"status:{ask}"
        task_id = frames[0].task.id
        sub = h.client.subscribe(SubscribeToTaskRequest(id=task_id))
        snapshot = await anext(sub)
        assert snapshot.task.status.state == ask
        rest = asyncio.ensure_future(_collect(sub))
        follow = [
            f async for f in h.client.send_message_streaming(send_request("Bob", task_id=task_id))
        ]
        assert follow[0].task.status.state == ask
        assert kinds(follow)[-1] == f"status:{S.TASK_STATE_COMPLETED}"
        tail = await rest
        assert tail == follow[1:], "the subscriber saw the follow-up's frames too"
        await h.settle()


async def _collect(stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
    return [f async for f in stream]


async def test_get_task_trims_history_to_history_length() -> None:
    async with asyncio.timeout(10), serve(InputAgent()) as h:
        task = (await h.client.send_message(send_request("hi"))).task
        full = await h.client.get_task(GetTaskRequest(id=task.id))
        assert len(full.history) == 1
        assert full.status.message.parts[0].text == "your name?"
        await h.client.send_message(send_request("Ada", task_id=task.id))
        assert len((await h.client.get_task(GetTaskRequest(id=task.id))).history) == 3
        one = await h.client.get_task(GetTaskRequest(id=task.id, history_length=1))
        assert [m.parts[0].text for m in one.history] == ["Ada"]
        none = await h.client.get_task(GetTaskRequest(id=task.id, history_length=0))
        assert len(none.history) == 0
        await h.settle()


async def test_list_tasks_pages_newest_first_with_filters_and_total_size() -> None:
    async with asyncio.timeout(10), serve(EchoAgent()) as h:
        ids = []
        for i in range(5):
            ctx = "ctx-a" if i % 2 == 0 else "ctx-b"
            ids.append((await h.client.send_message(send_request(f"m{i}", context_id=ctx))).task.id)
        page1 = await h.client.list_tasks(ListTasksRequest(page_size=2))
        assert page1.total_size == 5 and page1.page_size == 2
        assert [t.id for t in page1.tasks] == ids[::-1][:2]
        assert all(len(t.artifacts) == 0 for t in page1.tasks), "artifacts only on request"
        page2 = await h.client.list_tasks(
            ListTasksRequest(page_size=2, page_token=page1.next_page_token)
        )
        page3 = await h.client.list_tasks(
            ListTasksRequest(page_size=2, page_token=page2.next_page_token)
        )
        assert [t.id for t in [*page2.tasks, *page3.tasks]] == ids[::-1][2:]
        assert page3.next_page_token == ""
        only_a = await h.client.list_tasks(
            ListTasksRequest(context_id="ctx-a", include_artifacts=True)
        )
        assert only_a.total_size == 3
        assert all(t.artifacts for t in only_a.tasks)
        working = await h.client.list_tasks(ListTasksRequest(status=S.TASK_STATE_WORKING))
        assert working.total_size == 0
        trimmed = await h.client.list_tasks(ListTasksRequest(history_length=0))
        assert all(len(t.history) == 0 for t in trimmed.tasks)


async def test_unknown_task_is_not_found_everywhere() -> None:
    async with asyncio.timeout(10), serve(EchoAgent()) as h:
        with pytest.raises(TaskNotFoundError):
            await h.client.get_task(GetTaskRequest(id="nope"))
        with pytest.raises(TaskNotFoundError):
            await h.client.cancel_task(CancelTaskRequest(id="nope"))
        with pytest.raises(TaskNotFoundError):
            [f async for f in h.client.subscribe(SubscribeToTaskRequest(id="nope"))]
        with pytest.raises(TaskNotFoundError):
            await h.client.send_message(send_request("x", task_id="nope"))


async def test_terminal_task_refuses_cancel_subscribe_and_messages() -> None:
    async with asyncio.timeout(10), serve(EchoAgent()) as h:
        task = (await h.client.send_message(send_request("x"))).task
        with pytest.raises(TaskNotCancelableError):
            await h.client.cancel_task(CancelTaskRequest(id=task.id))
        with pytest.raises(UnsupportedOperationError):
            [f async for f in h.client.subscribe(SubscribeToTaskRequest(id=task.id))]
        with pytest.raises(UnsupportedOperationError):
            await h.client.send_message(send_request("again", task_id=task.id))


async def test_message_to_a_working_task_is_refused_and_the_task_is_unaffected() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        task = (await h.client.send_message(send_request("go", immediately=True))).task
        await agent.working.wait()
        with pytest.raises(UnsupportedOperationError):
            await h.client.send_message(send_request("more", task_id=task.id))
        sub = h.client.subscribe(SubscribeToTaskRequest(id=task.id))
        assert (await anext(sub)).task.status.state == S.TASK_STATE_WORKING
        agent.release.set()
        frames = await _collect(sub)
        assert kinds(frames) == ["artifact_update", f"status:{S.TASK_STATE_COMPLETED}"]
        await h.settle()


async def test_cancel_of_an_interrupted_task_ends_its_subscribers_canceled() -> None:
    async with asyncio.timeout(10), serve(InputAgent(), ServerConfig(cancel_timeout=1)) as h:
        task = (await h.client.send_message(send_request("hi"))).task
        sub = h.client.subscribe(SubscribeToTaskRequest(id=task.id))
        await anext(sub)
        rest = asyncio.ensure_future(_collect(sub))
        canceled = await h.client.cancel_task(CancelTaskRequest(id=task.id))
        assert canceled.status.state == S.TASK_STATE_CANCELED
        frames = await rest
        assert frames[-1].status_update.status.state == S.TASK_STATE_CANCELED
        await h.settle()


async def test_stub_client_without_version_metadata_is_served_as_0_3_except_v1_only_rpcs() -> None:
    async with asyncio.timeout(10), serve(EchoAgent()) as h:
        response = await h.stub.SendMessage(send_request("old client"))
        assert response.task.status.state == S.TASK_STATE_COMPLETED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.stub.ListTasks(ListTasksRequest())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        ok = await h.stub.ListTasks(ListTasksRequest(), metadata=V1)
        assert ok.total_size == 1


async def test_executor_sees_the_callers_metadata_and_extensions() -> None:
    agent = CallerAgent()
    metadata = (
        *V1,
        ("x-team", "blue"),
        ("a2a-extensions", "urn:a, urn:b"),
        ("a2a-extensions", "urn:c"),
        ("x-blob-bin", b"\x00\x01"),
    )
    async with asyncio.timeout(10), serve(agent) as h:
        asked = await h.stub.SendMessage(send_request("who"), metadata=metadata)
        assert asked.task.status.state == S.TASK_STATE_INPUT_REQUIRED
        done = await h.stub.SendMessage(
            send_request("me", task_id=asked.task.id), metadata=(*V1, ("x-team", "red"))
        )
        assert done.task.status.state == S.TASK_STATE_COMPLETED
        [(headers, extensions, tenant, same_object), (follow_up, none, _, _)] = agent.seen
        assert headers["x-team"] == "blue" and headers["a2a-version"] == "1.0"
        assert "x-blob-bin" not in headers
        assert extensions == {"urn:a", "urn:b", "urn:c"}
        assert tenant == ""
        assert same_object  # one ServerCallContext per call, however often it is read
        assert follow_up["x-team"] == "red" and none == set()
        await h.settle()


async def test_a_task_parked_in_execute_keeps_one_asyncio_task_and_no_queued_event() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        parked = await h.client.send_message(send_request("wait", immediately=True))
        task_id = parked.task.id
        sub = h.client.subscribe(SubscribeToTaskRequest(id=task_id))
        frame = await anext(sub)  # WORKING is persisted and broadcast once it is seen
        while last_state([frame]) != S.TASK_STATE_WORKING:
            frame = await anext(sub)
        ours = [t.get_name() for t in asyncio.all_tasks() if task_id in t.get_name()]
        assert ours == [f"a2a-grpc-server:run:{task_id}"]  # no consumer while nothing is queued
        agent.release.set()
        frames = await _collect(sub)
        assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        await h.settle()


async def test_send_request_configuration_history_length_trims_the_answer() -> None:
    async with asyncio.timeout(10), serve(EchoAgent()) as h:
        request = SendMessageRequest(
            message=user_message("x"), configuration=SendMessageConfiguration(history_length=0)
        )
        response = await h.client.send_message(request)
        assert len(response.task.history) == 0


async def test_two_simultaneous_follow_ups_start_exactly_one_execution() -> None:
    async with asyncio.timeout(10), serve(InputAgent()) as h:
        task = (await h.client.send_message(send_request("hi"))).task
        results = await asyncio.gather(
            h.client.send_message(send_request("A", task_id=task.id)),
            h.client.send_message(send_request("B", task_id=task.id)),
            return_exceptions=True,
        )
        ok = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, UnsupportedOperationError)]
        assert (len(ok), len(refused)) == (1, 1), results
        assert ok[0].task.status.state == S.TASK_STATE_COMPLETED
        await h.settle()


async def test_cancel_right_after_send_still_ends_canceled_with_one_execution() -> None:
    agent = GatedAgent()
    async with asyncio.timeout(10), serve(agent) as h:
        for _ in range(20):
            task = (await h.client.send_message(send_request("go", immediately=True))).task
            canceled = await h.client.cancel_task(CancelTaskRequest(id=task.id))
            assert canceled.status.state == S.TASK_STATE_CANCELED
        await h.settle()


async def test_server_memory_stays_flat_over_many_tasks() -> None:
    config = ServerConfig(max_final_tasks=50)
    async with asyncio.timeout(30), serve(EchoAgent(), config) as h:
        for i in range(500):
            await h.client.send_message(send_request(f"m{i}"))
        listed = await h.client.list_tasks(ListTasksRequest())
        assert listed.total_size == 50
        assert h.service.engine.tasks.count == 0
        await h.settle()


async def test_list_tasks_filters_on_status_timestamp_after() -> None:
    async with asyncio.timeout(10), serve(EchoAgent()) as h:
        tasks = [(await h.client.send_message(send_request(f"m{i}"))).task for i in range(4)]
        cutoff = tasks[2].status.timestamp
        listed = await h.client.list_tasks(ListTasksRequest(status_timestamp_after=cutoff))
        assert [t.id for t in listed.tasks] == [tasks[3].id, tasks[2].id]
        assert listed.total_size == 2

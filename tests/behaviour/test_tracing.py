"""OpenTelemetry: every A2A call is one ``a2a.server`` span with the draft A2A conventions'
names (docs/reference/telemetry.md); a trace goes from a client's span through SendMessage into the
executor (one span per RPC and per run, state changes as events, never a span per frame), and
in cluster mode across a routed cancel to the owner. Spans are read from an in-memory
exporter."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import (
    DESCRIPTOR,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Part,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils import telemetry as sdk_telemetry
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from a2a_grpc_server import ServerConfig
from tests.support.agents import GatedPerTask, InputAgent
from tests.support.clusterharness import instances
from tests.support.harness import V1, Harness, send_request, serve, user_message

CLIENT = trace.get_tracer("test-client")
TENANT = "acme"
A2A_METHODS = {m.name for m in DESCRIPTOR.services_by_name["A2AService"].methods}


Spans = tuple[ReadableSpan, ...]


class Recorder(SimpleSpanProcessor):
    """Every span ended, in memory, and a wait for spans to end (they end on the loop's thread)."""

    def __init__(self) -> None:
        self.memory = InMemorySpanExporter()
        super().__init__(self.memory)
        self._ended: asyncio.Event | None = None

    def on_end(self, span: ReadableSpan) -> None:
        super().on_end(span)
        if self._ended is not None:
            self._ended.set()

    def clear(self) -> None:
        self.memory.clear()

    def get_finished_spans(self) -> Spans:
        return self.memory.get_finished_spans()

    async def until(self, done: Callable[[Spans], bool]) -> Spans:
        """The spans ended so far, once ``done`` says they are all there."""
        while not done(spans := self.memory.get_finished_spans()):
            self._ended = asyncio.Event()
            try:
                await self._ended.wait()
            finally:
                self._ended = None
        return spans


@pytest.fixture(scope="module")
def exporter() -> Iterator[Recorder]:
    """Every span this module's tests end, in memory (the global provider is set once)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    recorder = Recorder()
    provider.add_span_processor(recorder)
    yield recorder
    recorder.memory.shutdown()  # later tests' spans are dropped, not kept


class LlmAgent(AgentExecutor):
    """Works in a span of its own (an LLM call), streaming 50 chunks, then completes."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        with trace.get_tracer("agent").start_as_current_span("agent.llm_call"):
            for i in range(50):
                await updater.add_artifact([Part(text=f"c{i}")], artifact_id="a", append=i > 0)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


def traced_metadata() -> tuple[tuple[str, str], ...]:
    """The A2A version and the current trace context (W3C traceparent)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return (*V1, *carrier.items())


def named(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    [found] = [s for s in spans if s.name == name]
    return found


def parent_of(span: ReadableSpan) -> int:
    assert span.parent is not None, f"{span.name} has no parent"
    return span.parent.span_id


def attributes(span: ReadableSpan) -> Mapping[str, Any]:
    assert span.attributes is not None
    return span.attributes


async def test_a_trace_goes_from_the_client_into_the_executor(
    exporter: Recorder,
) -> None:
    exporter.clear()
    async with asyncio.timeout(20), serve(LlmAgent()) as h:
        with CLIENT.start_as_current_span("client.ask") as client:
            call = h.stub.SendStreamingMessage(send_request("hi"), metadata=traced_metadata())
            frames = [frame async for frame in call]
        await h.settle()
    assert len(frames) > 50
    spans = exporter.get_finished_spans()
    rpc = named(spans, "SendStreamingMessage")
    run = named(spans, "a2a.task.execute")
    llm = named(spans, "agent.llm_call")
    trace_id = client.get_span_context().trace_id
    assert {s.context.trace_id for s in (rpc, run, llm)} == {trace_id}
    assert parent_of(rpc) == client.get_span_context().span_id
    assert parent_of(run) == rpc.context.span_id
    assert parent_of(llm) == run.context.span_id
    task = frames[0].task
    assert attributes(run)["a2a.task.id"] == task.id
    assert attributes(run)["gen_ai.conversation.id"] == task.context_id
    states = [event.attributes["a2a.task.state"] for event in run.events if event.attributes]
    assert states == ["TASK_STATE_SUBMITTED", "TASK_STATE_WORKING", "TASK_STATE_COMPLETED"]
    assert attributes(rpc)["a2a.task.state"] == "TASK_STATE_COMPLETED", "the stream's last state"
    ours = sorted(s.name for s in spans if s.context.trace_id == trace_id)
    assert ours == sorted(["client.ask", rpc.name, run.name, llm.name]), (
        "one span per RPC and per run, none per frame (50 chunks)"
    )
    if sdk_telemetry.otel_enabled:  # the case worth checking: a2a-sdk's spans are on
        sdk = sdk_telemetry.INSTRUMENTING_MODULE_NAME
        served = [
            s.name
            for s in spans
            if s.instrumentation_scope is not None
            and s.instrumentation_scope.name == sdk
            and s.kind != SpanKind.CLIENT  # the harness's a2a-sdk client closing
        ]
        assert served == [], "a2a-sdk makes no span per event here, though its spans are on"


async def rest_of(call: Any) -> list[StreamResponse]:
    """The frames of a stream call still to come (after ``read()``s of earlier ones)."""
    frames = []
    while (frame := await call.read()) is not grpc.aio.EOF:
        frames.append(frame)
    return frames


def state(frames: list[StreamResponse]) -> str:
    return TaskState.Name(frames[-1].status_update.status.state)


async def _every_rpc(h: Harness) -> dict[str, list[dict[str, str]]]:
    """Call every RPC of the service as tenant ``acme``; the draft's attributes of each call."""
    md = traced_metadata()
    ask = SendMessageRequest(tenant=TENANT, message=user_message("hi", msg_id="m-1"))
    asked = (await h.stub.SendMessage(ask, metadata=md)).task
    ids = {"a2a.task.id": asked.id, "gen_ai.conversation.id": asked.context_id}
    waiting = {**ids, "a2a.task.state": "TASK_STATE_INPUT_REQUIRED"}
    done = {**ids, "a2a.task.state": "TASK_STATE_COMPLETED"}
    of_task = {"a2a.task.id": asked.id}
    await h.stub.GetTask(GetTaskRequest(tenant=TENANT, id=asked.id), metadata=md)
    listing = ListTasksRequest(tenant=TENANT, context_id=asked.context_id)
    await h.stub.ListTasks(listing, metadata=md)
    push = TaskPushNotificationConfig(
        tenant=TENANT, task_id=asked.id, id="p", url="http://127.0.0.1:9/"
    )
    await h.stub.CreateTaskPushNotificationConfig(push, metadata=md)
    one = {"tenant": TENANT, "task_id": asked.id, "id": "p"}
    await h.stub.GetTaskPushNotificationConfig(
        GetTaskPushNotificationConfigRequest(**one), metadata=md
    )
    configs = ListTaskPushNotificationConfigsRequest(tenant=TENANT, task_id=asked.id)
    await h.stub.ListTaskPushNotificationConfigs(configs, metadata=md)
    await h.stub.DeleteTaskPushNotificationConfig(
        DeleteTaskPushNotificationConfigRequest(**one), metadata=md
    )
    subscription = h.stub.SubscribeToTask(
        SubscribeToTaskRequest(tenant=TENANT, id=asked.id), metadata=md
    )
    assert (await subscription.read()).task.id == asked.id  # subscribed: the snapshot
    answer = user_message("Ada", task_id=asked.id, msg_id="m-2")
    follow_up = h.stub.SendStreamingMessage(
        SendMessageRequest(tenant=TENANT, message=answer), metadata=md
    )
    assert (
        state(await rest_of(follow_up))
        == state(await rest_of(subscription))
        == "TASK_STATE_COMPLETED"
    )
    another = SendMessageRequest(tenant=TENANT, message=user_message("x", msg_id="m-3"))
    other = (await h.stub.SendMessage(another, metadata=md)).task
    await h.stub.CancelTask(CancelTaskRequest(tenant=TENANT, id=other.id), metadata=md)
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await h.stub.GetTask(GetTaskRequest(tenant=TENANT, id="no-such-task"), metadata=md)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as no_card:
        await h.stub.GetExtendedAgentCard(GetExtendedAgentCardRequest(tenant=TENANT), metadata=md)
    assert no_card.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    other_ids = {"a2a.task.id": other.id, "gen_ai.conversation.id": other.context_id}
    return {
        "SendMessage": [
            {**waiting, "a2a.message.id": "m-1"},
            {**other_ids, "a2a.task.state": "TASK_STATE_INPUT_REQUIRED", "a2a.message.id": "m-3"},
        ],
        "GetTask": [waiting, {"a2a.task.id": "no-such-task", "error.type": "NOT_FOUND"}],
        "ListTasks": [{"gen_ai.conversation.id": asked.context_id}],
        "CreateTaskPushNotificationConfig": [of_task],
        "GetTaskPushNotificationConfig": [of_task],
        "ListTaskPushNotificationConfigs": [of_task],
        "DeleteTaskPushNotificationConfig": [of_task],
        "SubscribeToTask": [done],
        "SendStreamingMessage": [{**done, "a2a.message.id": "m-2"}],
        "CancelTask": [{**other_ids, "a2a.task.state": "TASK_STATE_CANCELED"}],
        "GetExtendedAgentCard": [{"error.type": "FAILED_PRECONDITION"}],
    }


OPTIONAL = (
    "a2a.task.id",
    "a2a.task.state",
    "a2a.message.id",
    "gen_ai.conversation.id",
    "error.type",
)
"""The draft's attributes a span has only when its call is about them (or failed)."""


async def test_a_span_of_each_rpc_carries_the_draft_a2a_attributes(exporter: Recorder) -> None:
    config = ServerConfig(cancel_timeout=1.0, push_allow_private=True, push_retry_for=0)
    exporter.clear()
    async with asyncio.timeout(20), serve(InputAgent(), config) as h:
        with CLIENT.start_as_current_span("client.every_rpc") as client:
            expected = await _every_rpc(h)
        calls = sum(len(c) for c in expected.values())
        ended = await exporter.until(lambda spans: len(servers(spans)) >= calls)
        card = h.service.card
    assert set(expected) == A2A_METHODS, "every RPC of lf.a2a.v1.A2AService is called"
    assert sorted(s.name for s in servers(ended)) == sorted(
        name for name, want in expected.items() for _ in want
    ), "one SERVER span per call, named by the bare method"
    for name, want_each in expected.items():
        spans = sorted(
            (s for s in servers(ended) if s.name == name), key=lambda s: s.start_time or 0
        )
        for span, want in zip(spans, want_each, strict=True):
            got = attributes(span)
            assert parent_of(span) == client.get_span_context().span_id, name
            assert got["a2a.method.name"] == name
            assert got["a2a.protocol.version"] == "1.0"
            assert got["a2a.tenant"] == TENANT
            agent = ("gen_ai.agent.name", "gen_ai.agent.description", "gen_ai.agent.version")
            assert [got[key] for key in agent] == [card.name, card.description, card.version]
            assert got["client.address"] == "127.0.0.1" and got["client.port"] > 0
            present = {key: got[key] for key in OPTIONAL if key in got}
            assert present == want, name
            failed = "error.type" in want
            assert got["rpc.response.status_code"] == (want["error.type"] if failed else "OK")
            if failed:
                assert span.status.status_code == StatusCode.ERROR, name
                assert span.status.description, "the call's message"
            else:
                assert span.status.status_code == StatusCode.UNSET, name


def servers(spans: Spans) -> list[ReadableSpan]:
    return [s for s in spans if s.kind == SpanKind.SERVER]


async def test_a_client_leaving_a_subscription_is_not_a_failure(exporter: Recorder) -> None:
    exporter.clear()
    async with asyncio.timeout(20), serve(InputAgent()) as h:
        task = (await h.stub.SendMessage(send_request("hi"), metadata=V1)).task
        call = h.stub.SubscribeToTask(SubscribeToTaskRequest(id=task.id), metadata=V1)
        await call.read()
        call.cancel()
        ended = await exporter.until(lambda spans: any(s.name == "SubscribeToTask" for s in spans))
    got = attributes(named(ended, "SubscribeToTask"))
    assert got["rpc.response.status_code"] == "CANCELLED"
    assert "error.type" not in got
    assert named(ended, "SubscribeToTask").status.status_code == StatusCode.UNSET
    assert got["a2a.task.state"] == "TASK_STATE_INPUT_REQUIRED", "the snapshot's"
    assert "a2a.tenant" not in got, "no tenant asked for, none recorded"


async def test_a_routed_cancel_carries_the_trace_to_the_owner(
    exporter: Recorder, nats_url: str
) -> None:
    agent = GatedPerTask(cooperative=True)
    config = ServerConfig(cancel_timeout=1.0)
    async with asyncio.timeout(40), instances(agent, [nats_url], config=config) as (a, b):
        task = (await a.stub.SendMessage(send_request("go", immediately=True), metadata=V1)).task
        await agent.working(task.id).wait()
        exporter.clear()
        with CLIENT.start_as_current_span("client.cancel") as client:
            await b.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=traced_metadata())
        spans = exporter.get_finished_spans()
        on_b = named(spans, "CancelTask")
        on_a = named(spans, "a2a.routed/cancel")
        assert on_b.context.trace_id == on_a.context.trace_id == client.get_span_context().trace_id
        assert parent_of(on_b) == client.get_span_context().span_id
        assert parent_of(on_a) == on_b.context.span_id, "the owner's span is the asker's child"
        assert attributes(on_b)["a2a.task.state"] == "TASK_STATE_CANCELED"

"""OpenTelemetry: a trace goes from a client's span through SendMessage into the executor (one
span per RPC and per run, state changes as events, never a span per frame), and in cluster
mode across a routed cancel to the owner. Spans are read from an in-memory exporter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import CancelTaskRequest, Part
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from a2a_grpc_server import ServerConfig
from tests.support.agents import GatedPerTask
from tests.support.clusterharness import instances
from tests.support.harness import V1, send_request, serve

CLIENT = trace.get_tracer("test-client")


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Every span this module's tests end, in memory (the global provider is set once)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    yield spans
    spans.shutdown()  # later tests' spans are dropped, not kept


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


async def test_a_trace_goes_from_the_client_into_the_executor(
    exporter: InMemorySpanExporter,
) -> None:
    exporter.clear()
    async with asyncio.timeout(20), serve(LlmAgent()) as h:
        with CLIENT.start_as_current_span("client.ask") as client:
            call = h.stub.SendStreamingMessage(send_request("hi"), metadata=traced_metadata())
            frames = [frame async for frame in call]
        await h.settle()
    assert len(frames) > 50
    spans = exporter.get_finished_spans()
    rpc = named(spans, "lf.a2a.v1.A2AService/SendStreamingMessage")
    run = named(spans, "a2a.task.execute")
    llm = named(spans, "agent.llm_call")
    trace_id = client.get_span_context().trace_id
    assert {s.context.trace_id for s in (rpc, run, llm)} == {trace_id}
    assert parent_of(rpc) == client.get_span_context().span_id
    assert parent_of(run) == rpc.context.span_id
    assert parent_of(llm) == run.context.span_id
    assert run.attributes is not None
    assert run.attributes["a2a.task.id"] == frames[0].task.id
    states = [event.attributes["a2a.task.state"] for event in run.events if event.attributes]
    assert states == ["TASK_STATE_SUBMITTED", "TASK_STATE_WORKING", "TASK_STATE_COMPLETED"]
    ours = sorted(s.name for s in spans if s.context.trace_id == trace_id)
    assert ours == sorted(["client.ask", rpc.name, run.name, llm.name]), (
        "one span per RPC and per run, none per frame (50 chunks)"
    )


async def test_a_routed_cancel_carries_the_trace_to_the_owner(
    exporter: InMemorySpanExporter, nats_url: str
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
        on_b = named(spans, "lf.a2a.v1.A2AService/CancelTask")
        on_a = named(spans, "a2a.routed/cancel")
        assert on_b.context.trace_id == on_a.context.trace_id == client.get_span_context().trace_id
        assert parent_of(on_b) == client.get_span_context().span_id
        assert parent_of(on_a) == on_b.context.span_id, "the owner's span is the asker's child"

"""Tracing with OpenTelemetry: optional, and free when no tracer provider is configured.

Span and attribute names follow OpenTelemetry's draft conventions for A2A
(``docs/gen-ai/a2a.md`` in open-telemetry/semantic-conventions-genai, status
Development) where the draft has a name; ``docs/reference/telemetry.md`` lists every
name, the draft's and ours side by side.

When ``opentelemetry-api`` is importable *and* the application configured a
tracer provider (the SDK, e.g. under ``opentelemetry-instrument``), then:

* ``rpc.tracing`` (in ``A2AService.interceptors()``) makes the draft's
  ``a2a.server`` span for each call of ``lf.a2a.v1.A2AService``: named by the
  bare method (``SendMessage``), kind SERVER, whose parent is the W3C
  ``traceparent`` (and ``tracestate``) the client sent in its metadata;
* ``execution`` makes one span per run of a task's executor, current while
  the executor runs, so an agent's own spans (its LLM and tool calls) join
  the caller's trace; the task's state changes are events on it
  (``state_event``), never one span per frame;
* a request routed to a task's owner (cluster mode) carries the current
  context (``inject``), and the owner serves it in a span of that trace
  (``routed``).

Otherwise every function here returns at once (one check of the global
provider), and nothing is imported beyond the API.

Nothing here, nor anywhere in the package, writes to ``os.environ``.
a2a-sdk's own instrumentation (a span per enqueued event, on its
``EventQueueLegacy`` and request handlers) stays as the application set it:
the executor writes to this server's queue, which a2a-sdk does not trace, so
no such span is made per frame either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import (
        NoOpTracerProvider,
        ProxyTracerProvider,
        SpanKind,
    )
except ImportError:  # pragma: no cover - the API is not installed
    trace = None  # type: ignore[assignment]

TRACER_NAME = "a2a_grpc_server"
PROPAGATED = ("traceparent", "tracestate")
"""The W3C trace-context metadata keys."""

# The draft's attribute names (see docs/reference/telemetry.md for when each is set).
METHOD_NAME = "a2a.method.name"
PROTOCOL_VERSION = "a2a.protocol.version"
TENANT = "a2a.tenant"
MESSAGE_ID = "a2a.message.id"
REFERENCE_TASK_IDS = "a2a.message.reference_task_ids"
TASK_ID = "a2a.task.id"
TASK_STATE = "a2a.task.state"
CONVERSATION_ID = "gen_ai.conversation.id"
"""The A2A ``context_id`` (the draft's name for it)."""
AGENT_NAME = "gen_ai.agent.name"
AGENT_DESCRIPTION = "gen_ai.agent.description"
AGENT_VERSION = "gen_ai.agent.version"
ERROR_TYPE = "error.type"
CLIENT_ADDRESS = "client.address"
CLIENT_PORT = "client.port"
# Not in the draft: OpenTelemetry's gRPC conventions' name for the status of the call.
STATUS_CODE = "rpc.response.status_code"

# Ours, where the draft names nothing.
EXECUTE_SPAN = "a2a.task.execute"
CANCEL_SPAN = "a2a.task.cancel"
STATE_EVENT = "a2a.task.state"
ROUTED_SPAN = "a2a.routed/{op}"


_ENVIRONMENT_PROVIDER = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
"""Whether OpenTelemetry may load a provider named in its environment variable."""
_UNKNOWN = object()


def active() -> bool:
    """Whether spans are recorded: the API is installed and a real provider is configured.

    Several calls per RPC ask. With no provider set, OpenTelemetry looks its
    environment variable up at every ``get_tracer_provider()``: that case is
    answered from its global (read, never written, here; an API without it
    takes the slow path) and the variable as it was at import.
    """
    if trace is None:
        return False
    if getattr(trace, "_TRACER_PROVIDER", _UNKNOWN) is None and not _ENVIRONMENT_PROVIDER:
        return False
    return not isinstance(trace.get_tracer_provider(), ProxyTracerProvider | NoOpTracerProvider)


def tracer() -> Any:
    """This package's tracer (only when ``active()``)."""
    return trace.get_tracer(TRACER_NAME)


@contextlib.contextmanager
def execution(task_id: str, context_id: str, *, cancel: bool = False) -> Iterator[None]:
    """The span of one run of a task's executor, current inside the block."""
    if not active():
        yield
        return
    name = CANCEL_SPAN if cancel else EXECUTE_SPAN
    attributes = {TASK_ID: task_id, CONVERSATION_ID: context_id}
    with tracer().start_as_current_span(name, attributes=attributes):
        yield


def state_event(state_name: str) -> None:
    """Record a state change of the task on the current span (a run's, or a cancel's)."""
    if not active():
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(STATE_EVENT, {TASK_STATE: state_name})


def inject(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` with the current trace context in place of the client's (a routed request)."""
    kept = [pair for pair in headers if pair[0] not in PROPAGATED]
    if not active():
        return kept + [pair for pair in headers if pair[0] in PROPAGATED]
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:  # no current span: the client's context still holds
        return kept + [pair for pair in headers if pair[0] in PROPAGATED]
    return kept + list(carrier.items())


@contextlib.contextmanager
def routed(op: str, headers: Sequence[tuple[str, str]]) -> Iterator[None]:
    """The owner's span of a routed request, child of the asker's (see ``inject``)."""
    if not active():
        yield
        return
    parent = propagate.extract({k: v for k, v in headers if k in PROPAGATED})
    name = ROUTED_SPAN.format(op=op)
    with tracer().start_as_current_span(name, context=parent, kind=SpanKind.SERVER):
        yield

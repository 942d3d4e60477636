"""Tracing with OpenTelemetry: optional, and free when no tracer provider is configured.

When ``opentelemetry-api`` is importable *and* the application configured a
tracer provider (the SDK, e.g. under ``opentelemetry-instrument``), then:

* ``rpc.tracing.traced`` (in ``A2AService.interceptors()``) makes one SERVER span per RPC, whose
  parent is the W3C ``traceparent`` (and ``tracestate``) the client sent in
  its metadata;
* ``execution`` makes one span per run of a task's executor, current while
  the executor runs, so an agent's own spans (its LLM and tool calls) join
  the caller's trace; the task's state changes are events on it
  (``state_event``), never one span per frame;
* a request routed to a task's owner (cluster mode) carries the current
  context (``inject``), and the owner serves it in a span of that trace
  (``routed``).

Otherwise every function here returns at once (one check of the global
provider), and nothing is imported beyond the API.

a2a-sdk's own instrumentation (a span per enqueued event) is off unless
``OTEL_INSTRUMENTATION_A2A_SDK_ENABLED`` is set (see ``a2a_grpc_server``'s
``__init__``, which sets its default before a2a-sdk is imported).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

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
SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
"""The codes that mark a SERVER span as an error (OpenTelemetry's gRPC conventions; a
NOT_FOUND or INVALID_ARGUMENT is the client's, not the server's)."""
PROPAGATED = ("traceparent", "tracestate")
"""The W3C trace-context metadata keys."""


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
    name = "a2a.task.cancel" if cancel else "a2a.task.execute"
    attributes = {"a2a.task.id": task_id, "a2a.context.id": context_id}
    with tracer().start_as_current_span(name, attributes=attributes):
        yield


def state_event(state_name: str) -> None:
    """Record a state change of the task on the current span (a run's, or a cancel's)."""
    if not active():
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("a2a.task.state", {"a2a.task.state": state_name})


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
    with tracer().start_as_current_span(f"a2a.routed/{op}", context=parent, kind=SpanKind.SERVER):
        yield

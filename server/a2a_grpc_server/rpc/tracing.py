"""The SERVER span of each RPC (see ``obs.tracing``: free without a tracer provider)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from ..obs.tracing import PROPAGATED, SERVER_ERRORS, active, tracer
from .intercept import Behavior
from .intercept import status_code as _status

try:
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - the API is not installed (active() is then False)
    pass


def traced(method: str, kind: str, behavior: Behavior) -> Behavior:
    """``behavior`` in one SERVER span per call, child of the client's ``traceparent``.

    A wrap for ``intercept.WrappingInterceptor``: ``A2AService.interceptors()``
    applies it inside the metrics interceptor and before authentication (a
    refused call is traced too). See the module docstring.
    """
    name = method.lstrip("/")
    service, _, rpc = name.rpartition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}

    async def run(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if not active():
            return await behavior(request, context)
        carrier = {
            key: value
            for key, value in context.invocation_metadata() or ()
            if key in PROPAGATED and isinstance(value, str)
        }
        parent = propagate.extract(carrier)
        with tracer().start_as_current_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
            try:
                result = await behavior(request, context)
                code = _status(context.code()) or grpc.StatusCode.OK
                return result
            except grpc.aio.AbortError:
                code = _status(context.code()) or grpc.StatusCode.UNKNOWN
                raise
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            finally:
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code in SERVER_ERRORS:
                    text = context.details()  # type: ignore[no-untyped-call]
                    span.set_status(Status(StatusCode.ERROR, str(text or code.name)))

    return run

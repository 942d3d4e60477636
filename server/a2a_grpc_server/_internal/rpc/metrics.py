"""Per-RPC metrics, by a server interceptor: calls by method and status code, and their latency.

The names are those of the gRPC ecosystem's Prometheus interceptors
(``grpc_server_started_total``, ``grpc_server_handled_total``,
``grpc_server_handling_seconds``), labelled ``grpc_service``,
``grpc_method``, ``grpc_type`` and (handled) ``grpc_code``, so existing
dashboards read them. A stream's latency is its whole life.

Who runs what: ``MetricsInterceptor`` wraps each method's handler once
(``intercept.HandlerWraps``); the wrapper runs in the call's task and only
adds to plain integers (no lock: the event loop is the only writer). The
collector (``collector``) reads them when ``/metrics`` is scraped.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ..model.names import A2A_SERVICE
from ..obs.metrics import Histogram
from .intercept import Behavior, WrappingInterceptor, status_code

RPC_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
"""Upper bounds (seconds) of ``grpc_server_handling_seconds``."""

Labels = tuple[str, str, str]
"""(grpc_service, grpc_method, grpc_type)."""


@dataclass
class RpcMetrics:
    """What the interceptor counted since the server started."""

    started: Counter[Labels] = field(default_factory=Counter)
    handled: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)
    """By (service, method, type, code name)."""
    seconds: dict[Labels, Histogram] = field(default_factory=dict)
    a2a_in_flight: int = 0
    """A2A calls being served now (not health or admin calls, whose watches stay open)."""
    held: int = 0
    """Of those, calls a closing server holds to refuse them (``closing.Closing``)."""
    _quiet: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._quiet.set()

    async def wait_quiet(self) -> None:
        """Wait until no A2A call is being served (held calls aside)."""
        await self._quiet.wait()

    def hold(self) -> None:
        """A call being served is now held (it no longer keeps the server from quiet)."""
        self.held += 1
        self._settle()

    def unhold(self) -> None:
        """A held call goes on (to its refusal)."""
        self.held -= 1
        self._settle()

    def _settle(self) -> None:
        if self.a2a_in_flight <= self.held:
            self._quiet.set()
        else:
            self._quiet.clear()


class MetricsInterceptor(WrappingInterceptor):
    """Counts every call of every service this server serves (see the module docstring).

    Put it first among the server's interceptors, so calls another
    interceptor refuses (UNAUTHENTICATED) are counted too.

    Args:
        metrics: Where to count.
        inner: Another wrap, applied inside this one (one interceptor doing the
            work of two costs one interceptor's call per RPC, not two).
    """

    def __init__(
        self, metrics: RpcMetrics, inner: Callable[[str, str, Behavior], Behavior] | None = None
    ) -> None:
        self.metrics = metrics
        if inner is None:
            super().__init__(self._timed)
            return

        def wrap(method: str, kind: str, behavior: Behavior) -> Behavior:
            return self._timed(method, kind, inner(method, kind, behavior))

        super().__init__(wrap)

    def _timed(self, method: str, kind: str, behavior: Behavior) -> Behavior:
        service, _, name = method.lstrip("/").rpartition("/")
        labels: Labels = (service, name, kind)
        metrics = self.metrics
        histogram = metrics.seconds.setdefault(labels, Histogram(RPC_BUCKETS))
        handled = {code: (*labels, code.name) for code in grpc.StatusCode}
        ok, cancelled, unknown, deadline = (
            handled[grpc.StatusCode.OK],
            handled[grpc.StatusCode.CANCELLED],
            handled[grpc.StatusCode.UNKNOWN],
            handled[grpc.StatusCode.DEADLINE_EXCEEDED],
        )

        a2a = service == A2A_SERVICE

        async def run(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            metrics.started[labels] += 1
            if a2a:
                metrics.a2a_in_flight += 1
                metrics._settle()
            start = time.perf_counter()
            outcome = unknown
            try:
                result = await behavior(request, context)
                code = status_code(context.code())  # set_code, or none: OK
                outcome = handled[code] if code is not None else ok
                return result
            except grpc.aio.AbortError:
                code = status_code(context.code())
                outcome = handled[code] if code is not None else unknown
                raise
            except asyncio.CancelledError:
                left = context.time_remaining()
                # The client left, or its deadline passed (grpc.aio cancels the handler).
                outcome = deadline if left is not None and left <= 0 else cancelled
                raise
            finally:
                metrics.handled[outcome] += 1
                histogram.observe(time.perf_counter() - start)
                if a2a:
                    metrics.a2a_in_flight -= 1
                    metrics._settle()

        return run

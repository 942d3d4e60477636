"""The last moments of a server: new A2A calls are held, then refused UNAVAILABLE.

Why not simply stop the gRPC server: grpc core cuts CANCELLED every call it
has received but the application has not taken yet when the server stops,
and every call that reaches it before the client has read the server's
GOAWAY. A client hammering an instance over one connection (a Kubernetes
Service balances connections, not calls) has such calls in flight at any
moment: a bare ``grpc.aio`` server stopped with a grace cuts about one per
concurrent caller. CANCELLED is not retryable, and the client cannot tell
whether its call ran.

So the server closes in three steps (``A2AServer.stop``): ``begin`` (a new
call is taken by the application and held, so none waits in grpc core to be
cut), the gRPC server's stop (its GOAWAY goes out: clients open their next
calls on a new connection, elsewhere), then ``release`` a moment later: the
held calls are refused UNAVAILABLE, which clients retry. A held call never
outlives its caller's deadline (it is refused a little before it) nor
``HOLD_MOST``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

from ..errors import ServerShuttingDownError
from .metrics import RpcMetrics

HOLD_MOST = 5.0
"""Seconds a call is held at most by default, should nobody release it (see ``begin``)."""
DEADLINE_MARGIN = 0.05
"""Seconds before the caller's deadline a held call is refused, so the refusal reaches it."""


class Closing:
    """Holds new A2A calls while the server closes, then refuses them UNAVAILABLE.

    Args:
        metrics: Where held calls are counted, so ``RpcMetrics.wait_quiet``
            waits only for the calls still being served.
    """

    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self._metrics = metrics
        self.started = False
        """Set by ``begin``: new calls are held (checked by every A2A method)."""
        self._released = asyncio.Event()
        self._hold_most = HOLD_MOST

    def begin(self, hold_most: float = HOLD_MOST) -> None:
        """Hold every new A2A call from now on, each ``hold_most`` seconds at most."""
        self._hold_most = hold_most
        self.started = True

    def release(self) -> None:
        """Refuse the held calls, and every later one, at once."""
        self.started = True
        self._released.set()

    async def refuse(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Hold this call until ``release`` (or near its deadline), then refuse it.

        Raises:
            ServerShuttingDownError: Always (UNAVAILABLE, retryable).
        """
        wait = self._hold_most
        left = context.time_remaining()
        if left is not None:
            wait = min(wait, max(0.0, left - DEADLINE_MARGIN))
        metrics = self._metrics
        if metrics is not None:
            metrics.hold()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._released.wait()
        finally:
            if metrics is not None:
                metrics.unhold()
        raise ServerShuttingDownError(
            "server is closing its connections; retry on another instance"
        )

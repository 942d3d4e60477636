"""Wrapping RPC handlers in server interceptors, once per method rather than once per call.

grpc.aio asks every interceptor for each call's handler. Making a new
wrapped handler every time costs an allocation per call and per interceptor;
``HandlerWraps`` keeps the wrapped handler of each method for as long as the
handler it wraps is the same object (the registered handlers do not change
while a server runs).

Who runs what: everything here runs on the event loop, in
``intercept_service``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


class HandlerWraps:
    """The wrapped handler of each method (see the module docstring).

    Args:
        wrap: Makes the wrapped behavior of one method from its name, its
            kind (``unary`` or ``server_stream``) and its behavior.
    """

    def __init__(self, wrap: Callable[[str, str, Behavior], Behavior]) -> None:
        self._wrap = wrap
        self._made: dict[str, tuple[Any, Any]] = {}

    def get(self, method: str, handler: Any) -> Any:
        """``handler`` of ``method`` with its behavior wrapped (the same object each call)."""
        made = self._made.get(method)
        if made is not None and made[0] is handler:
            return made[1]
        wrapped = _wrapped(handler, lambda kind, behavior: self._wrap(method, kind, behavior))
        self._made[method] = (handler, wrapped)
        return wrapped


def _wrapped(handler: Any, wrap: Callable[[str, Behavior], Behavior]) -> Any:
    """``handler`` (a ``grpc.RpcMethodHandler``) with its behavior wrapped.

    The A2A service's RPCs, health and reflection are unary-unary,
    unary-stream or stream-stream; any other shape is left as it is.
    """
    make: Any
    if handler.unary_unary is not None:
        make, kind, behavior = grpc.unary_unary_rpc_method_handler, "unary", handler.unary_unary
    elif handler.unary_stream is not None:
        make, kind, behavior = (
            grpc.unary_stream_rpc_method_handler,
            "server_stream",
            handler.unary_stream,
        )
    else:
        return handler
    return make(
        wrap(kind, behavior),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )

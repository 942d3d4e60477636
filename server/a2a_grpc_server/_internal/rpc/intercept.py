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

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


MAX_CACHED = 1024
"""Most methods whose wrapped handler is kept (a catch-all handler could make any number)."""

SHAPES = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, "unary"),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, "server_stream"),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, "client_stream"),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, "bidi_stream"),
)
"""Each handler shape: its attribute, how to make one, and its ``grpc_type`` name."""


class HandlerWraps:
    """The wrapped handler of each method (see the module docstring).

    Coroutine handlers are wrapped as they are; async-generator handlers
    become coroutines that write each item (the same stream, one shape to
    wrap); synchronous handlers, which grpc.aio runs in its thread pool, are
    left as they are (``on_sync`` may replace them, e.g. to refuse the call).

    Args:
        wrap: Makes the wrapped behavior of one method from its name, its
            kind (``unary``, ``server_stream``, ``client_stream``,
            ``bidi_stream``) and its behavior.
        on_sync: What a synchronous handler's behavior becomes (None: left
            unwrapped).
    """

    def __init__(
        self,
        wrap: Callable[[str, str, Behavior], Behavior],
        on_sync: Behavior | None = None,
    ) -> None:
        self._wrap = wrap
        self._on_sync = on_sync
        self._made: dict[str, tuple[Any, Any]] = {}

    def get(self, method: str, handler: Any) -> Any:
        """``handler`` of ``method`` with its behavior wrapped (the same object each call)."""
        made = self._made.get(method)
        if made is not None and made[0] is handler:
            return made[1]
        wrapped = self._wrapped(method, handler)
        if len(self._made) < MAX_CACHED or method in self._made:
            self._made[method] = (handler, wrapped)
        return wrapped

    def _wrapped(self, method: str, handler: Any) -> Any:
        for attribute, make, kind in SHAPES:
            behavior = getattr(handler, attribute)
            if behavior is None:
                continue
            if inspect.isasyncgenfunction(behavior):
                behavior = _writing(behavior)
            elif not (inspect.iscoroutinefunction(behavior) or inspect.isawaitable(behavior)):
                if self._on_sync is None:
                    return handler
                behavior = self._on_sync
            return make(  # type: ignore[no-untyped-call]
                self._wrap(method, kind, behavior),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


class WrappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A server interceptor that wraps the handler of each method it ``covers``.

    Args:
        wrap: As for ``HandlerWraps``.
        on_sync: As for ``HandlerWraps``.
    """

    def __init__(
        self,
        wrap: Callable[[str, str, Behavior], Behavior],
        on_sync: Behavior | None = None,
    ) -> None:
        self._wraps = HandlerWraps(wrap, on_sync)

    def covers(self, method: str) -> bool:
        """Whether calls of ``method`` (``/service/Method``) are wrapped (all, by default)."""
        return True

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        """The call's handler, wrapped if this interceptor covers its method."""
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or not self.covers(method):
            return handler
        return self._wraps.get(method, handler)


def _writing(generator: Callable[..., Any]) -> Behavior:
    """An async-generator handler as a coroutine that writes what it yields."""

    async def run(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        async for item in generator(request, context):
            await context.write(item)

    return run


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(code: object) -> grpc.StatusCode | None:
    """``context.code()`` as a ``StatusCode`` (grpc.aio may give the number)."""
    if isinstance(code, grpc.StatusCode):
        return code
    return _BY_NUMBER.get(code) if isinstance(code, int) else None

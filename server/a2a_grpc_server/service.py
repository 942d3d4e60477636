"""The gRPC servicer of ``lf.a2a.v1.A2AService``.

Who runs what: grpc.aio runs each call in its own asyncio task. Unary calls
ask the ``TaskManager`` and return; stream calls own one ``Subscription``
and write its frames until the channel ends it. An evicted subscriber's
buffer is dropped at once; if its handler is blocked writing to a client
that stopped reading, that one write completes when the client reads (or the
call ends by deadline, disconnect or server stop), and the call then ends
RESOURCE_EXHAUSTED. grpc.aio offers no way to end a call while a write is in
flight. Errors of every call go through ``errors``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SendMessageRequest,
    SendMessageResponse,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
)
from a2a.utils.errors import (
    ExtendedAgentCardNotConfiguredError,
    PushNotificationNotSupportedError,
)
from google.protobuf.empty_pb2 import Empty

from . import errors, taskops, validation
from .callmeta import caller
from .channel import Subscription
from .config import ServerConfig
from .errors import InvalidFieldError, SlowSubscriberError
from .manager import TaskManager
from .store import InvalidPageTokenError, TaskQuery

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
R = TypeVar("R")


def _handled(
    fn: Callable[[Any, Any, Context], Awaitable[R]],
) -> Callable[[Any, Any, Context], Awaitable[R]]:
    """Route every error of an RPC through ``errors.abort``."""

    @functools.wraps(fn)
    async def call(self: Any, request: Any, context: Context) -> R:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await errors.abort(context, exc)

    return call


class A2AServicer(a2a_pb2_grpc.A2AServiceServicer):
    """Serves every A2A RPC over the task manager.

    Args:
        manager: The live tasks of this instance.
        config: Limits.
        card: The public agent card (its input modes bound what clients may send).
        extended_card: The card for authenticated clients, if configured.
    """

    def __init__(
        self,
        manager: TaskManager,
        config: ServerConfig,
        card: AgentCard,
        extended_card: AgentCard | None = None,
    ) -> None:
        self._manager = manager
        self._input_modes = validation.input_modes(
            [*card.default_input_modes, *(m for s in card.skills for m in s.input_modes)]
        )
        self._extended_card = extended_card
        self._config = config
        self._streams_changed = asyncio.Condition()

    @property
    def open_streams(self) -> int:
        """Stream calls currently being served."""
        return self._manager.metrics.streams_open

    async def wait_streams_closed(self, at_most: int = 0) -> None:
        """Wait until no more than ``at_most`` stream calls are being served."""
        async with self._streams_changed:
            await self._streams_changed.wait_for(lambda: self.open_streams <= at_most)

    @_handled
    async def SendMessage(
        self, request: SendMessageRequest, context: Context
    ) -> SendMessageResponse:
        """Send a message; wait for a terminal or interrupted state unless asked not to."""
        call = caller(context, "SendMessage")
        validation.check_send(request, self._config, self._input_modes)
        started = await self._manager.send(request, call, subscribe=False)
        answer = await started.outcome(immediately=request.configuration.return_immediately)
        if isinstance(answer, Message):
            return SendMessageResponse(message=answer)
        config = request.configuration
        _trim(answer, config.history_length, config.HasField("history_length"))
        return SendMessageResponse(task=answer)

    @_handled
    async def SendStreamingMessage(self, request: SendMessageRequest, context: Context) -> None:
        """Send a message and stream the task's frames until it ends or needs input."""
        call = caller(context, "SendStreamingMessage")
        validation.check_send(request, self._config, self._input_modes)
        started = await self._manager.send(request, call, subscribe=True)
        assert started.subscription is not None
        await self._pump(started.subscription, started.snapshot, context, stop_at_interrupt=True)

    @_handled
    async def SubscribeToTask(self, request: SubscribeToTaskRequest, context: Context) -> None:
        """Stream a live task: its snapshot first, then every frame until it ends."""
        caller(context, "SubscribeToTask")
        validation.check_task_id(request.id)
        snapshot, sub = await self._manager.subscribe(request.id)
        await self._pump(sub, snapshot, context, stop_at_interrupt=False)

    @_handled
    async def GetTask(self, request: GetTaskRequest, context: Context) -> Task:
        """Return a task, its history trimmed to ``history_length``."""
        caller(context, "GetTask")
        validation.check_task_id(request.id)
        validation.check_history_length(request.history_length, request.HasField("history_length"))
        task = await self._manager.get(request.id)
        _trim(task, request.history_length, request.HasField("history_length"))
        return task

    @_handled
    async def ListTasks(self, request: ListTasksRequest, context: Context) -> ListTasksResponse:
        """List tasks, most recently updated first, with cursor pagination."""
        caller(context, "ListTasks")
        page_size = validation.check_list(request)
        after = request.status_timestamp_after
        query = TaskQuery(
            context_id=request.context_id,
            state=request.status,
            status_after_ns=after.seconds * 1_000_000_000 + after.nanos,
            page_size=page_size,
            page_token=request.page_token,
        )
        try:
            page = await self._manager.store.list(query)
        except InvalidPageTokenError as exc:
            raise InvalidFieldError("page_token", str(exc)) from None
        for task in page.tasks:
            _trim(task, request.history_length, request.HasField("history_length"))
            if not request.include_artifacts:
                del task.artifacts[:]
        return ListTasksResponse(
            tasks=page.tasks,
            next_page_token=page.next_page_token,
            page_size=page_size,
            total_size=page.total_size,
        )

    @_handled
    async def CancelTask(self, request: CancelTaskRequest, context: Context) -> Task:
        """Cancel a task; returns it CANCELED once every stream has the frame."""
        call = caller(context, "CancelTask")
        validation.check_task_id(request.id)
        return await self._manager.cancel(request.id, call)

    @_handled
    async def GetExtendedAgentCard(
        self, request: GetExtendedAgentCardRequest, context: Context
    ) -> AgentCard:
        """Return the extended agent card, if one is configured."""
        caller(context, "GetExtendedAgentCard")
        if self._extended_card is None:
            raise ExtendedAgentCardNotConfiguredError(
                "this agent has no extended agent card; use the public card"
            )
        return self._extended_card

    @_handled
    async def CreateTaskPushNotificationConfig(
        self, request: TaskPushNotificationConfig, context: Context
    ) -> TaskPushNotificationConfig:
        """Push notifications are not supported yet."""
        return await self._no_push(context, "CreateTaskPushNotificationConfig")

    @_handled
    async def GetTaskPushNotificationConfig(
        self, request: GetTaskPushNotificationConfigRequest, context: Context
    ) -> TaskPushNotificationConfig:
        """Push notifications are not supported yet."""
        return await self._no_push(context, "GetTaskPushNotificationConfig")

    @_handled
    async def ListTaskPushNotificationConfigs(
        self, request: ListTaskPushNotificationConfigsRequest, context: Context
    ) -> ListTaskPushNotificationConfigsResponse:
        """Push notifications are not supported yet."""
        return await self._no_push(context, "ListTaskPushNotificationConfigs")

    @_handled
    async def DeleteTaskPushNotificationConfig(
        self, request: DeleteTaskPushNotificationConfigRequest, context: Context
    ) -> Empty:
        """Push notifications are not supported yet."""
        return await self._no_push(context, "DeleteTaskPushNotificationConfig")

    async def _no_push(self, context: Context, method: str) -> NoReturn:
        caller(context, method)
        raise PushNotificationNotSupportedError(
            "this agent does not send push notifications (capabilities.pushNotifications is "
            "false); use SendStreamingMessage or SubscribeToTask"
        )

    async def _pump(
        self, sub: Subscription, first: Task | None, context: Context, *, stop_at_interrupt: bool
    ) -> None:
        """Write the snapshot, then every frame of ``sub``, until the stream ends."""
        metrics = self._manager.metrics
        metrics.streams_open += 1
        reason = "error"
        try:
            if first is not None:
                await context.write(StreamResponse(task=first))
            async for frame in sub:
                await context.write(frame)
                if stop_at_interrupt and _interrupts(frame):
                    reason = "interrupted"
                    return
            reason = "finished"
        except SlowSubscriberError:
            reason = "evicted"
            raise
        except asyncio.CancelledError:
            reason = "disconnected"  # grpc.aio cancels the handler of a call the peer left
            raise
        finally:
            sub.close()
            metrics.streams_open -= 1
            metrics.streams_ended[reason] += 1
            async with self._streams_changed:
                self._streams_changed.notify_all()


def _interrupts(frame: StreamResponse) -> bool:
    return (
        frame.WhichOneof("payload") == "status_update"
        and frame.status_update.status.state in taskops.INTERRUPTED
    )


def _trim(task: Task, history_length: int, present: bool) -> None:
    if not present:
        return
    if history_length == 0:
        del task.history[:]
    elif len(task.history) > history_length:
        del task.history[: len(task.history) - history_length]

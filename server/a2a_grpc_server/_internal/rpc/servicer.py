"""The gRPC servicer of ``lf.a2a.v1.A2AService``.

Who runs what: grpc.aio runs each call in its own asyncio task. Unary calls
ask the ``TaskEngine`` and return; stream calls own one ``LogReader`` and
write its frames until the task's log ends them. Frames are kept serialized
in the log and written as they are (``add_to_server`` registers a response
serializer that passes bytes through), so a frame is serialized once however
many streams carry it. A reader never holds up the task or other streams: a
stream whose client stops reading waits in its own write. Errors of every
call go through ``errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from a2a.types import a2a_pb2
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
    Role,
    SendMessageRequest,
    SendMessageResponse,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
)
from a2a.utils.errors import (
    ExtendedAgentCardNotConfiguredError,
    InvalidRequestError,
    PushNotificationNotSupportedError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf import message_factory
from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import Message as ProtoMessage

from .. import errors
from ..config import ServerConfig
from ..engine.engine import TaskEngine
from ..engine.ports import Outcome, TaskOperations
from ..errors import (
    AnswerTooLargeError,
    FrameNotKeptError,
    InvalidFieldError,
    MessageAnswerNotKeptError,
    MessageInProgressError,
    RelayLostError,
    TaskHandedOverError,
)
from ..journal import InvalidPageTokenError, StoreError, TaskQuery
from ..journal.keys import KeyRecord
from ..log.tasklog import LogReader, TaskLog
from ..model import generation, taskops
from ..model.caller import EXTENSIONS_KEY, Caller, caller
from ..push.configs import check_config
from . import idempotency, resume, validation
from .auth import AuthenticationError
from .closing import Closing
from .idempotency import Claim, Patience, Retries

if TYPE_CHECKING:
    from ..push.service import PushService

logger = logging.getLogger(__name__.replace("._internal", ""))

Context = grpc.aio.ServicerContext[Any, Any]
R = TypeVar("R")
SERVICE = a2a_pb2.DESCRIPTOR.services_by_name["A2AService"]


class Undecodable:
    """What a request's deserializer hands over for bytes that are not its message.

    grpc.aio would answer such a call UNKNOWN and log a traceback; the RPC
    answers INVALID_ARGUMENT with ErrorInfo instead (see ``_handled``).
    """

    __slots__ = ("error", "type_name")

    def __init__(self, type_name: str, error: Exception) -> None:
        self.type_name, self.error = type_name, error

    def problem(self) -> InvalidRequestError:
        """The error the call is answered with."""
        return InvalidRequestError(
            f"the request is not a valid {self.type_name} ({type(self.error).__name__}: "
            f"{errors.quote(str(self.error), 120)}); send it serialized as protobuf, "
            "as the stubs generated from proto/ do"
        )


_undecodable_log = errors.RateLimitedLog(logger, logging.DEBUG, period=10.0)


def _decoder(cls: type[ProtoMessage]) -> Callable[[bytes], ProtoMessage | Undecodable]:
    """A request deserializer that never raises (see ``Undecodable``)."""
    name = cls.DESCRIPTOR.full_name

    def decode(data: bytes) -> ProtoMessage | Undecodable:
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError, RecursionError, a bad UTF-8 string, ...
            _undecodable_log.log("undecodable %s (%d bytes): %s", name, len(data), exc)
            return Undecodable(name, exc)

    return decode


def _handled(
    fn: Callable[[Any, Any, Context], Awaitable[R]],
) -> Callable[[Any, Any, Context], Awaitable[R]]:
    """Route every error of an RPC through ``errors.abort``; refuse undecodable requests."""

    @functools.wraps(fn)
    async def call(self: Any, request: Any, context: Context) -> R:
        try:
            if self.closing.started:
                await self.closing.refuse(context)
            if type(request) is Undecodable:
                raise request.problem()
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await errors.abort(context, exc)

    return call


class RpcServicer:
    """Serves every A2A RPC over the task engine.

    Args:
        engine: This instance's engine (its live tasks, runs and metrics).
        config: Limits.
        card: The public agent card (its input modes bound what clients may send).
        extended_card: The card for authenticated clients, if configured.
        operations: What tasks are asked (default ``engine``; in a cluster the
            ``ClusterFront`` above it).
        push: Push notifications (None: push is off, its RPCs are refused).
        closing: How new calls are refused while the server closes (default: a
            ``Closing`` of its own).
        retries: The keys of messages sent (default: none kept, retries run again).
    """

    def __init__(
        self,
        engine: TaskEngine,
        config: ServerConfig,
        card: AgentCard,
        extended_card: AgentCard | None = None,
        operations: TaskOperations | None = None,
        push: PushService | None = None,
        closing: Closing | None = None,
        retries: Retries | None = None,
    ) -> None:
        self._engine = engine
        self._retries = retries if retries is not None else Retries(None)
        self._generation = config.generation
        self._push_service = push
        self.closing = closing if closing is not None else Closing()
        """Begun just before the gRPC server closes: every new call is held, then refused
        UNAVAILABLE (retryable), so none is in flight to be cut (CANCELLED) when it closes."""
        self._ops: TaskOperations = operations if operations is not None else engine
        self._input_modes = validation.input_modes(
            [*card.default_input_modes, *(m for s in card.skills for m in s.input_modes)]
        )
        self._extended_card = extended_card
        self._config = config
        self._streams_changed = asyncio.Condition()
        capabilities = card.capabilities
        self._streaming = not capabilities.HasField("streaming") or capabilities.streaming

    @property
    def open_streams(self) -> int:
        """Stream calls currently being served."""
        return self._engine.tasks.metrics.streams_open

    async def wait_streams_closed(self, at_most: int = 0) -> None:
        """Wait until no more than ``at_most`` stream calls are being served."""
        async with self._streams_changed:
            await self._streams_changed.wait_for(lambda: self.open_streams <= at_most)

    @_handled
    async def SendMessage(
        self, request: SendMessageRequest, context: Context
    ) -> SendMessageResponse:
        """Send a message; wait for a terminal or interrupted state unless asked not to."""
        call = caller(context, "SendMessage", request.tenant)
        validation.check_send(request, self._config, self._input_modes)
        self._check_inline_push(request)
        numbered = await self._activate_send(call, context)
        claim, prior = await self._retries.admit(request, call, self._first_ran(request, call))
        immediately = request.configuration.return_immediately
        if prior is not None:
            prior = await self._readable(prior, request, call)
            answer, seq = await self._replayed(prior, call, numbered, immediately)
        else:
            started = await self._start(request, call, claim, subscribe=False, resumable=numbered)
            answer, seq = await started.outcome(immediately=immediately)
            if claim is not None and isinstance(answer, Message):
                await claim.answered(answer)
        if isinstance(answer, Message):
            return SendMessageResponse(message=answer)
        config = request.configuration
        _trim(answer, config.history_length, config.HasField("history_length"))
        self._stamp(answer, seq, numbered)
        return SendMessageResponse(task=answer)

    @_handled
    async def SendStreamingMessage(self, request: SendMessageRequest, context: Context) -> None:
        """Send a message and stream the task's frames until it ends or needs input."""
        call = caller(context, "SendStreamingMessage", request.tenant)
        self._check_streaming("SendStreamingMessage")
        validation.check_send(request, self._config, self._input_modes)
        self._check_inline_push(request)
        async with self._stream_slot(call):
            numbered = await self._activate_send(call, context)
            claim, prior = await self._retries.admit(request, call, self._first_ran(request, call))
            if prior is not None:
                prior = await self._readable(prior, request, call)
                await self._replay_stream(prior, call, context, numbered)
                return
            started = await self._start(request, call, claim, subscribe=True, resumable=numbered)
            assert started.reader is not None
            await self._pump(
                started.reader,
                started.snapshot,
                context,
                numbered=numbered,
                stop_at_interrupt=True,
            )

    @_handled
    async def SubscribeToTask(self, request: SubscribeToTaskRequest, context: Context) -> None:
        """Stream a live task: its snapshot first, then every frame until it ends.

        With the resume extension and ``a2a-resume-after: N``: exactly the
        frames after N, no snapshot. With ``a2a-resume-fallback: snapshot``
        too, frames no longer kept are answered with the task as it stands
        (``_caught_up``), and the stream goes on after it.
        """
        call = caller(context, "SubscribeToTask", request.tenant)
        self._check_streaming("SubscribeToTask")
        validation.check_task_id(request.id)
        after = resume.resume_after(call)
        fallback = call if resume.snapshot_fallback(call) else None
        async with self._stream_slot(call):
            numbered = await _activate_resume(call, context)
            ops = self._ops
            if after is None:
                snapshot, reader = await ops.subscribe(request.id, call.scope, resumable=numbered)
                await self._pump(reader, snapshot, context, numbered=numbered, fallback=fallback)
                return
            first: Task | None = None
            caught_up_at = 0
            try:
                reader = await ops.resume(request.id, after, call.scope)
            except FrameNotKeptError as exc:
                if fallback is None or resume.past_end(exc):
                    raise
                caught_up_at = after + 1
                first, reader = await self._caught_up(request.id, fallback, caught_up_at)
            await self._pump(
                reader, first, context, numbered=True, fallback=fallback, caught_up_at=caught_up_at
            )

    async def _caught_up(
        self, task_id: str, call: Caller, wanted: int
    ) -> tuple[Task | None, LogReader]:
        """What answers a stream whose frame ``wanted`` is no longer kept (the snapshot fallback).

        A plain subscription's snapshot and reader, taken together as ever (no
        gap, no duplicate); for a task that has ended, the task as recorded and
        a reader that ends at once.

        Returns:
            The task as it stands (None if it includes no change from ``wanted``
            on: nothing was missed), and a reader of the frames after it (of
            those from ``wanted`` on, when nothing was missed).

        Raises:
            As ``TaskOperations.subscribe`` and ``read``: TaskNotFoundError (the
            task is gone), QuotaExceededError (``quota_subscribers``), and in a
            cluster RelayLostError or StoreUnavailableError.
        """
        ops = self._ops
        try:
            snapshot, reader = await ops.subscribe(task_id, call.scope, resumable=True)
        except UnsupportedOperationError:  # it has ended: the record is the whole answer
            snapshot, seq = await ops.read(task_id, call.scope, resumable=True)
            reader = TaskLog.ended(task_id, self._engine.tasks.pool, seq).reader(seq + 1)
        if reader.next_seq > wanted:
            return snapshot, reader
        reader.skip_to(wanted)  # (the stream has every change before ``wanted``)
        return None, reader

    @_handled
    async def GetTask(self, request: GetTaskRequest, context: Context) -> Task:
        """Return a task, its history trimmed to ``history_length``."""
        call = caller(context, "GetTask", request.tenant)
        validation.check_task_id(request.id)
        validation.check_history_length(request.history_length, request.HasField("history_length"))
        numbered = await _activate_resume(call, context)
        task, seq = await self._ops.read(request.id, call.scope, resumable=numbered)
        current = generation.current_generation(request) if self._generation else None
        if current is not None and seq <= current and not taskops.is_final(task):
            await self._moved_past(request.id, current, call, context)
            task, seq = await self._ops.read(request.id, call.scope, resumable=numbered)
        _trim(task, request.history_length, request.HasField("history_length"))
        if task.ByteSize() > self._config.max_task_bytes:  # stored under a higher limit
            raise AnswerTooLargeError(task.id, task.ByteSize(), self._config.max_task_bytes)
        self._stamp(task, seq, numbered)
        return task

    async def _moved_past(self, task_id: str, current: int, call: Caller, context: Context) -> None:
        """Wait until the task moves past generation ``current`` or ends (v1.1's long-poll).

        At most until shortly before the caller's deadline (``generation.wait_for``,
        earlier the more polls wait): then the caller gets the task as it is.
        While it waits, the poll is one of the caller's streams and holds one of
        its task's poll slots (``Quotas.long_poll``); with no slot left it
        answers at once.

        Raises:
            QuotaExceededError: STREAMS_QUOTA, STREAMS_LIMIT or STREAMS_FAIR_SHARE.
        """
        quotas = self._engine.tasks.quotas
        wait = generation.wait_for(context.time_remaining(), quotas.polls_total)
        if not wait:
            return
        with quotas.long_poll(_principal(call), task_id) as slot:
            if not slot:
                return
            reader: LogReader | None = None
            try:
                async with asyncio.timeout(wait):
                    reader = await self._poll_reader(task_id, current, call)
                    if reader is None:
                        return
                    async for seq, _, _ in reader:
                        if seq > current:
                            return
            except (TimeoutError, FrameNotKeptError, TaskHandedOverError, RelayLostError):
                # (the deadline is near, the task moved on, or this instance stops
                # relaying it: the task as it is)
                return
            finally:
                if reader is not None:
                    reader.close()

    async def _poll_reader(self, task_id: str, current: int, call: Caller) -> LogReader | None:
        """A reader that yields the task's next change (None: it moved or ended already).

        A passive reader (no subscriber's place taken): of the task's log when
        it is live here, else (cluster mode) of this instance's relay of it.
        """
        live = self._engine.tasks.live_in(task_id, call.scope)
        if live is not None:
            return live.watch(current)
        return await self._ops.watch(task_id, call.scope, current)

    @_handled
    async def ListTasks(self, request: ListTasksRequest, context: Context) -> ListTasksResponse:
        """List tasks, most recently updated first, with cursor pagination.

        A page holds at most ``page_size`` tasks and at most ``max_task_bytes``
        bytes of them: a page cut short by bytes has a ``next_page_token``
        that continues right after its last task.
        """
        call = caller(context, "ListTasks", request.tenant)
        page_size = validation.check_list(request)
        after = request.status_timestamp_after
        query = TaskQuery(
            context_id=request.context_id,
            state=request.status,
            status_after_ns=after.seconds * 1_000_000_000 + after.nanos,
            page_size=page_size,
            page_token=request.page_token,
            scope=call.scope,
        )
        try:
            page = await self._engine.tasks.journal.list(query)
        except InvalidPageTokenError as exc:
            raise InvalidFieldError("page_token", str(exc)) from None
        answer = ListTasksResponse(page_size=page_size, total_size=page.total_size)
        budget = self._config.max_task_bytes
        for i, listed in enumerate(page.tasks):
            task = self._engine.tasks.current(listed)
            _trim(task, request.history_length, request.HasField("history_length"))
            if not request.include_artifacts:
                del task.artifacts[:]
            budget -= task.ByteSize()
            if budget < 0:
                if i == 0:
                    raise AnswerTooLargeError(task.id, task.ByteSize(), self._config.max_task_bytes)
                answer.next_page_token = page.after[i - 1]
                return answer
            answer.tasks.append(task)
        answer.next_page_token = page.next_page_token
        return answer

    @_handled
    async def CancelTask(self, request: CancelTaskRequest, context: Context) -> Task:
        """Cancel a task; returns it CANCELED once every stream has the frame."""
        call = caller(context, "CancelTask", request.tenant)
        validation.check_task_id(request.id)
        return await self._ops.cancel(request.id, call)

    @_handled
    async def GetExtendedAgentCard(
        self, request: GetExtendedAgentCardRequest, context: Context
    ) -> AgentCard:
        """Return the extended agent card to an authenticated caller, if one is configured."""
        call = caller(context, "GetExtendedAgentCard", request.tenant)
        if self._extended_card is None:
            raise ExtendedAgentCardNotConfiguredError(
                "this agent has no extended agent card; use the public card"
            )
        if call.principal is None:
            raise AuthenticationError(
                "the extended agent card is for authenticated callers; this server "
                "authenticates nobody, so it serves only the public card"
            )
        return self._extended_card

    @_handled
    async def CreateTaskPushNotificationConfig(
        self, request: TaskPushNotificationConfig, context: Context
    ) -> TaskPushNotificationConfig:
        """Register a webhook for a task (an id is assigned when none is given)."""
        push, call = self._push(context, "CreateTaskPushNotificationConfig", request.tenant)
        validation.check_task_id(request.task_id, "task_id")
        check_config(request, push.screen)
        return await push.create(request, call.scope)

    @_handled
    async def GetTaskPushNotificationConfig(
        self, request: GetTaskPushNotificationConfigRequest, context: Context
    ) -> TaskPushNotificationConfig:
        """Return one webhook config of a task."""
        push, call = self._push(context, "GetTaskPushNotificationConfig", request.tenant)
        validation.check_task_id(request.task_id, "task_id")
        validation.check_id(request.id, "id")
        return await push.get(request.task_id, request.id, call.scope)

    @_handled
    async def ListTaskPushNotificationConfigs(
        self, request: ListTaskPushNotificationConfigsRequest, context: Context
    ) -> ListTaskPushNotificationConfigsResponse:
        """List a task's webhook configs, oldest first, with cursor pagination."""
        push, call = self._push(context, "ListTaskPushNotificationConfigs", request.tenant)
        validation.check_task_id(request.task_id, "task_id")
        page_size = validation.check_page(request.page_size, request.page_token)
        page = await push.list(request.task_id, page_size, request.page_token, call.scope)
        return ListTaskPushNotificationConfigsResponse(
            configs=page.configs, next_page_token=page.next_token
        )

    @_handled
    async def DeleteTaskPushNotificationConfig(
        self, request: DeleteTaskPushNotificationConfigRequest, context: Context
    ) -> Empty:
        """Delete a webhook config (idempotent: a config already gone is not an error)."""
        push, call = self._push(context, "DeleteTaskPushNotificationConfig", request.tenant)
        validation.check_task_id(request.task_id, "task_id")
        validation.check_id(request.id, "id")
        await push.delete(request.task_id, request.id, call.scope)
        return Empty()

    def _push(self, context: Context, method: str, tenant: str) -> tuple[PushService, Caller]:
        call = caller(context, method, tenant)
        push = self._push_service
        if push is None:
            raise _push_off()
        return push, call

    def _check_inline_push(self, request: SendMessageRequest) -> None:
        """Refuse a message's push config that is malformed, or any when push is off."""
        if not request.configuration.HasField("task_push_notification_config"):
            return
        push = self._push_service
        if push is None:
            raise _push_off()
        config = request.configuration.task_push_notification_config
        check_config(config, push.screen, "configuration.task_push_notification_config.")

    def _check_streaming(self, method: str) -> None:
        if not self._streaming:
            raise UnsupportedOperationError(
                f"{method}: this agent does not stream (capabilities.streaming is false in its "
                "card); use SendMessage and GetTask"
            )

    @contextlib.asynccontextmanager
    async def _stream_slot(self, call: Caller) -> AsyncIterator[None]:
        """Hold one of the caller's streams (``quotas``) while a stream call is served.

        Raises:
            QuotaExceededError: The caller has ``quota_streams`` open streams.
        """
        try:
            with self._engine.tasks.quotas.stream(_principal(call)):
                yield
        finally:
            async with self._streams_changed:  # (after the stream is counted out)
                self._streams_changed.notify_all()

    async def _start(
        self,
        request: SendMessageRequest,
        call: Caller,
        claim: Claim | None,
        *,
        subscribe: bool,
        resumable: bool,
    ) -> Outcome:
        """Send the message; with a claim, say what it started (``idempotency``).

        The start and its record are shielded from the caller leaving (a cut
        connection cancels the call): what started is recorded, so a retry
        finds it, and a reader made for the caller who left is closed.

        A new task's start on this instance's engine, with keys kept in this
        process (``SentKeys.immediate``), needs no shield: nothing waits between
        the run's spawn and its record, and nothing before the spawn is kept
        when it fails (the new task is abandoned), so a cut lands before the
        spawn (nothing started; the key is let go) or not at all. A follow-up
        records its message in the task before its run spawns, and a start
        through a cluster front may wait on the owner after its run started:
        both are shielded.
        """
        if claim is None:
            return await self._ops.send(request, call, subscribe=subscribe, resumable=resumable)

        async def start() -> Outcome:
            try:
                started = await self._ops.send(
                    request, call, subscribe=subscribe, resumable=resumable
                )
            except BaseException as exc:
                await claim.release(exc, request.message.task_id)
                raise
            try:
                await claim.started(started.task_id, started.since)
            except StoreError as exc:  # (a retry takes the key over once it is abandoned)
                logger.warning("task %s: its message id not recorded: %s", started.task_id, exc)
            return started

        new_here = self._ops is self._engine and not request.message.task_id
        if new_here and getattr(claim.keys, "immediate", False):  # (an embedder's keys may not say)
            return await start()
        job = asyncio.ensure_future(start())
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(_close_reader)  # (the caller left: its reader is nobody's)
            raise

    def _first_ran(self, request: SendMessageRequest, call: Caller) -> idempotency.FirstRan:
        """How a retry tells whether its first request, routed with no answer, ran.

        It ran if its message (the user's, with its id and parts) is in the
        task's history after what the history held when it was sent (a message
        id may have been used before). It never will if the task ended or is
        gone (the retry is then refused as any message to it), another
        instance (or none) holds it now (the owner asked can no longer write
        it), or the time the owner could act on it is past. Else it may yet
        (None).
        """
        sent = request.message

        async def ran(prior: KeyRecord) -> bool | None:
            try:
                found = await self._engine.tasks.recorded(prior.task_id, call.scope)
            except TaskNotFoundError:
                return False
            for message in found.task.history[prior.seen :]:
                if (
                    message.message_id == sent.message_id
                    and message.role == Role.ROLE_USER
                    and message.parts == sent.parts
                ):
                    return True
            if taskops.is_final(found.task) or found.owner != prior.asked:
                return False
            return None if time.time() < prior.until else False

        return ran

    async def _readable(
        self, prior: KeyRecord, request: SendMessageRequest, call: Caller
    ) -> KeyRecord:
        """The first request's record once its task can be read, or it answered a message.

        A new task exists from its executor's first event: a retry that comes
        sooner waits for it (within its deadline, at most ``WAIT_FIRST`` s).

        Raises:
            MessageInProgressError: The task did not appear in that time.
            MessageAnswerNotKeptError: The first was answered with a message too
                large to keep.
        """
        patience = Patience(call)
        while not prior.answer:
            if prior.dropped:
                raise MessageAnswerNotKeptError(
                    "the first request with this message id was answered with a message too "
                    "large to keep for retries; send a new message (a new id)"
                )
            with contextlib.suppress(TaskNotFoundError):  # (its run has said nothing yet)
                await self._ops.read(prior.task_id, call.scope)
                return prior
            if not await patience.wait():
                raise MessageInProgressError(
                    f"the first request's task {errors.quote(prior.task_id)} has not "
                    "started yet; retry"
                )
            claim, again = await self._retries.admit(request, call)
            if claim is not None:  # (its window ended meanwhile: nothing to answer)
                await claim.release(TaskNotFoundError())
                raise TaskNotFoundError(message=f"task {errors.quote(prior.task_id)} not found")
            assert again is not None
            prior = again
        return prior

    async def _replayed(
        self, prior: KeyRecord, call: Caller, numbered: bool, immediately: bool
    ) -> tuple[Task | Message, int]:
        """What a retried SendMessage answers: the first request's outcome (``idempotency``)."""
        if prior.answer:
            return Message.FromString(prior.answer), 0
        ops = self._ops
        if not immediately:
            try:
                snapshot, reader = await ops.subscribe(
                    prior.task_id, call.scope, resumable=numbered
                )
            except UnsupportedOperationError:
                pass  # ended: its record is the answer
            else:
                try:
                    if not _past(snapshot.status.state, reader.next_seq - 1, prior.after):
                        async for seq, _, state in reader:
                            if _past(state, seq, prior.after):
                                break
                finally:
                    reader.close()
        return await ops.read(prior.task_id, call.scope, resumable=numbered)

    async def _replay_stream(
        self, prior: KeyRecord, call: Caller, context: Context, numbered: bool
    ) -> None:
        """What a retried SendStreamingMessage streams (``idempotency``).

        The task as it stands, then its frames up to the first request's outcome.
        """
        if prior.answer:
            await context.write(StreamResponse(message=Message.FromString(prior.answer)))
            return
        ops = self._ops
        try:
            snapshot, reader = await ops.subscribe(prior.task_id, call.scope, resumable=numbered)
        except UnsupportedOperationError:  # ended: one frame, the task as recorded
            task, seq = await ops.read(prior.task_id, call.scope, resumable=numbered)
            self._stamp(task, seq, numbered)
            await context.write(StreamResponse(task=task))
            return
        if _past(snapshot.status.state, reader.next_seq - 1, prior.after):
            reader.close()  # (it waits already: nothing more comes for this message)
            self._stamp(snapshot, reader.next_seq - 1, numbered)
            await context.write(StreamResponse(task=snapshot))
            return
        await self._pump(reader, snapshot, context, numbered=numbered, stop_at_interrupt=True)

    async def _activate_send(self, call: Caller, context: Context) -> bool:
        """Say which extensions a send activated (resume, idempotency); whether it is numbered."""
        numbered = resume.activated(call)
        uris = [resume.URI] if numbered else []
        if self._retries.activated(call):
            uris.append(idempotency.URI)
        if uris:
            await context.send_initial_metadata(((EXTENSIONS_KEY, ", ".join(uris)),))
        return numbered

    def _stamp(self, task: Task, seq: int, numbered: bool, skipped_from: int = 0) -> None:
        """Number a Task answered or streamed: its generation, and the resume extension's.

        ``skipped_from``: the task stands in for the frames from that one to
        ``seq`` (see ``resume.tag_task``).
        """
        if self._generation:
            generation.tag_task(task, seq)
        if numbered:
            resume.tag_task(task, seq, skipped_from)

    async def _pump(
        self,
        reader: LogReader,
        first: Task | None,
        context: Context,
        *,
        numbered: bool,
        stop_at_interrupt: bool = False,
        fallback: Caller | None = None,
        caught_up_at: int = 0,
    ) -> None:
        """Write the snapshot, then every frame ``reader`` yields, until the stream ends.

        Args:
            reader: The stream's reader (the pump closes it).
            first: The task to write first (None: none), as of ``reader``'s start.
            context: The call.
            numbered: Frames carry the resume extension's numbers.
            stop_at_interrupt: End after an INPUT_REQUIRED or AUTH_REQUIRED frame.
            fallback: The call asked for the snapshot fallback: a frame no
                longer kept is answered with the task as it stands (``_caught_up``).
            caught_up_at: ``reader`` and ``first`` answer a stream that missed this
                frame (0: they do not); ``first`` stands in for the frames from it on.

        A catch-up is not repeated for the frame it answered: a reader that then
        misses that same frame (a record that cannot tell the task past an older
        snapshot) ends OUT_OF_RANGE, so the stream never loops.
        """
        metrics = self._engine.tasks.metrics
        metrics.streams_open += 1
        reason = "error"
        try:
            while True:
                if first is not None:
                    self._stamp(first, reader.next_seq - 1, numbered, caught_up_at)
                    await context.write(StreamResponse(task=first))
                try:
                    reason = await self._write_frames(reader, context, numbered, stop_at_interrupt)
                    return
                except FrameNotKeptError as exc:
                    if fallback is None or resume.past_end(exc) or exc.wanted <= caught_up_at:
                        reason = "out_of_range"
                        raise
                    reader.close()
                    caught_up_at = exc.wanted
                    first, reader = await self._caught_up(reader.task_id, fallback, caught_up_at)
        except grpc.aio.InternalError:
            # A write to a call whose client left (grpc raises ExecuteBatchError, a
            # grpc.aio.InternalError, rather than cancelling us, depending on timing):
            # the stream is over, nothing to report. Raising it would log a traceback.
            reason = "disconnected"
            return
        except asyncio.CancelledError:
            reason = "disconnected"  # grpc.aio cancels the handler of a call the peer left
            raise
        finally:
            reader.close()
            metrics.streams_open -= 1
            metrics.streams_ended[reason] += 1

    async def _write_frames(
        self, reader: LogReader, context: Context, numbered: bool, stop_at_interrupt: bool
    ) -> str:
        """Write every frame ``reader`` yields; return why the stream ended.

        Raises:
            FrameNotKeptError: The reader's next frame is no longer kept.
        """
        pacer = self._engine.runs.pacer
        stamped = self._generation
        async for seq, frame, state in reader:
            if pacer.due():  # a burst: the loop polls its I/O first (see ``pacing``)
                await pacer.wait()
            if stamped:
                frame = generation.tag(_frame_bytes(frame), seq)
            await context.write(resume.tag(frame, seq) if numbered else frame)
            if stop_at_interrupt and state in taskops.INTERRUPTED:
                return "interrupted"
        return "finished"


def _past(state: int, seq: int, after: int) -> bool:
    """Whether a task in ``state`` at change ``seq`` answers a message run after ``after``.

    It does when final, or interrupted by a change of that run.
    """
    return taskops.is_final_state(state) or (state in taskops.INTERRUPTED and seq > after)  # type: ignore[arg-type]


def _close_reader(job: asyncio.Future[Outcome]) -> None:
    if not job.cancelled() and job.exception() is None:
        reader = job.result().reader
        if reader is not None:
            reader.close()


async def _activate_resume(call: Caller, context: Context) -> bool:
    """Whether the call activated the resume extension; if so, say it was activated."""
    if not resume.activated(call):
        return False
    await context.send_initial_metadata(((EXTENSIONS_KEY, resume.URI),))
    return True


def _principal(call: Caller) -> str:
    return call.principal.name if call.principal is not None else ""


def _push_off() -> PushNotificationNotSupportedError:
    return PushNotificationNotSupportedError(
        "this server does not send push notifications (capabilities.pushNotifications is "
        "false); use SendStreamingMessage or SubscribeToTask"
    )


def _trim(task: Task, history_length: int, present: bool) -> None:
    if not present:
        return
    if history_length == 0:
        del task.history[:]
    elif len(task.history) > history_length:
        del task.history[: len(task.history) - history_length]


def _frame_bytes(frame: StreamResponse | bytes) -> bytes:
    """A stream's response serializer: frames from a log are already serialized."""
    if isinstance(frame, bytes):
        return frame
    return frame.SerializeToString()


def add_to_server(servicer: RpcServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` for every method of ``lf.a2a.v1.A2AService`` on ``server``.

    As the generated ``add_A2AServiceServicer_to_server``, except that stream
    methods accept frames already serialized.
    """
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in SERVICE.methods:
        decode = _decoder(message_factory.GetMessageClass(method.input_type))
        response = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(  # type: ignore[no-untyped-call]
                behavior, request_deserializer=decode, response_serializer=_frame_bytes
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(  # type: ignore[no-untyped-call]
                behavior,
                request_deserializer=decode,
                response_serializer=response.SerializeToString,
            )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)  # type: ignore[no-untyped-call]
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)

"""Routed requests: CancelTask and follow-up messages sent to the task's owner.

Core NATS request/reply on ``a2a.ctl.<owner id>.cancel`` and ``.send``. The
owner serves each request in its own task (tracked, so shutdown waits for
them) by calling its engine's local path, exactly as for a call it received
itself: the cancel's frames go through the owner's journal and log, never
around them. Errors come back as a header naming the domain error
class, and are raised again on the asking instance.

The asker believes only an answer signed for its request (``signing``).
NATS's own "no responders" status (``Status: 503``, no payload) is not signed:
any client of the bus that reads the request can put one in the inbox while
the owner acts. So it only makes the asker read the owner's heartbeat
(``_Heartbeat``): the request fails as unanswered (``OwnerUnavailableError``,
nothing was done) once the owner's key is gone (it left) or has not changed
for a whole lease (it died: the rule ``lease`` judges by); while the owner
heartbeats, the asker waits for the owner's answer until its own deadline.

Who runs what: nats-py calls ``_on_request`` in the subscription's task (one
per operation, each message in turn); it checks the request's signature,
then spawns the serving task and returns, so one slow cancel never delays
another. At most ``in_flight`` requests are served at once (NatsConfig's
``routed_in_flight``): past it a cancel or follow-up is answered at once
with ``OwnerUnavailableError`` (UNAVAILABLE, retryable: nothing was done, so
no task is lost or half-changed), while a push request waits in its
subscription's callback for room (NATS holds what arrives meanwhile, within
the subscription's pending limits): refusing it would leave its config
without a deliverer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors
from a2a.types.a2a_pb2 import SendMessageRequest, Task
from a2a.utils.errors import A2AError, InternalError
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js.kv import KeyValue

from ..cluster.routed import (
    ANSWER_MARGIN,
    ERROR,
    decode_caller,
    decode_error,
    default_wait,
    encode_caller,
    encode_error,
)
from ..errors import (
    OwnerTimeoutError,
    OwnerTooLateError,
    OwnerUnavailableError,
    RateLimitedLog,
    ServerError,
    UnknownFormatError,
    UnsignedMessageError,
)
from ..journal.keys import PENDING_FOR
from ..model.caller import Caller
from ..model.names import TASK_PREFIX
from ..obs import tracing
from .conn import CONTROL_SUBJECT
from .formats import CURRENT, check_header
from .formats import HEADER as FORMAT
from .retry import REQUEST_TIMEOUT
from .signing import ANSWERS, MAX_SKEW, REPLY_TO, Signer

if TYPE_CHECKING:
    from ..cluster import Local

logger = logging.getLogger(__name__.replace("._internal", ""))
_refused_log = RateLimitedLog(logger, logging.WARNING, period=10.0)

CALL_HEADERS = "A2a-Call-Headers"
"""The caller's gRPC metadata, a JSON list of [key, value] pairs (credentials left out)."""
CALLER = "A2a-Caller"
"""Who called: a JSON list [principal name or null, tenant] (see ``routed.encode_caller``)."""
STATUS, NO_RESPONDERS = "Status", "503"
"""How NATS says, in the inbox, that nobody serves a request's subject (unsigned: a hint)."""
TIMEOUT = "A2a-Timeout"
"""Seconds the asking instance waits for the answer (the client's deadline, or the default)."""


def control_subject(instance_id: str, op: str) -> str:
    """The subject on which ``instance_id`` serves ``op``."""
    return f"{CONTROL_SUBJECT}.{instance_id}.{op}"


class Router:
    """Serves this instance's routed requests and sends requests to owners.

    Args:
        nc: The NATS connection.
        instance_id: This instance's id.
        cancel_timeout: The engine's ``cancel_timeout`` (see ``routed.default_wait``).
        signer: Signs requests and answers, and checks those received (``signing``).
        heartbeats: The instances' heartbeats (``A2A_INSTANCES``), read when NATS
            says nobody serves an owner (see the module docstring).
        lease: The cluster's lease (``NatsConfig.lease``).
        in_flight: Most requests served at once (see the module docstring).
        retry_for: How long the owner's writes retry through a NATS outage
            (``NatsConfig.retry_for``): part of how long a request not answered
            may still act (``OwnerTimeoutError.until``).
    """

    def __init__(
        self,
        nc: Client,
        instance_id: str,
        cancel_timeout: float,
        signer: Signer,
        *,
        heartbeats: KeyValue,
        lease: float,
        in_flight: int = 256,
        retry_for: float = 30.0,
    ) -> None:
        self._nc = nc
        self._retry_for = retry_for
        self._signer = signer
        self._heartbeats, self._lease = heartbeats, lease
        self._id = instance_id
        self._bound = default_wait(cancel_timeout)
        self._subs: list[NatsSubscription] = []
        self._serving: set[asyncio.Task[None]] = set()
        self._room = asyncio.Semaphore(in_flight)
        self._in_flight = in_flight
        self._local: Local | None = None

    async def start(self, local: Local) -> None:
        """Serve routed cancels, follow-ups and pushes with ``local``."""
        self._local = local
        for op in ("cancel", "send", "push"):
            self._subs.append(
                await self._nc.subscribe(control_subject(self._id, op), cb=self._on_request)
            )

    async def stop(self) -> None:
        """Stop taking requests: drain (serve what already arrived), then wait for them."""
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):  # the connection is already closed
                await sub.drain()
        self._subs.clear()
        while self._serving:
            await asyncio.gather(*self._serving, return_exceptions=True)

    async def cancel(self, owner: str, task_id: str, call: Caller) -> Task:
        """Ask ``owner`` to cancel ``task_id``; return the task it ended.

        Raises:
            TaskNotCancelableError: The task ended before it could be canceled.
            OwnerUnavailableError: The owner did not answer.
        """
        reply = await self._request(owner, "cancel", task_id.encode(), call)
        return Task.FromString(reply)

    async def send(self, owner: str, request: SendMessageRequest, call: Caller) -> None:
        """Ask ``owner`` to start a follow-up message on its task.

        Raises:
            UnsupportedOperationError: The task does not take a message now.
            OwnerUnavailableError: The owner did not answer.
        """
        await self._request(owner, "send", request.SerializeToString(), call)

    async def push(self, owner: str, task_id: str, config_id: str, call: Caller) -> None:
        """Ask ``owner`` to start delivering a push config stored for its task.

        Raises:
            OwnerUnavailableError: The owner did not answer.
        """
        await self._request(owner, "push", json.dumps([task_id, config_id]).encode(), call)

    async def _request(self, owner: str, op: str, payload: bytes, call: Caller) -> bytes:
        # The client's deadline, if it set one, bounds the wait; the owner is told,
        # so it starts nothing it could not answer in time.
        # (answering ANSWER_MARGIN before the client gives up, so it gets our reason).
        timeout = self._bound if call.timeout is None else call.timeout - ANSWER_MARGIN
        # (a keyed request's key stays pending while it waits: less than the time a
        # retry takes a pending key for abandoned)
        timeout = min(timeout, PENDING_FOR / 2)
        if timeout <= 0:
            raise OwnerTooLateError("too little of the call's deadline is left to ask the owner")
        metadata, who = encode_caller(call)
        headers = {
            CALL_HEADERS: metadata,
            CALLER: who,
            TIMEOUT: f"{timeout:.3f}",
            FORMAT: str(CURRENT),  # (an older owner ignores it: the layout is format 1's)
        }
        try:
            msg = await self._ask(owner, op, payload, headers, timeout, grow=call.timeout is None)
        except nats.errors.NoRespondersError as exc:
            raise OwnerUnavailableError(
                f"instance {owner}, which runs this task, is not reachable; if it is gone, "
                "the task ends FAILED (or, waiting for input, is released) once its lease expires"
            ) from exc
        except nats.errors.TimeoutError as exc:
            # It may have acted: say so, rather than that it is unavailable.
            unknown = OwnerTimeoutError(
                f"instance {owner}, which runs this task, did not answer within {timeout:.1f} s; "
                "the request may or may not have taken effect (GetTask tells)"
            )
            unknown.until = self._acts_until(timeout)
            raise unknown from exc
        except nats.errors.Error as exc:  # e.g. this instance's connection is closing
            raise OwnerUnavailableError(
                f"could not reach instance {owner}, which runs this task "
                f"({type(exc).__name__}); retry"
            ) from exc
        error = decode_error(msg.data, msg.headers or {})
        if error is not None:
            raise error
        return bytes(msg.data)

    def _acts_until(self, timeout: float) -> float:
        """When (wall clock) the owner of a request just unanswered can no longer act on it.

        It was signed about ``timeout`` ago; the owner took it within ``MAX_SKEW``
        of its own clock (which may be ``MAX_SKEW`` off this one), records
        nothing past ``timeout`` after receipt (``Caller.act_by``), and a write
        begun by then lands within one ``Retry`` (``retry_for`` and an attempt
        either side). Another instance judging the time may be ``MAX_SKEW`` off.
        """
        write = self._retry_for + 2 * REQUEST_TIMEOUT
        return time.time() + 3 * MAX_SKEW + timeout + write

    async def _ask(
        self,
        owner: str,
        op: str,
        payload: bytes,
        headers: dict[str, str],
        wait: float,
        *,
        grow: bool,
    ) -> Msg:
        """Send a request to ``owner`` and return its answer.

        The answer is the first one signed for this very request (see
        ``signing``); anything else arriving in the inbox meanwhile is ignored.
        A bare "no responders" status makes this read the owner's heartbeat
        (module docstring); with ``grow`` (the client set no deadline), the wait
        is then at least ``_Heartbeat.patience``, long enough to tell.

        Raises:
            nats.errors.NoRespondersError: Nobody serves the owner's subject (NATS
                says so, and, when requests are signed, the owner's heartbeat agrees).
            nats.errors.TimeoutError: No good answer within ``wait`` seconds.
        """
        subject, signer = control_subject(owner, op), self._signer
        if not signer.signing:
            return await self._nc.request(subject, payload, timeout=wait, headers=headers)
        inbox = self._nc.new_inbox()
        headers[REPLY_TO] = inbox
        nonce = signer.sign(subject, headers, payload)
        sub = await self._nc.subscribe(inbox)
        try:
            await self._nc.publish(subject, payload, reply=inbox, headers=headers)
            loop = asyncio.get_running_loop()
            deadline, heartbeat = loop.time() + wait, None
            while (left := deadline - loop.time()) > 0:
                step = left if heartbeat is None else min(left, heartbeat.period)
                try:
                    msg: Msg | None = await sub.next_msg(timeout=step)
                except nats.errors.TimeoutError:
                    msg = None
                if msg is not None and self._answers(msg, subject, nonce):
                    return msg
                if msg is not None and heartbeat is None and _no_responders(msg):
                    heartbeat = _Heartbeat(self._heartbeats, owner, self._lease)
                    if grow:
                        deadline = max(deadline, loop.time() + heartbeat.patience)
                if heartbeat is not None and await heartbeat.gone(deadline - loop.time()):
                    while sub.pending_msgs:  # (an answer that came meanwhile wins)
                        queued = await sub.next_msg(timeout=None)
                        if self._answers(queued, subject, nonce):
                            return queued
                    raise nats.errors.NoRespondersError
            raise nats.errors.TimeoutError
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def _answers(self, msg: Msg, subject: str, nonce: str) -> bool:
        """Whether ``msg``, in the inbox of the request ``nonce`` to ``subject``, answers it."""
        answer = msg.headers or {}
        if _no_responders(msg):
            return False  # (unsigned, whatever the bus is trusted with: see _ask)
        try:
            signed = self._signer.check(msg.subject, answer, msg.data, answer=True)
        except UnsignedMessageError as exc:
            _refused_log.log("an answer to routed %s ignored: %s", subject, exc)
            return False
        if signed and answer.get(ANSWERS) != nonce:  # (unsigned: trust_bus)
            _refused_log.log("an answer to routed %s ignored: not its own", subject)
            return False
        return True

    async def _on_request(self, msg: Msg) -> None:
        op = msg.subject.rsplit(".", 1)[-1]
        serve = {
            "cancel": self._serve_cancel,
            "push": self._serve_push,
            "send": self._serve_send,
        }.get(op, self._serve_unknown)
        headers = msg.headers or {}
        try:
            nonce = self._signer.check(msg.subject, headers, msg.data)
            if nonce and headers.get(REPLY_TO) != msg.reply:
                raise UnsignedMessageError("a routed request whose answer goes elsewhere")
        except UnsignedMessageError as exc:
            # Not answered: an answer signed here is one a forger could use.
            _refused_log.log("routed %s refused, not answered: %s", msg.subject, exc)
            return
        if self._room.locked() and op != "push":
            _refused_log.log("routed %s refused: %d requests in flight", op, self._in_flight)
            busy = OwnerUnavailableError(
                f"instance {self._id}, which runs this task, is serving {self._in_flight} "
                "routed requests (routed_in_flight); nothing was done: retry"
            )
            await self._answer(msg, nonce, *encode_error(busy))
            return
        await self._room.acquire()  # (at once, but for a push while full: see above)
        task = asyncio.create_task(
            self._serve(msg, nonce, serve), name=f"{TASK_PREFIX}:routed-{op}"
        )
        self._serving.add(task)
        task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        self._serving.discard(task)
        self._room.release()

    async def _serve(
        self, msg: Msg, nonce: str, serve: Callable[[Msg, Caller], Awaitable[bytes]]
    ) -> None:
        headers = msg.headers or {}
        received = asyncio.get_running_loop().time()
        reply_headers: dict[str, str] | None
        try:
            check_header(headers, "a routed request")
            if CALLER not in headers:
                raise UnknownFormatError("a routed request without its caller", "none")
            timeout = float(headers.get(TIMEOUT, self._bound))
            call = decode_caller(headers.get(CALL_HEADERS, "[]"), headers[CALLER], timeout)
            if timeout < ANSWER_MARGIN:
                raise OwnerTooLateError("the request reached the task's owner too late to act")
            call.act_by = received + timeout  # (a follow-up records nothing after it)
            with tracing.routed(msg.subject.rsplit(".", 1)[-1], call.headers):
                reply, reply_headers = await serve(msg, call), None
        except (A2AError, ServerError) as exc:
            reply, reply_headers = encode_error(exc)
        except Exception:
            logger.exception("routed %s failed", msg.subject)
            reply = b"internal error on the instance running the task; its log has the details"
            reply_headers = {ERROR: InternalError.__name__}
        if asyncio.get_running_loop().time() - received > float(headers.get(TIMEOUT, "inf")):
            logger.warning("routed %s took longer than its asker waits", msg.subject)
        await self._answer(msg, nonce, reply, reply_headers)

    async def _answer(
        self, msg: Msg, nonce: str, reply: bytes, reply_headers: dict[str, str] | None
    ) -> None:
        answer_headers = dict(reply_headers or {})
        if nonce:
            answer_headers[ANSWERS] = nonce
        self._signer.sign(msg.reply, answer_headers, reply)
        try:
            await self._nc.publish(msg.reply, reply, headers=answer_headers or None)
        except nats.errors.Error as exc:
            logger.warning("could not answer routed %s: %s", msg.subject, type(exc).__name__)

    async def _serve_unknown(self, msg: Msg, call: Caller) -> bytes:
        raise UnknownFormatError("a routed request", f"operation {msg.subject.rsplit('.', 1)[-1]}")

    async def _serve_cancel(self, msg: Msg, call: Caller) -> bytes:
        assert self._local is not None
        task = await self._local.owner.cancel(msg.data.decode(), call)
        return task.SerializeToString()

    async def _serve_push(self, msg: Msg, call: Caller) -> bytes:
        assert self._local is not None
        task_id, config_id = json.loads(msg.data)
        push = self._local.push
        if push is not None:
            await push.follow_stored(str(task_id), str(config_id))
        return b""

    async def _serve_send(self, msg: Msg, call: Caller) -> bytes:
        assert self._local is not None
        await self._local.owner.send(SendMessageRequest.FromString(msg.data), call, subscribe=False)
        return b""


def _no_responders(msg: Msg) -> bool:
    """Whether ``msg`` is NATS's "no responders" status (or looks like it: anyone may send one)."""
    return (msg.headers or {}).get(STATUS) == NO_RESPONDERS and not msg.data


class _Heartbeat:
    """A task's owner's heartbeat, read after a "no responders" status came for it.

    The owner is gone when its key is (it left: ``Lease.stop`` deletes it; or
    it expired), or when the key kept one revision for a whole lease from the
    first read (it died: a live instance writes every quarter lease, and
    survivors judge by the same lease); it is alive once the revision moves,
    and is not read again. A read that fails or is late tells nothing. At most
    one read a ``period``, however many statuses come.

    Args:
        heartbeats: The instances' heartbeats.
        owner: The owner's instance id (its key).
        lease: The cluster's lease.
    """

    def __init__(self, heartbeats: KeyValue, owner: str, lease: float) -> None:
        self._kv, self._owner, self._lease = heartbeats, owner, lease
        self.period = lease / 4
        """Seconds between two reads."""
        self._first: tuple[float, int] | None = None
        """When the key was first read, and its revision then."""
        self._next = 0.0
        self._alive = False

    @property
    def patience(self) -> float:
        """Seconds after the first read by which a dead owner is told from a live one."""
        return self._lease + 2 * self.period

    async def gone(self, within: float) -> bool:
        """Read the key if a read is due (bounded by ``within`` s); whether the owner is gone."""
        now = asyncio.get_running_loop().time()
        if self._alive or now < self._next or within <= 0:
            return False
        self._next = now + self.period
        try:
            async with asyncio.timeout(within):
                entry = await self._kv.get(self._owner)
        except nats.js.errors.KeyNotFoundError:  # (deleted, purged or expired)
            return True
        except (nats.errors.Error, TimeoutError):
            return False
        revision = entry.revision or 0
        if self._first is None:
            self._first = (now, revision)
            return False
        if revision != self._first[1]:
            self._alive = True
            return False
        return now - self._first[0] >= self._lease

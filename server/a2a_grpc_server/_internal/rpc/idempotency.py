"""Idempotent SendMessage: a retried request runs nothing twice (the idempotency extension).

Meshes and clients retry a SendMessage or SendStreamingMessage whose call
failed, and the first attempt may have reached the executor before its
connection broke. A client asks for safe retries per call (``asks``): it
names ``URI`` in ``a2a-extensions``, or sends ``idempotency-key`` metadata.
A call that does not ask is run as sent, as by any A2A server: conformance
kits and demo clients send one message id with different messages, and a
behaviour that changes what a request means is one the client opts into.
(``idempotency_every_request`` keys every call, for meshes whose clients all
retry.) Each keyed request is keyed by the caller's scope and its
``message.message_id`` (or the ``idempotency-key`` metadata, when a client
sends one: for clients that reuse message ids by mistake). The first request
with a key claims it (``journal.keys``; in cluster mode a compare-and-set in
JetStream, so a retry through another instance finds it too) and runs; a
later one with the same key and the same body, within
``idempotency_window``, starts and continues nothing: it is answered what
the first was (the servicer's ``_replay``): the same task, once its first
final or interrupted state after the first request's message, or, streaming,
the task as it stands and then its frames up to that state. One with another
body is refused INVALID_ARGUMENT ``MESSAGE_ID_REUSED``. A retry that finds the
first request still starting waits for it (within its deadline, at most
``WAIT_FIRST`` seconds; past that UNAVAILABLE ``MESSAGE_IN_PROGRESS``, nothing
done). A first request refused before its run started (a bad task id, a
quota) releases its key: a retry starts afresh. Keys are per scope: another
caller's identical id is another key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from a2a.types.a2a_pb2 import AgentExtension, Message, SendMessageRequest
from google.protobuf import struct_pb2

from ..errors import (
    InvalidFieldError,
    MessageInProgressError,
    MessageKeyReusedError,
    OwnerTimeoutError,
    quote,
)
from ..journal import StoreError
from ..journal.keys import KeyRecord, SentKeys
from ..model.caller import Caller
from ..model.scope import principal_of

logger = logging.getLogger(__name__.replace("._internal", ""))

URI = "urn:a2a-grpc-server:extension:idempotency:v1"
"""The extension's URI, on the agent card."""
KEY_HEADER = "idempotency-key"
"""The call metadata naming a key instead of the message id."""
MAX_KEY_CHARS = 256
WAIT_FIRST = 10.0
"""Most seconds a retry waits for its first request to start."""


def extension(window: float, every_request: bool = False) -> AgentExtension:
    """The extension as the agent card declares it."""
    params = struct_pb2.Struct()
    params.update(
        {"window_seconds": window, "key_header": KEY_HEADER, "every_request": every_request}
    )
    return AgentExtension(
        uri=URI,
        description=(
            "Safe retries, for a call that names this extension in a2a-extensions or sends "
            "idempotency-key metadata (every call when every_request is true): a SendMessage "
            "or SendStreamingMessage whose message_id (or idempotency-key) this caller sent "
            "within window_seconds runs nothing again: it is answered the first request's "
            "task; another body under the same id is refused."
        ),
        required=False,
        params=params,
    )


def asks(call: Caller) -> bool:
    """Whether the call asks for safe retries (the extension, or an ``idempotency-key``)."""
    return URI in call.extensions() or any(key == KEY_HEADER for key, _ in call.headers)


def key_of(request: SendMessageRequest, call: Caller) -> tuple[str, str]:
    """Which field keys the request, and its value (the metadata key, else the message id).

    Raises:
        InvalidFieldError: The metadata key is sent twice, empty, overlong or not printable.
    """
    sent = [value for key, value in call.headers if key == KEY_HEADER]
    if not sent:
        return "message.message_id", request.message.message_id
    if len(sent) > 1:
        raise InvalidFieldError(KEY_HEADER, "is sent twice; send one key per request")
    value = sent[0]
    if not value or len(value) > MAX_KEY_CHARS or not value.isprintable():
        raise InvalidFieldError(
            KEY_HEADER, f"must be 1 to {MAX_KEY_CHARS} printable characters (e.g. a UUID)"
        )
    return KEY_HEADER, value


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()[:48]


def _body(request: SendMessageRequest) -> str:
    """A digest of what the request asks to run: its message, metadata and push config.

    How the answer is shaped (``return_immediately``, ``history_length``) is
    left out: a retry may change it and is still the same request.
    """
    config = request.configuration
    return _digest(
        request.message.SerializeToString(deterministic=True),
        request.metadata.SerializeToString(deterministic=True),
        config.task_push_notification_config.SerializeToString(deterministic=True),
        "\n".join(config.accepted_output_modes).encode(),
    )


FirstRan = Callable[[KeyRecord], Awaitable[bool | None]]
"""Whether an *uncertain* first request ran (True), never will (False), or may yet (None)."""


class Patience:
    """How long a retry waits for its first request.

    It sleeps from 5 ms, doubling up to 250 ms, until ``WAIT_FIRST`` seconds or
    the caller's deadline, whichever is first.
    """

    def __init__(self, call: Caller) -> None:
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + min(call.timeout or WAIT_FIRST, WAIT_FIRST)
        self._delay = 0.005

    async def wait(self) -> bool:
        """Sleep the next delay; False, without sleeping, once it would pass the end."""
        if self._loop.time() + self._delay > self._deadline:
            return False
        await asyncio.sleep(self._delay)  # (the first request moves within milliseconds)
        self._delay = min(self._delay * 2, 0.25)
        return True


@dataclass(slots=True)
class Claim:
    """The first request with its key: say what it started, or let the key go."""

    keys: SentKeys
    key: str
    record: KeyRecord

    async def started(self, task_id: str, since: int) -> None:
        """The request's run started on ``task_id`` after its change ``since``."""
        self.record = self.record.started(task_id, since)
        await self.keys.settle(self.key, self.record)

    async def answered(self, message: Message) -> None:
        """The executor answered with ``message`` and no task (recorded at best effort)."""
        self.record = self.record.answered(message.SerializeToString())
        try:
            await self.keys.settle(self.key, self.record)
        except StoreError as exc:
            logger.warning("a message-only answer not recorded for retries: %s", exc)

    async def release(self, error: BaseException, task_id: str = "") -> None:
        """The request failed with ``error``: let its key go unless it may have acted.

        A follow-up whose owner did not answer in time may have run: its key
        says so (*uncertain*, naming the owner asked), and a retry finds out
        from the task whether it did (``Retries.admit``).
        """
        with contextlib.suppress(StoreError):  # (best effort: it expires with the window)
            if isinstance(error, OwnerTimeoutError) and error.sent:
                if task_id:
                    self.record = self.record.uncertain(
                        task_id, error.after, error.asked, error.seen, error.until
                    )
                    await self.keys.settle(self.key, self.record)
                return
            await self.keys.release(self.key)


class Retries:
    """Keys of sent requests, claimed before each runs (see the module docstring).

    Args:
        keys: Where keys are kept (None: requests are not deduplicated).
        every_request: Key every request, whether its call asks or not.
    """

    def __init__(self, keys: SentKeys | None, every_request: bool = False) -> None:
        self._keys = keys
        self._every_request = every_request
        self._letting_go: set[asyncio.Task[None]] = set()
        """Releases of keys claimed for a caller who left meanwhile (``_claim``)."""

    def activated(self, call: Caller) -> bool:
        """Whether the call named the extension and this server keeps keys (it is activated)."""
        return self._keys is not None and URI in call.extensions()

    async def admit(
        self, request: SendMessageRequest, call: Caller, ran: FirstRan | None = None
    ) -> tuple[Claim | None, KeyRecord | None]:
        """Claim the request's key, or find the first request's record.

        A first request whose follow-up may or may not have run (*uncertain*,
        ``journal.keys``) is looked up with ``ran``: if it ran, its record is
        answered; if it never will, this request takes its key over and runs;
        else it is refused at once (MESSAGE_IN_PROGRESS: one read of the task
        per attempt, however long the owner may still act).

        Returns:
            (the claim, None) for the first request; (None, the first's record,
            started or answered) for a retry; (None, None) for a request that is
            not keyed (no keys kept, or a call that does not ask).

        Raises:
            InvalidFieldError: The ``idempotency-key`` metadata is malformed.
            MessageKeyReusedError: The key was sent before with another body.
            MessageInProgressError: The first request is still starting.
            StoreError: The keys could not be reached.
        """
        keys = self._keys
        if keys is None or not (self._every_request or asks(call)):
            return None, None
        field, ident = key_of(request, call)
        key = _digest(call.scope.encode(), field.encode(), ident.encode())
        caller = principal_of(call.scope)  # (tenants aside: a client picks those)
        mine = KeyRecord(_body(request), request.message.task_id, at=time.time(), caller=caller)
        patience: Patience | None = None  # (made when a first request is still starting)
        replacing: KeyRecord | None = None
        while True:
            prior = await self._claim(keys, key, mine, replacing)
            if prior is None:
                return Claim(keys, key, mine), None
            if prior.digest != mine.digest:
                raise MessageKeyReusedError(field, ident)
            stale = bool(prior.task_id) and prior.abandoned(time.time())
            if prior.asked or stale:  # (a follow-up that may have been recorded: look)
                verdict = await ran(prior) if ran is not None else not stale
                if verdict is False:
                    logger.info("%s %s never ran where it was sent: running it", field, ident)
                    replacing = prior
                    continue
                if verdict and stale:  # (its writer died after the owner recorded it)
                    return None, prior.started(prior.task_id, 0)
            else:
                verdict = True
            if not prior.pending and verdict:
                logger.info("%s %s was sent before: answering its task", field, ident)
                return None, prior
            if prior.asked:
                left = max(prior.until - time.time(), 0.0)
                raise MessageInProgressError(
                    f"the first request with {field} {quote(ident)} went to instance "
                    f"{prior.asked}, which has not said whether it ran it; retry (it is "
                    f"known within {left:.0f} s)"
                )
            patience = patience or Patience(call)
            if not await patience.wait():
                raise MessageInProgressError(
                    f"the first request with {field} {quote(ident)} is still starting; retry"
                )

    async def _claim(
        self, keys: SentKeys, key: str, mine: KeyRecord, replacing: KeyRecord | None
    ) -> KeyRecord | None:
        """``keys.claim``; if the caller leaves meanwhile, let the key go once it is won.

        A claim that lands for a caller who left (a cut connection) would
        otherwise hold its key for a request that never runs: its retry would
        be refused MESSAGE_IN_PROGRESS until the claim is taken for abandoned
        (``PENDING_FOR``, 5 min). Keys kept in this process (``immediate``)
        are claimed without a pause: nothing to shield.
        """
        if getattr(keys, "immediate", False):  # (an embedder's keys may not say)
            return await keys.claim(key, mine, replacing)
        job = asyncio.ensure_future(keys.claim(key, mine, replacing))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(functools.partial(self._let_go, Claim(keys, key, mine)))
            raise

    def _let_go(self, claim: Claim, job: asyncio.Future[KeyRecord | None]) -> None:
        """Release the key a claim won for a caller who left (in the background)."""
        if job.cancelled() or job.exception() is not None or job.result() is not None:
            return
        logger.info("a request left while claiming its key: its key is let go")
        task = asyncio.ensure_future(claim.release(asyncio.CancelledError()))
        self._letting_go.add(task)
        task.add_done_callback(self._letting_go.discard)

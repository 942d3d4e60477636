"""One read of a stream's messages through an ephemeral pull consumer.

Listing keys, scanning a bucket and checking what came after a sequence all
read what a stream holds *now*. A pull consumer counts that exactly when it is
made, since nothing is delivered before a fetch, and each message says how
many are still pending after it. A watch (nats-py's ``KeyValue.watch``) does
not: its "initial values done" marker is put as soon as the consumer's info
says nothing is pending and no message was read yet, so a value the server
had already sent can come after it, and a count stops one short.

    async with PullRead(js, stream, subject, config, timeout=2.0) as read:
        if read.pending > LIMIT:
            ...
        async for msg in read:
            ...

Messages written during the read are read too: it ends on the message whose
pending count is 0. Leaving the block unsubscribes (the consumer's
``inactive_threshold`` drops it on its own if this process dies first).

``follow`` is the other way to read: a task's messages as they come, through an
ordered push consumer (both journals' relays).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType

from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

BATCH = 256
"""Messages one fetch asks for at most."""
IDLE = 30.0
"""Seconds before JetStream drops a read's consumer left behind (its instance died)."""
IDLE_HEARTBEAT = 1.0
"""Seconds between JetStream heartbeats of a follower's consumer (how soon a lost one
is noticed)."""


async def follow(
    js: JetStreamContext,
    stream: str,
    subject: str,
    after_pos: int,
    handle: Callable[[Msg], Awaitable[None]],
) -> JetStreamContext.PushSubscription:
    """Deliver every message on ``subject`` after stream sequence ``after_pos`` to ``handle``.

    An ordered consumer: in order, and recreated from the last delivered sequence if
    the server serving it is lost (each journal's ``follow``, which retries it).
    """
    config = api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if after_pos else api.DeliverPolicy.ALL,
        opt_start_seq=after_pos + 1 if after_pos else None,
    )
    return await js.subscribe(
        subject,
        stream=stream,
        cb=handle,
        ordered_consumer=True,
        idle_heartbeat=IDLE_HEARTBEAT,
        config=config,
    )


def last_per_subject(*, headers_only: bool) -> api.ConsumerConfig:
    """A consumer config reading the last message of each subject (a bucket's values).

    Args:
        headers_only: Read the headers alone (keys and operations, not values).
    """
    return _read(deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT, headers_only=headers_only)


def after(seq: int) -> api.ConsumerConfig:
    """A consumer config reading the headers of every message after stream sequence ``seq``."""
    return _read(
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seq + 1, headers_only=True
    )


def _read(
    *, deliver_policy: api.DeliverPolicy, headers_only: bool, opt_start_seq: int | None = None
) -> api.ConsumerConfig:
    """An ephemeral read's consumer: no acks, in memory, one replica, dropped when left."""
    return api.ConsumerConfig(
        deliver_policy=deliver_policy,
        opt_start_seq=opt_start_seq,
        ack_policy=api.AckPolicy.NONE,
        headers_only=headers_only,
        inactive_threshold=IDLE,
        mem_storage=True,
        num_replicas=1,
    )


def kv_subjects(bucket: str) -> tuple[str, str]:
    """A KV bucket's stream and the prefix of its keys' subjects.

    As JetStream names them (ADR-8, the key-value store): ``KV_<bucket>`` and
    ``$KV.<bucket>.``; nats-py keeps its own copies private.
    """
    return f"KV_{bucket}", f"$KV.{bucket}."


def is_deletion(msg: Msg) -> bool:
    """Whether a bucket's message deletes its key (a delete, a purge, an expiry marker)."""
    headers = msg.headers or {}
    return (
        headers.get("KV-Operation") in ("DEL", "PURGE")
        or "Nats-Marker-Reason" in headers  # (an expiry or purge marker)
    )


class PullRead:
    """Read a stream's messages on ``subject`` with an ephemeral pull consumer.

    Args:
        js: The JetStream context.
        stream: The stream's name.
        subject: The filter subject (wildcards allowed).
        config: The consumer (``last_per_subject``, ``after``).
        timeout: Seconds one fetch may wait for its messages.
    """

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        subject: str,
        config: api.ConsumerConfig,
        timeout: float,
    ) -> None:
        self._js, self._stream, self._subject = js, stream, subject
        self._config, self._timeout = config, timeout
        self._sub: JetStreamContext.PullSubscription | None = None
        self.pending = 0
        """Messages the consumer had to deliver when it was made."""

    async def __aenter__(self) -> PullRead:
        self._sub = await self._js.pull_subscribe(
            self._subject, stream=self._stream, config=self._config
        )
        try:
            self.pending = (await self._sub.consumer_info()).num_pending or 0
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # the consumer also expires on its own
                await sub.unsubscribe()

    def __aiter__(self) -> AsyncIterator[Msg]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Msg]:
        if self._sub is None:
            raise RuntimeError("a PullRead is read inside its async with block")
        pending = self.pending
        while pending:
            for msg in await self._sub.fetch(batch=min(pending, BATCH), timeout=self._timeout):
                pending = msg.metadata.num_pending
                yield msg

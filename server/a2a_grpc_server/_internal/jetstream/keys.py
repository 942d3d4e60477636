"""JetStreamSentKeys: sent keys shared by a cluster, in the KV bucket ``A2A_KEYS``.

One key per sent key (a hex digest of the caller's scope and the message
id, see ``rpc.idempotency``), its value a ``journal.keys.KeyRecord`` (JSON
with its format). A claim is a KV create, which exactly one instance wins
however many race (a retry through another instance finds the first
request's record); a pending record left by an instance that died is taken
over by compare-and-set on its revision. The bucket's max age is the
``idempotency_window`` (set when the bucket is created; the first
instance's setting stands, and a record older than the window is taken for
absent whatever the bucket keeps), so the window survives restarts.

JetStream limits a subject, never a group of subjects, so the bucket cannot
bound one caller's keys. Each instance does it for the keys it claimed
(``Claimed``): past ``most`` of them, the oldest of the caller that claimed
the most through it is deleted from the bucket, as the in-memory store drops
it. One caller's keys are thus at most ``most`` per live instance (those an
instance claimed before it restarted are bounded by the window alone), and
a caller within its fair share (``most`` divided by the callers) keeps its
keys whatever another sends. A delete leaves a marker of about 100 bytes in
the bucket until the window ends.

A claim of a key never sent and a settled record go through the lean
publish of ``requests`` (each is one publish with an ack; nats-py's KV
methods cost about twice the CPU); anything else (a key that exists or was
released, a takeover) through nats-py's KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from ..journal.keys import KeyRecord, PerCaller
from ..model.names import TASK_PREFIX
from .conn import KEYS_BUCKET, ensure_kv
from .pullread import kv_subjects
from .requests import EXPECT, JetStreamRequests, WrongLastSequenceError
from .retry import Retry

_PREFIX = kv_subjects(KEYS_BUCKET)[1]
"""The subjects of the bucket's keys start so."""

logger = logging.getLogger(__name__.replace("._internal", ""))


class Claimed:
    """The keys this instance claimed within the window, per caller, oldest first.

    Args:
        window: Seconds a claim is tracked (the bucket forgets it then).
        most: Most claims tracked; past it, ``add`` names the ones to delete.
        clock: Wall clock (seconds since the epoch).
    """

    def __init__(self, window: float, most: int, clock: Callable[[], float]) -> None:
        self._window, self._most, self._clock = window, most, clock
        self._claims: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """Key: (caller, when claimed), oldest claim first."""
        self._by_caller = PerCaller()

    def __len__(self) -> int:
        return len(self._claims)

    def add(self, key: str, caller: str) -> list[str]:
        """Track a key just claimed; the keys to delete to stay within ``most``.

        Those of the caller tracking the most go first, oldest first (O(1) each).
        """
        now = self._clock()
        claims = self._claims
        while claims:
            oldest, (_, at) = next(iter(claims.items()))
            if now - at < self._window:
                break
            self.discard(oldest)
        self.discard(key)
        claims[key] = (caller, now)
        self._by_caller.add(caller, key)
        evicted: list[str] = []
        while len(claims) > self._most:
            gone = self._by_caller.greediest_oldest()
            self.discard(gone)
            evicted.append(gone)
        return evicted

    def discard(self, key: str) -> None:
        """Stop tracking ``key`` (released, or deleted)."""
        found = self._claims.pop(key, None)
        if found is not None:
            self._by_caller.discard(found[0], key)


class JetStreamSentKeys:
    """``journal.keys.SentKeys`` on the shared bucket (see the module docstring).

    Args:
        js: The JetStream context.
        window: Seconds a record is kept (the bucket's max age).
        replicas: The bucket's replicas (``nats_replicas``).
        retry: How long an operation retries through a NATS outage.
        clock: Wall clock (seconds since the epoch).
        requests: Lean publishes on the same connection, started (None: nats-py's
            KV for everything).
        most: Most keys this instance's claims keep in the bucket (``Claimed``).
    """

    def __init__(
        self,
        js: JetStreamContext,
        window: float,
        replicas: int,
        retry: Retry,
        clock: Callable[[], float] = time.time,
        requests: JetStreamRequests | None = None,
        most: int = 100_000,
    ) -> None:
        self._js, self._window, self._replicas = js, window, replicas
        self._retry, self._clock = retry, clock
        self._requests = requests
        self._claimed = Claimed(window, most, clock)
        self._deleting: set[asyncio.Task[None]] = set()
        self._kv: KeyValue | None = None
        self._opening = asyncio.Lock()

    immediate = False
    """See ``journal.keys.SentKeys.immediate``: each operation is a round trip to NATS."""

    async def claim(
        self, key: str, record: KeyRecord, replacing: KeyRecord | None = None
    ) -> KeyRecord | None:
        """See ``journal.keys.SentKeys.claim``."""
        kv = await self._bucket()
        now = self._clock()
        value = record.stamped(now)

        async def attempt() -> KeyRecord | None:
            if self._requests is not None:
                subject = _PREFIX + key
                try:
                    await self._requests.publish(
                        subject, value.encode(), {EXPECT: "0"}, self._retry.timeout
                    )
                    return None
                except WrongLastSequenceError:
                    pass  # (it exists, or was released: nats-py's create tells which)
            try:
                await kv.create(key, value.encode())
                return None
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return await attempt()  # (released meanwhile: claim it again)
            found = KeyRecord.decode(entry.value or b"")
            stale = now - found.at >= self._window
            abandoned = found.abandoned(now) and not found.task_id
            if not (stale or abandoned or found == replacing):
                return found
            try:
                await kv.update(key, value.encode(), last=entry.revision)
                return None
            except nats.js.errors.KeyWrongLastSequenceError:
                return await attempt()  # (another instance took it over first)

        found = await self._retry(attempt, "claim a message id")
        if found is None:
            for gone in self._claimed.add(key, record.caller):
                job = asyncio.create_task(self._delete(gone), name=f"{TASK_PREFIX}:key-delete")
                self._deleting.add(job)
                job.add_done_callback(self._deleting.discard)
        return found

    async def _delete(self, key: str) -> None:
        """Delete a key past this instance's bound (best effort: the window ends it anyway)."""
        try:
            await self.release(key)
        except Exception as exc:  # (a NATS outage: it goes with the window)
            logger.warning("a message id past idempotency_max_keys not deleted: %s", exc)

    async def wait_deleted(self) -> None:
        """Wait for the deletes under way (for leak checks)."""
        while self._deleting:
            await asyncio.gather(*self._deleting, return_exceptions=True)

    async def close(self) -> None:
        """Stop the deletes under way (at shutdown: the window ends those keys anyway)."""
        for job in list(self._deleting):
            job.cancel()
        await self.wait_deleted()

    async def settle(self, key: str, record: KeyRecord) -> None:
        """See ``journal.keys.SentKeys.settle``."""
        kv = await self._bucket()
        if not record.at:  # (when it was claimed, near enough: the claimer's own record)
            record = record.stamped(self._clock())
        requests = self._requests
        if requests is None:
            await self._retry(lambda: kv.put(key, record.encode()), "record a message's task")
            return
        subject, data = _PREFIX + key, record.encode()
        await self._retry(
            lambda: requests.publish(subject, data, {}, self._retry.timeout),
            "record a message's task",
        )

    async def release(self, key: str) -> None:
        """See ``journal.keys.SentKeys.release``."""
        self._claimed.discard(key)
        kv = await self._bucket()
        await self._retry(lambda: kv.delete(key), "release a message id")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            async with self._opening:
                if self._kv is None:
                    self._kv = await self._retry(
                        lambda: ensure_kv(self._js, KEYS_BUCKET, self._window, self._replicas),
                        "open the sent keys' bucket",
                    )
        return self._kv

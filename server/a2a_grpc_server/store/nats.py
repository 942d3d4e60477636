"""Task store in a NATS JetStream key-value bucket, shared by every instance.

One key per task (the task id), one value per key (history 1): the owning
instance's id, a newline, and the serialized ``Task``. The version is the
key's revision, and every write is a compare-and-set on it (JetStream's
expected-last-subject-sequence), so two instances can never both write over
the same version. Retention is the bucket's max age (``task_ttl``): a key not
written for that long is dropped, final or not.

A final task is never overwritten: a writer can only hold a final task's
revision by having written or read it through a store, and every store
remembers the final revisions it has seen (bounded), refusing updates on
them. Reads go to the stream leader (no direct get from a lagging replica),
so a read after a write always sees it.

Writes survive a NATS node failover: a write that timed out is retried with
the same expected revision; if the retry finds the key already at a revision
holding exactly the bytes it wrote, the first attempt landed and counts.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from a2a.types.a2a_pb2 import Task
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from .. import taskops
from . import (
    FinalTaskError,
    StoredTask,
    StoreUnavailableError,
    TaskExistsError,
    TaskPage,
    TaskQuery,
    UnknownTaskError,
    VersionConflictError,
    paginate,
    status_ns,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
SCAN_BATCH = 256
SCAN_IDLE = 30.0
"""Seconds before JetStream removes a scan's consumer left behind by a lost instance."""
_KEY = re.compile(r"^[A-Za-z0-9_=-]+$")
_KNOWN_FINAL = 4096
RETRY_FOR = 30.0
"""Seconds an operation keeps retrying through a NATS outage (a JetStream leader
election after a node loss takes several seconds) before it fails."""
TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionClosedError,
    asyncio.TimeoutError,
)


def encode(owner: str, task: Task) -> bytes:
    """The stored value: owner id, the state number, each ended by a newline; the task."""
    return f"{owner}\n{task.status.state}\n".encode() + task.SerializeToString()


def peek(value: bytes) -> tuple[str, int]:
    """Owner and state number of a stored value, without decoding the task."""
    owner, state, _ = value.split(b"\n", 2)
    return owner.decode(), int(state)


def decode(value: bytes) -> tuple[str, Task]:
    """Split a stored value into owner id and task."""
    owner, _, body = value.split(b"\n", 2)
    return owner.decode(), Task.FromString(body)


class NatsTaskStore:
    """A ``TaskStore`` on a JetStream KV bucket.

    Args:
        js: The JetStream context.
        bucket: The bucket's name (history 1).
        kv: The bucket.
        owner: This instance's id, written with every task it writes.
    """

    def __init__(self, js: JetStreamContext, bucket: str, kv: KeyValue, owner: str) -> None:
        self._js = js
        self._stream = f"KV_{bucket}"
        self._subjects = f"$KV.{bucket}.>"
        self._kv = kv
        self._owner = owner
        self._final: OrderedDict[tuple[str, int], None] = OrderedDict()

    @property
    def owner(self) -> str:
        """The instance id this store writes as owner."""
        return self._owner

    async def get(self, task_id: str) -> StoredTask | None:
        """Return the task, its version and its owner, or None."""
        if not _KEY.match(task_id):
            return None  # such an id was never created here
        entry = await self._read(task_id)
        if entry is None:
            return None
        value, revision = entry
        owner, task = decode(value)
        self._remember(task, revision)
        return StoredTask(task, revision, owner)

    async def create(self, task: Task) -> int:
        """Store a new task owned by this instance.

        Raises:
            TaskExistsError: The id is taken.
            StoreUnavailableError: NATS did not answer.
        """
        value = encode(self._owner, task)
        try:
            revision = await self._write(task.id, value, 0)
        except VersionConflictError:
            raise TaskExistsError(task.id) from None
        self._remember(task, revision)
        return revision

    async def update(self, task: Task, expected_version: int) -> int:
        """Compare-and-set the task on its revision; this instance becomes its owner.

        Raises:
            UnknownTaskError: No such task.
            FinalTaskError: The stored task is final.
            VersionConflictError: The revision moved on.
            StoreUnavailableError: NATS did not answer.
        """
        if (task.id, expected_version) in self._final:
            raise FinalTaskError(task.id)
        try:
            revision = await self._write(task.id, encode(self._owner, task), expected_version)
        except VersionConflictError:
            current = await self.get(task.id)
            if current is None:
                raise UnknownTaskError(task.id) from None
            if taskops.is_final(current.task):
                raise FinalTaskError(task.id) from None
            raise
        self._remember(task, revision)
        return revision

    async def list(self, query: TaskQuery) -> TaskPage:
        """Return one page, most recently updated first (reads every key: O(tasks)).

        Raises:
            InvalidPageTokenError: The token is malformed.
        """
        found: builtins.list[tuple[int, Task]] = []
        for value, revision in await self._scan():
            _, task = decode(value)
            if query.matches(task.context_id, task.status.state, status_ns(task)):
                found.append((revision, task))
        return paginate(found, query, "n", lambda task: task)

    async def unfinished(self) -> builtins.list[StoredTask]:
        """Every task that is not final, with version and owner (for the lease reaper).

        Final tasks are skipped without being decoded.
        """
        found = []
        for value, revision in await self._scan():
            if peek(value)[1] not in taskops.TERMINAL:
                owner, task = decode(value)
                found.append(StoredTask(task, revision, owner))
        return found

    async def _scan(self) -> builtins.list[tuple[bytes, int]]:
        """The latest value of every key, read with one ephemeral pull consumer."""
        return await retrying(self._scan_once, "list the task bucket")

    async def _scan_once(self) -> builtins.list[tuple[bytes, int]]:
        js = self._js
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=SCAN_IDLE,
            mem_storage=True,
            num_replicas=1,
        )
        sub = await js.pull_subscribe(self._subjects, stream=self._stream, config=config)
        found: builtins.list[tuple[bytes, int]] = []
        try:
            pending = (await sub.consumer_info()).num_pending
            while pending:
                for msg in await sub.fetch(batch=min(pending, SCAN_BATCH), timeout=RETRY_FOR):
                    pending = msg.metadata.num_pending
                    op = (msg.headers or {}).get("KV-Operation")
                    if op is None and msg.data:
                        found.append((msg.data, msg.metadata.sequence.stream))
        finally:
            with contextlib.suppress(Exception):  # the consumer also expires on its own
                await sub.unsubscribe()
        return found

    async def _read(self, key: str) -> tuple[bytes, int] | None:
        async def attempt() -> KeyValue.Entry | None:
            try:
                return await self._kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None

        entry = await retrying(attempt, f"read task {key}")
        if entry is None:
            return None
        assert entry.value is not None and entry.revision is not None
        return entry.value, entry.revision

    async def _write(self, key: str, value: bytes, last: int) -> int:
        """CAS-write; a retry that finds its own bytes already written succeeds."""
        attempts = 0

        async def attempt() -> int:
            nonlocal attempts
            attempts += 1
            return await self._kv.update(key, value, last=last)

        try:
            return await retrying(attempt, f"write task {key}")
        except nats.js.errors.KeyWrongLastSequenceError:
            if attempts > 1:
                current = await self._read(key)
                if current is not None and current[0] == value:
                    return current[1]  # the attempt that timed out had landed
            raise VersionConflictError(f"{key}: not at revision {last}") from None

    def _remember(self, task: Task, revision: int) -> None:
        if taskops.is_final(task):
            self._final[(task.id, revision)] = None
            while len(self._final) > _KNOWN_FINAL:
                self._final.popitem(last=False)


async def retrying(attempt: Callable[[], Awaitable[T]], what: str) -> T:
    """Run ``attempt`` until it succeeds, retrying transient NATS failures for ``RETRY_FOR`` s.

    Raises:
        StoreUnavailableError: NATS kept failing for the whole budget.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETRY_FOR
    pause = 0.05
    while True:
        try:
            return await attempt()
        except TRANSIENT as exc:
            if loop.time() + pause > deadline:
                raise StoreUnavailableError(
                    f"NATS did not answer ({type(exc).__name__}) for {RETRY_FOR:.0f} s: {what}"
                ) from exc
            logger.warning("%s: %s; retrying", what, type(exc).__name__)
            await asyncio.sleep(pause)  # back off while NATS fails over
            pause = min(pause * 2, 1.0)

"""The snapshot bucket ``A2A_TASKS`` and the listing entries each snapshot names.

One ``SnapshotStore`` per journal: it reads and compare-and-sets snapshots (the
format is ``records``') and publishes the index entries a snapshot names
before it is written (``index``). The journal decides when a snapshot is due;
``listing`` and ``ownership`` read and rewrite snapshots through this.

Why this is ours and not the engine's: a KV bucket cannot take part in an
atomic batch with the event stream (docs/decisions/0001), so a snapshot and its
entries are separate writes, and a snapshot names its entries (``A2a-Index``)
so readers can tell a current entry from a stale one.
"""

from __future__ import annotations

import asyncio
import builtins
import re
import time

import nats.js.errors
from a2a.types.a2a_pb2 import Task
from nats.js import JetStreamContext, api

from ..journal import VersionConflictError, status_ns
from ..model import taskops
from .index import HEADER as INDEX_HEADER
from .index import Positions, TaskIndex
from .pullread import PullRead, after, last_per_subject
from .records import SHARD, TASKS_ALL, TASKS_STREAM, Snapshot, snapshot_subject
from .requests import EXPECT, JetStreamRequests, WrongLastSequenceError
from .retry import Retry

_KEY = re.compile(r"^[A-Za-z0-9_=-]+$")
"""A task id this store can hold (a KV key)."""
UNINDEXED_CHECK = 100_000
"""Most snapshot writes since the marker's last renewal an instance that starts checks."""


def new_positions(positions: Positions, kept: Positions | None) -> tuple[int, ...]:
    """The positions of ``positions`` that ``kept`` does not name too."""
    keep = set(kept.all()) if kept is not None else set()
    return tuple(p for p in positions.all() if p not in keep)


class SnapshotStore:
    """Snapshots in the KV bucket, and their index entries.

    Args:
        requests: Lean requests on the connection (publish, direct get).
        js: The JetStream context (KV reads, pull consumers).
        index: The listing index the entries go to.
        retry: How long an operation retries through a NATS outage.
        entry_ttl: How long the index keeps an entry (its stream's max age).
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        js: JetStreamContext,
        index: TaskIndex,
        retry: Retry,
        entry_ttl: float,
    ) -> None:
        self._requests = requests
        self._js = js
        self._index = index
        self._retry = retry
        self._entry_ttl = entry_ttl

    async def read(self, task_id: str) -> Snapshot | None:
        """The task's snapshot, or None.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if not _KEY.match(task_id):
            return None  # such an id was never created here
        entry = await self.entry(task_id)
        return Snapshot.decode(*entry) if entry is not None else None

    async def write(self, key: str, value: bytes, rev: int, index: str = "", shard: int = 0) -> int:
        """CAS-write a snapshot; a retry that finds its own bytes already written succeeds."""
        attempts = 0
        headers = {EXPECT: str(rev)}
        if index:
            headers[INDEX_HEADER] = index
        if shard:
            headers[SHARD] = str(shard)

        async def attempt() -> int:
            nonlocal attempts
            attempts += 1
            return await self._requests.publish(
                snapshot_subject(key), value, dict(headers), self._retry.timeout
            )

        try:
            return await self._retry(attempt, f"snapshot task {key}")
        except WrongLastSequenceError:
            if attempts > 1:
                current = await self.entry(key)
                if current is not None and current[0] == value:
                    return current[1]  # the attempt that timed out had landed
            raise VersionConflictError(f"{key}: snapshot not at revision {rev}") from None

    async def entry(self, key: str) -> tuple[bytes, int, dict[str, str]] | None:
        """A snapshot's value, revision and headers (None: no such key, or deleted)."""

        async def attempt() -> api.RawStreamMsg | None:
            try:
                async with asyncio.timeout(self._retry.timeout):
                    return await self._js.get_msg(TASKS_STREAM, subject=snapshot_subject(key))
            except nats.js.errors.NotFoundError:
                return None

        msg = await self._retry(attempt, f"read task {key}")
        if msg is None or not msg.data or msg.seq is None:
            return None
        headers = dict(msg.headers or {})
        if headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data, msg.seq, headers

    async def scan(self) -> builtins.list[tuple[bytes, int, dict[str, str]]]:
        """The latest value of every key, read with one ephemeral pull consumer."""
        return await self._retry(self._scan_once, "list the task bucket")

    async def _scan_once(self) -> builtins.list[tuple[bytes, int, dict[str, str]]]:
        config = last_per_subject(headers_only=False)
        found: builtins.list[tuple[bytes, int, dict[str, str]]] = []
        async with PullRead(self._js, TASKS_STREAM, TASKS_ALL, config, self._retry.budget) as read:
            async for msg in read:
                headers = dict(msg.headers or {})
                if "KV-Operation" not in headers and msg.data:
                    found.append((msg.data, msg.metadata.sequence.stream, headers))
        return found

    async def put(
        self,
        task: Task,
        value: bytes,
        rev: int,
        scope: str,
        owner: str,
        replaced: Positions | None,
        replaced_owner: str,
        shard: int,
        positions: Positions | None = None,
    ) -> tuple[int, Positions]:
        """Index (unless ``positions`` are given), then CAS-write a snapshot.

        Args:
            task: The task the snapshot holds.
            value: The snapshot.
            rev: The revision it replaces (0: none).
            scope: Whose task it is.
            owner: The instance the snapshot says runs it.
            replaced: The entries of the snapshot it replaces (dropped in the
                background once it is written), if known.
            replaced_owner: That snapshot's owner.
            shard: The event stream of its task's record.
            positions: Its entries, if already published (``add``).

        Returns:
            The snapshot's revision and its entries' positions.

        Raises:
            VersionConflictError: The snapshot is not at ``rev`` (its new entries are dropped).
            StoreUnavailableError: NATS did not answer (the entries may stand: stale).
        """
        if positions is None:
            positions = await self.add(task, scope, owner, replaced, replaced_owner)
        try:
            written = await self.write(task.id, value, rev, positions.header(), shard)
        except VersionConflictError:
            self._index.drop_later(new_positions(positions, replaced))
            raise
        if replaced is not None:
            self._index.drop_later(new_positions(replaced, positions))
        return written, positions

    async def add(
        self,
        task: Task,
        scope: str,
        owner: str,
        replaced: Positions | None,
        replaced_owner: str,
    ) -> Positions:
        """Publish the entries of a snapshot of ``task`` owned by ``owner``.

        An unfinished task someone runs has an entry among its owner's tasks,
        kept from the snapshot it replaces when that one had the same owner.
        """
        owned: int | None = None
        owned_at = 0
        if owner and not taskops.is_final(task):
            owned = 0
            # Kept while young: entries expire with the stream's max age (task_ttl), and
            # a task may run longer than that.
            if (
                replaced is not None
                and replaced_owner == owner
                and replaced.o
                and time.time() - replaced.ot < self._entry_ttl / 2
            ):
                owned, owned_at = replaced.o, replaced.ot
        return await self._index.add(
            scope,
            task.context_id,
            task.status.state,
            task.id,
            status_ns(task),
            owner,
            owned,
            owned_at,
        )

    async def bucket_seq(self) -> int:
        """The snapshot bucket's last sequence."""

        async def attempt() -> int:
            info = await self._js.stream_info(TASKS_STREAM)
            return int(info.state.last_seq)

        return await self._retry(attempt, "read the task bucket's state")

    async def unindexed_since(self, seq: int) -> bool:
        """Whether a snapshot written after bucket sequence ``seq`` has no index entries.

        Reads the headers of what was written since (the marker's last renewal,
        a minute ago while the cluster ran): a version before the index that ran
        alone since (a rollback of every instance, and back) wrote without them.
        More than ``UNINDEXED_CHECK`` writes since: taken as yes (rebuilt).
        """
        return await self._retry(lambda: self._unindexed_once(seq), "check the task bucket")

    async def _unindexed_once(self, seq: int) -> bool:
        async with PullRead(self._js, TASKS_STREAM, TASKS_ALL, after(seq), timeout=5.0) as read:
            if read.pending > UNINDEXED_CHECK:
                return True
            async for msg in read:
                headers = msg.headers or {}
                if "KV-Operation" not in headers and INDEX_HEADER not in headers:
                    return True
        return False

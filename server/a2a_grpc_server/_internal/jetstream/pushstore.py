"""JetStreamPushConfigs: push configs and their cursors in the KV bucket ``A2A_PUSH``.

One key per config, ``<task id>.<config id, base64url>``; its value is the
config's creation number (nanoseconds, for listing order), its cursor (the
last frame its webhook confirmed) and the serialized config (in format 2,
after the ``formats.MAGIC`` prefix and the format's number). The bucket's
max age is the tasks' (``task_ttl``), so configs leave with their task.

Who writes what: any instance creates and deletes configs (the RPC arrives
anywhere); the instance delivering a config (its task's owner, or the
survivor that ended the task) moves its cursor with a compare-and-set on the
key's revision, so a config deleted meanwhile is not written back: the
delivery learns it is gone and stops. Two instances creating configs for
one task at the same moment may together exceed ``push_max_configs`` by one.

Each principal's configs are counted (``quota_push_configs``) over the whole
cluster, by an index in a second bucket, ``A2A_PUSH_CALLERS`` (the same max
age): one empty key per config, ``<principal digest>.<config's key>``.
Counting reads the principal's keys (at most its quota of them). A
new config writes its index key first, then itself; a deleted one goes
first, then its index key. So a crash between the two writes leaves an index
key without a config, never a config without one: the count may run over,
never under. It is set right (*reconciled*) when it refuses: the index keys
whose config is gone are purged, at most once per ``RECONCILE_EVERY`` seconds
per principal and instance, so a caller at its quota cannot make every
attempt cost a read per config. One instance counts one principal's new
configs one at a time; instances creating configs for one principal at the
same moment may together exceed its quota by one each. Keys are listed, and
the bucket scanned, with a pull consumer (``pullread``), whose count of what
matches is exact when it is made (a KV watch's "initial values done" marker
could come early and miss one). Instances of a version before this index
neither write nor read it: their configs are not counted.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import hashlib
import logging
import math
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import nats.js.errors
from a2a.types.a2a_pb2 import TaskPushNotificationConfig
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from ..errors import QuotaExceededError
from ..push.configs import ConfigPage, PushConfigLimitError, decode_page_token
from .conn import PUSH_BUCKET, PUSH_CALLERS_BUCKET
from .deliveries import DeliveryCoverage as DeliveryCoverage
from .deliveries import DeliveryEntry, DeliveryIndex
from .formats import Formats, mark, unmark
from .index import STALE_AFTER, TaskIndex
from .pullread import PullRead, is_deletion, kv_subjects, last_per_subject
from .retry import Retry

logger = logging.getLogger(__name__.replace("._internal", ""))

Entries = list[tuple[str, int, int, TaskPushNotificationConfig]]
"""(key, creation number, cursor, config) of a task's configs."""

Orphans = list["Orphan"]
_T = TypeVar("_T")

REVISIONS_KEPT = 4096
"""Configs whose key revision this instance remembers (those it delivered to lately)."""
RECONCILE_EVERY = 30.0
"""Least seconds between two reconciliations of one principal's count by one instance."""
RECONCILED_KEPT = 4096
"""Principals whose last reconciliation this instance remembers."""

READ_CONCURRENCY = 16
"""Configs read at once when orphans are found through their delivery entries."""
ORPHAN_BATCH = 256
"""Configs read (or delivery entries published) per batch."""

WHAT = "a push config"
HEAD = struct.Struct(">QQB")
"""The value's head: creation number, cursor, the deliverer's id length (the id follows)."""


def _key(task_id: str, config_id: str) -> str:
    encoded = base64.urlsafe_b64encode(config_id.encode()).decode().rstrip("=")
    return f"{task_id}.{encoded or '_'}"


def caller_key(principal: str) -> str:
    """The first token of ``principal``'s index keys (a digest: names are any text)."""
    return hashlib.blake2s(principal.encode(), digest_size=16, person=b"a2a-push").hexdigest()


def _pack(number: int, cursor: int, deliverer: str, config: TaskPushNotificationConfig) -> bytes:
    who = deliverer.encode()[:255]
    return HEAD.pack(number, cursor, len(who)) + who + config.SerializeToString()


def _unpack(value: bytes) -> tuple[int, int, TaskPushNotificationConfig]:
    number, cursor, length = HEAD.unpack_from(value)
    return number, cursor, TaskPushNotificationConfig.FromString(value[HEAD.size + length :])


def _deliverer(value: bytes) -> str:
    length = HEAD.unpack_from(value)[2]
    return value[HEAD.size : HEAD.size + length].decode(errors="replace")


@dataclass(frozen=True, slots=True)
class Orphan:
    """A config whose deliverer is gone (see ``JetStreamPushConfigs.orphans``)."""

    task_id: str
    config: TaskPushNotificationConfig
    cursor: int
    deliverer: str
    revision: int
    value: bytes
    entry: int = 0
    """Its delivery entry's position (0: found by reading every config)."""


class JetStreamPushConfigs:
    """A ``PushConfigStore`` on the shared KV bucket (see the module docstring).

    Args:
        js: The JetStream context the buckets are read through.
        kv: The ``A2A_PUSH`` bucket (no other: its keys are listed by that name).
        retry: How long reads and writes retry through a NATS outage.
        formats: Which format to write (see ``formats``; None: format 1 only).
        callers: The ``A2A_PUSH_CALLERS`` bucket (None: configs are not counted
            per principal; no other bucket, as for ``kv``).
        clock: Monotonic clock that paces reconciliations.
        index: Where a config's deliverer is published before the config names it
            (``DeliveryEntry``; None: it is not, and orphans are found by reading
            every config).
        entry_ttl: The index's max age (``task_ttl``): a config written again
            (its cursor moves) lives on, so its entry is published again once
            half of that old.
    """

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        retry: Retry,
        formats: Formats | None = None,
        *,
        callers: KeyValue | None = None,
        clock: Callable[[], float] = time.monotonic,
        index: TaskIndex | None = None,
        entry_ttl: float = 86_400.0,
    ) -> None:
        self._js, self._kv = js, kv
        self._index = DeliveryIndex(index) if index is not None else None
        self._entry_ttl = entry_ttl
        self._noted: OrderedDict[str, float] = OrderedDict()
        """When this instance last published each config's delivery entry (the latest
        ``REVISIONS_KEPT``): republished past half ``entry_ttl`` (the index's max age)."""
        self._retry = retry
        self._formats = formats or Formats()
        self._callers = callers
        self._clock = clock
        self._counting: dict[str, tuple[asyncio.Lock, int]] = {}
        """Per principal being counted here: its lock and how many wait for it."""
        self._reconciled: OrderedDict[str, float] = OrderedDict()
        self._revisions: OrderedDict[tuple[str, str], tuple[int, bytes]] = OrderedDict()
        """Per config this instance delivered to lately: the key's revision and value (at
        most ``REVISIONS_KEPT``; a config not among them costs one read more)."""

    async def put(
        self,
        config: TaskPushNotificationConfig,
        most: int,
        seq: int,
        deliverer: str = "",
        caller: tuple[str, int] = ("", 0),
    ) -> None:
        """Keep ``config``; see ``PushConfigStore.put``.

        ``caller``'s configs are counted over the cluster (see the module
        docstring), when the store has the ``callers`` bucket.
        """
        task_id = config.task_id
        key = _key(task_id, config.id)
        existing = await self._entries(task_id)
        number = next((n for k, n, _, _ in existing if k == key), 0)
        if not number and len(existing) >= most:
            raise PushConfigLimitError(task_id, most)
        value = _pack(number or time.time_ns(), seq, deliverer, config)
        stored = mark(value, self._formats.writing)
        await self._note(deliverer, key)
        principal, quota = caller
        if number or self._callers is None:  # (a replacement is not a new one)
            await self._retry(lambda: self._kv.put(key, stored), "store a push config")
            self._revisions.pop((task_id, config.id), None)
            return
        # (Counted even without a quota here: another instance, or a later setting, may have one.)
        who = caller_key(principal)
        async with self._counted(who) if quota else contextlib.nullcontext():
            if quota:
                await self._admit(who, quota)
            await self._index_put(f"{who}.{key}")
            await self._retry(lambda: self._kv.put(key, stored), "store a push config")
        self._revisions.pop((task_id, config.id), None)

    async def get(self, task_id: str, config_id: str) -> TaskPushNotificationConfig | None:
        """The config, or None."""
        entry = await self._get(_key(task_id, config_id))
        return None if entry is None else _unpack(entry[1])[2]

    async def list(self, task_id: str, page_size: int, page_token: str) -> ConfigPage:
        """One page, oldest first; the token is the creation number of the last one listed."""
        after = decode_page_token(page_token)
        entries = sorted((number, config) for _, number, _, config in await self._entries(task_id))
        entries = [(n, c) for n, c in entries if n > after]
        page = entries[:page_size]
        more = len(entries) > page_size
        return ConfigPage([c for _, c in page], f"c{page[-1][0]}" if more and page else "")

    async def delete(self, task_id: str, config_id: str) -> bool:
        """Forget a config; whether it existed."""
        key = _key(task_id, config_id)
        existed = await self._get(key) is not None
        if existed:
            await self._retry(lambda: self._kv.purge(key), "delete a push config")
        self._revisions.pop((task_id, config_id), None)
        callers = self._callers
        if callers is not None:  # (then its index key: see the module docstring)
            for index in await self._read_keys(PUSH_CALLERS_BUCKET, f"*.{key}"):
                await self._uncount(index)
        return existed

    async def cursor(self, task_id: str, config_id: str) -> int | None:
        """The last frame confirmed, or None."""
        entry = await self._get(_key(task_id, config_id))
        return None if entry is None else _unpack(entry[1])[1]

    async def confirm(self, task_id: str, config_id: str, seq: int) -> bool:
        """Move the cursor (compare-and-set); False if the config is gone."""
        key = _key(task_id, config_id)
        known = self._revisions.get((task_id, config_id))
        if known is None:
            entry = await self._get(key)
            if entry is None:
                return False
            known = entry
        revision, value = known
        number, cursor, _ = _unpack(value)
        if seq <= cursor:
            return True
        if self._index is not None and self._clock() - self._noted.get(key, -math.inf) > (
            self._entry_ttl / 2
        ):
            await self._note(_deliverer(value), key)  # (the entry must outlive the config)
        updated = HEAD.pack(number, seq, HEAD.unpack_from(value)[2]) + value[HEAD.size :]

        async def update() -> int | None:
            try:
                stored = mark(updated, self._formats.writing)
                return await self._kv.update(key, stored, last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return None  # replaced (a new cursor) or deleted meanwhile

        written = await self._retry(update, "move a push cursor")
        if written is None:
            self._revisions.pop((task_id, config_id), None)
            return await self._get(key) is not None and await self.confirm(task_id, config_id, seq)
        self._revisions[(task_id, config_id)] = (written, updated)
        self._revisions.move_to_end((task_id, config_id))
        while len(self._revisions) > REVISIONS_KEPT:
            self._revisions.popitem(last=False)
        return True

    async def orphans(self, alive: set[str], *, indexed: bool = False) -> Orphans:
        """Every config whose deliverer is not in ``alive``.

        With ``indexed`` (every config that names a deliverer has its delivery
        entry: ``DeliveryCoverage.trusted``), through the lost deliverers'
        entries: it costs what they delivered. Otherwise by reading the whole
        bucket.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if indexed and self._index is not None:
            return await self._orphans_indexed(self._index, alive)

        def orphan(key: str, revision: int, value: bytes) -> Orphan | None:
            who = _deliverer(value)
            if not who or who in alive:
                return None
            _, cursor, config = _unpack(value)
            return Orphan(key.split(".", 1)[0], config, cursor, who, revision, value)

        return await self._scan(orphan)

    async def _orphans_indexed(self, index: DeliveryIndex, alive: set[str]) -> Orphans:
        """The configs the delivery entries of instances not ``alive`` name, still theirs.

        An entry whose config is gone or names another deliverer is deleted once
        older than ``STALE_AFTER`` (a write in flight is not stale); of two
        entries for one config, the older goes at once.
        """
        found: Orphans = []
        stale: builtins.list[int] = []
        old = time.time_ns() - STALE_AFTER
        gate = asyncio.Semaphore(READ_CONCURRENCY)

        async def read(key: str) -> tuple[int, bytes] | None:
            async with gate:
                return await self._get(key)

        for deliverer, subject in (await index.deliverers(alive)).items():
            if deliverer in alive:
                continue
            newest: dict[str, DeliveryEntry] = {}
            async for batch in index.deliveries(subject):
                for entry in batch:
                    if entry.key in newest:
                        stale.append(newest[entry.key].pos)
                    newest[entry.key] = entry
            entries = list(newest.values())
            for at in range(0, len(entries), ORPHAN_BATCH):
                chunk = entries[at : at + ORPHAN_BATCH]
                configs = await asyncio.gather(*(read(e.key) for e in chunk))
                for entry, stored in zip(chunk, configs, strict=True):
                    if stored is not None and _deliverer(stored[1]) == deliverer:
                        revision, value = stored
                        _, cursor, config = _unpack(value)
                        task_id = entry.key.split(".", 1)[0]
                        found.append(
                            Orphan(task_id, config, cursor, deliverer, revision, value, entry.pos)
                        )
                    elif entry.written_ns < old:
                        stale.append(entry.pos)
        index.drop_later(stale)
        return found

    async def index_delivered(self) -> int:
        """Publish a delivery entry for every config that names a deliverer; how many.

        Reads the whole bucket: once, when the cluster starts keeping delivery
        entries (configs written before have none; see ``DeliveryCoverage``).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if self._index is None:
            return 0
        noted = await self._scan(
            lambda key, _, value: (who, key) if (who := _deliverer(value)) else None
        )
        for at in range(0, len(noted), ORPHAN_BATCH):
            await self._index.note_deliveries(noted[at : at + ORPHAN_BATCH])
        return len(noted)

    async def _scan(self, keep: Callable[[str, int, bytes], _T | None]) -> builtins.list[_T]:
        """What ``keep`` makes of each config stored, as it is read (its Nones left out).

        ``keep`` gets the key, the revision and the value without its format
        mark; the bucket is never held whole.
        """
        js, (stream, prefix) = self._js, kv_subjects(PUSH_BUCKET)

        async def scan() -> builtins.list[_T]:
            found: builtins.list[_T] = []
            config = last_per_subject(headers_only=False)
            async with PullRead(js, stream, prefix + ">", config, self._retry.timeout) as read:
                async for msg in read:
                    if is_deletion(msg) or not msg.data:
                        continue
                    value = unmark(msg.data, WHAT)
                    kept = keep(msg.subject[len(prefix) :], msg.metadata.sequence.stream, value)
                    if kept is not None:
                        found.append(kept)
            return found

        return await self._retry(scan, "scan push configs")

    async def _note(self, deliverer: str, key: str) -> None:
        """Publish that ``deliverer`` delivers ``key`` before a write says so (with an index)."""
        if deliverer and self._index is not None:
            await self._index.note_delivery(deliverer, key)
            self._noted[key] = self._clock()
            self._noted.move_to_end(key)
            while len(self._noted) > REVISIONS_KEPT:
                self._noted.popitem(last=False)

    async def without_deliverer(self, task_id: str) -> Orphans:
        """The task's configs no instance delivers (created while nobody owned the task)."""
        found: Orphans = []
        for key in await self._keys(task_id):
            entry = await self._get(key)
            if entry is not None and not _deliverer(entry[1]):
                revision, value = entry
                _, cursor, config = _unpack(value)
                found.append(Orphan(task_id, config, cursor, "", revision, value))
        return found

    async def adopt(self, orphan: Orphan, me: str) -> bool:
        """Become the config's deliverer (compare-and-set); False if another did first."""
        number, cursor, length = HEAD.unpack_from(orphan.value)
        who = me.encode()[:255]
        tail = orphan.value[HEAD.size + length :]
        value = HEAD.pack(number, cursor, len(who)) + who + tail
        key = _key(orphan.task_id, orphan.config.id)
        await self._note(me, key)

        async def update() -> int | None:
            try:
                stored = mark(value, self._formats.writing)
                return await self._kv.update(key, stored, last=orphan.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return None

        written = await self._retry(update, "adopt a push config")
        if written is None:
            return False
        self._revisions[(orphan.task_id, orphan.config.id)] = (written, value)
        if self._index is not None:
            self._index.drop_later([orphan.entry])  # (the lost deliverer's: stale now)
        return True

    def forget(self, task_id: str) -> None:
        """Nothing to do: the bucket's max age drops configs with their task."""
        for key in [k for k in self._revisions if k[0] == task_id]:
            del self._revisions[key]

    async def _get(self, key: str) -> tuple[int, bytes] | None:
        async def get() -> tuple[int, bytes] | None:
            try:
                entry = await self._kv.get(key)
            except nats.js.errors.KeyNotFoundError:  # (deleted and purged ones too)
                return None
            if entry.value is None:
                return None
            return entry.revision or 0, unmark(entry.value, WHAT)

        return await self._retry(get, "read a push config")

    async def _keys(self, task_id: str) -> Sequence[str]:
        """The keys of the task's configs."""
        return await self._read_keys(PUSH_BUCKET, f"{task_id}.*")

    async def _read_keys(self, bucket: str, pattern: str) -> Sequence[str]:
        """The keys of ``bucket`` that match ``pattern`` (deleted ones left out).

        Read with a pull consumer (``PullRead``), whose count is exact when it
        is made: a watch's "initial values done" marker can come before values
        already sent, and a count one short let a principal past its quota of
        configs.
        """
        js, (stream, prefix) = self._js, kv_subjects(bucket)

        async def keys() -> list[str]:
            config = last_per_subject(headers_only=True)
            async with PullRead(js, stream, prefix + pattern, config, self._retry.timeout) as read:
                return [msg.subject[len(prefix) :] async for msg in read if not is_deletion(msg)]

        return await self._retry(keys, "list push configs")

    @contextlib.asynccontextmanager
    async def _counted(self, who: str) -> AsyncIterator[None]:
        """Count ``who``'s new configs one at a time on this instance."""
        lock, waiting = self._counting.get(who) or (asyncio.Lock(), 0)
        self._counting[who] = (lock, waiting + 1)
        try:
            async with lock:
                yield
        finally:
            lock, waiting = self._counting[who]
            if waiting == 1:
                del self._counting[who]
            else:
                self._counting[who] = (lock, waiting - 1)

    async def _admit(self, who: str, quota: int) -> None:
        """Refuse a new config of the principal ``who`` names if it holds ``quota``.

        Raises:
            QuotaExceededError: PUSH_CONFIGS_QUOTA.
        """
        assert self._callers is not None
        held = await self._read_keys(PUSH_CALLERS_BUCKET, f"{who}.>")
        if len(held) >= quota and self._may_reconcile(who):
            held = [index for index in held if await self._still_counts(index)]
        if len(held) >= quota:
            raise QuotaExceededError(
                "PUSH_CONFIGS_QUOTA", "quota_push_configs", quota, "push configs of one caller"
            )

    def _may_reconcile(self, who: str) -> bool:
        now = self._clock()
        last = self._reconciled.get(who)
        if last is not None and now - last < RECONCILE_EVERY:
            return False
        self._reconciled[who] = now
        self._reconciled.move_to_end(who)
        while len(self._reconciled) > RECONCILED_KEPT:
            self._reconciled.popitem(last=False)
        return True

    async def _still_counts(self, index: str) -> bool:
        """Whether an index key's config exists; if not, the key is purged."""
        if await self._get(index.split(".", 1)[1]) is not None:
            return True
        await self._uncount(index)
        return False

    async def _uncount(self, index: str) -> None:
        callers = self._callers
        assert callers is not None
        await self._retry(lambda: callers.purge(index), "uncount a push config")

    async def _index_put(self, index: str) -> None:
        callers = self._callers
        assert callers is not None
        await self._retry(lambda: callers.put(index, b""), "count a push config")

    async def _entries(self, task_id: str) -> Entries:
        found: Entries = []
        for key in await self._keys(task_id):
            entry = await self._get(key)
            if entry is not None:
                number, cursor, config = _unpack(entry[1])
                found.append((key, number, cursor, config))
        return found

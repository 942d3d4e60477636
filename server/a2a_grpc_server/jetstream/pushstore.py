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
"""

from __future__ import annotations

import base64
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import nats.js.errors
from a2a.types.a2a_pb2 import TaskPushNotificationConfig
from nats.js.kv import KeyValue

from ..push.configs import ConfigPage, PushConfigLimitError, decode_page_token
from .formats import Formats, mark, unmark
from .retry import Retry

Entries = list[tuple[str, int, int, TaskPushNotificationConfig]]
"""(key, creation number, cursor, config) of a task's configs."""

Orphans = list["Orphan"]

REVISIONS_KEPT = 4096
"""Configs whose key revision this instance remembers (those it delivered to lately)."""

WHAT = "a push config"
HEAD = struct.Struct(">QQB")
"""The value's head: creation number, cursor, the deliverer's id length (the id follows)."""


def _key(task_id: str, config_id: str) -> str:
    encoded = base64.urlsafe_b64encode(config_id.encode()).decode().rstrip("=")
    return f"{task_id}.{encoded or '_'}"


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


class JetStreamPushConfigs:
    """A ``PushConfigStore`` on the shared KV bucket (see the module docstring).

    Args:
        kv: The ``A2A_PUSH`` bucket.
        retry: How long reads and writes retry through a NATS outage.
        formats: Which format to write (see ``formats``; None: format 1 only).
    """

    def __init__(self, kv: KeyValue, retry: Retry, formats: Formats | None = None) -> None:
        self._kv = kv
        self._retry = retry
        self._formats = formats or Formats()
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

        ``caller``'s quota is not counted here: the bucket has no index by
        principal yet, so only ``most`` per task bounds a caller, through its tasks.
        """
        task_id = config.task_id
        key = _key(task_id, config.id)
        existing = await self._entries(task_id)
        number = next((n for k, n, _, _ in existing if k == key), 0)
        if not number and len(existing) >= most:
            raise PushConfigLimitError(task_id, most)
        value = _pack(number or time.time_ns(), seq, deliverer, config)
        stored = mark(value, self._formats.writing)
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

    async def orphans(self, alive: set[str]) -> Orphans:
        """Every config whose deliverer is not in ``alive`` (reads the whole bucket)."""

        async def scan() -> Orphans:
            watcher = await self._kv.watch(">", ignore_deletes=True)
            found: Orphans = []
            try:
                async for entry in watcher:
                    if entry is None:  # (the end of what is stored)
                        break
                    if not entry.value:
                        continue
                    value = unmark(entry.value, WHAT)
                    who = _deliverer(value)
                    if who and who not in alive:
                        _, cursor, config = _unpack(value)
                        task_id = entry.key.split(".", 1)[0]
                        found.append(
                            Orphan(task_id, config, cursor, who, entry.revision or 0, value)
                        )
            finally:
                await watcher.stop()
            return found

        return await self._retry(scan, "scan push configs")

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

        async def keys() -> list[str]:
            # A watch of this task's keys only (``KeyValue.keys`` reads every key).
            watcher = await self._kv.watch(f"{task_id}.*", ignore_deletes=True, meta_only=True)
            found = []
            try:
                async for entry in watcher:
                    if entry is None:  # (the end of what is stored)
                        break
                    found.append(entry.key)
            finally:
                await watcher.stop()
            return found

        return await self._retry(keys, "list push configs")

    async def _entries(self, task_id: str) -> Entries:
        found: Entries = []
        for key in await self._keys(task_id):
            entry = await self._get(key)
            if entry is not None:
                number, cursor, config = _unpack(entry[1])
                found.append((key, number, cursor, config))
        return found

"""Delivery entries: which instance delivers each push config, in the listing index's stream.

A push config names the instance that delivers it (its task's owner, or the
survivor that adopted it). So that a sweep finds a lost deliverer's configs
without reading every config, the deliverer publishes an entry before the
config names it: subject ``a2a.idx.p.<deliverer hash>`` in ``A2A_INDEX``
(format in ``DeliveryEntry``). ``DeliveryCoverage`` keeps the marker that says
every config has its entry (``a2a.idx.meta.push``), as ``listing`` keeps the
listing index's. The push store (``pushstore``) writes and reads them.

Why this is ours and not the engine's: a KV bucket has no secondary index,
and a config's key names its task, not its deliverer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from ..errors import UnknownFormatError
from .conn import INDEX_SUBJECT
from .formats import Formats
from .index import FORMAT, MARKER_RENEW, SEQ_HEADER, TaskIndex, digest

if TYPE_CHECKING:
    from .pushstore import JetStreamPushConfigs

logger = logging.getLogger(__name__.replace("._internal", ""))

DELIVERERS = "deliverers"
"""What a heartbeat says of an instance that publishes delivery entries (see ``DeliveryEntry``)."""
PUSH_MARKER = f"{INDEX_SUBJECT}.meta.push"
"""The marker saying every push config that names a deliverer has its delivery entry."""
PUSH_FRESH = 180 * 1_000_000_000
"""Nanoseconds a push marker is trusted after it was last renewed (renewed every minute)."""


def delivered_by(deliverer: str) -> str:
    """The subject of the delivery entries of the push configs an instance delivers."""
    return f"{INDEX_SUBJECT}.p.{digest(deliverer)}"


@dataclass(frozen=True, slots=True)
class DeliveryEntry:
    """A push config named an instance its deliverer (published before the config says so).

    Payload ``1`` (its format), ``p``, the deliverer, the config's key in
    ``A2A_PUSH`` and the writer's clock (nanoseconds), each on a line. It is
    stale once the config is gone or names another deliverer.
    """

    pos: int
    deliverer: str
    key: str
    written_ns: int

    @staticmethod
    def encode(deliverer: str, key: str) -> bytes:
        """An entry's payload, written now."""
        return b"\n".join(
            (FORMAT, b"p", deliverer.encode(), key.encode(), str(time.time_ns()).encode())
        )

    @classmethod
    def decode(cls, msg: Msg) -> DeliveryEntry:
        """Parse an entry read directly.

        Raises:
            UnknownFormatError: It is in a format this version does not read.
        """
        parts = msg.data.split(b"\n")
        if len(parts) != 5 or parts[0] != FORMAT or parts[1] != b"p":
            raise UnknownFormatError(
                "a delivery entry of the task index", parts[0][:16].decode("ascii", "replace")
            )
        try:
            written = int(parts[4])
        except ValueError:
            raise UnknownFormatError("a delivery entry of the task index", "1") from None
        pos = int((msg.headers or {})[SEQ_HEADER])
        return cls(pos, parts[2].decode(), parts[3].decode(), written)


class DeliveryIndex:
    """Delivery entries and the push marker, in the listing index's stream.

    Args:
        index: The listing index (its stream, reads and writes).
    """

    def __init__(self, index: TaskIndex) -> None:
        self._index = index

    def drop_later(self, positions: Sequence[int]) -> None:
        """Delete stale entries in the background (``TaskIndex.drop_later``)."""
        self._index.drop_later(positions)

    async def deliverers(self, alive: AbstractSet[str] = frozenset()) -> dict[str, str]:
        """Every instance named by delivery entries but those ``alive``, and its entries' subject.

        The subjects of the instances ``alive`` are skipped unread.

        Raises:
            StoreUnavailableError: NATS did not answer.
            UnknownFormatError: An entry in a format this version does not read.
        """
        skip = {delivered_by(instance) for instance in alive}
        return await self._index.heads("p", lambda msg: DeliveryEntry.decode(msg).deliverer, skip)

    async def note_delivery(self, deliverer: str, key: str) -> None:
        """Publish that ``deliverer`` delivers the config at ``key`` (before the config says so).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        body = DeliveryEntry.encode(deliverer, key)
        await self._index.publish(
            delivered_by(deliverer), body, {}, "index a push config's deliverer"
        )

    async def note_deliveries(self, noted: Sequence[tuple[str, str]]) -> None:
        """Publish many (deliverer, key) delivery entries in one go.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        messages = [(delivered_by(d), DeliveryEntry.encode(d, k)) for d, k in noted]
        await self._index.publish_many(messages, "index push configs' deliverers")

    def deliveries(self, subject: str) -> AsyncGenerator[list[DeliveryEntry]]:
        """The delivery entries on ``subject``, oldest first, a batch at a time.

        Raises:
            StoreUnavailableError: NATS did not answer.
            UnknownFormatError: An entry in a format this version does not read.
        """
        return self._index.pages(subject, DeliveryEntry.decode)

    async def push_covered(self) -> int | None:
        """When the push marker was last renewed (nanoseconds since the epoch), or None.

        Raises:
            StoreUnavailableError: NATS did not answer.
            UnknownFormatError: A marker in a format this version does not read.
        """
        found = await self._index.marker(PUSH_MARKER, "the push marker", ("at",))
        return None if found is None else found[0]

    async def mark_push_covered(self, by: str) -> None:
        """Write (or renew) the push marker.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        body = json.dumps({"format": 1, "by": by, "at": time.time_ns()}).encode()
        await self._index.publish(
            PUSH_MARKER, body, {"Nats-Rollup": "sub"}, "mark push configs indexed"
        )

    async def unmark_push(self) -> None:
        """Remove the push marker: an instance that publishes no delivery entries is heard.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        await self._index.purge(PUSH_MARKER, "remove the push marker")


class DeliveryCoverage:
    """Whether every config that names a deliverer has its delivery entry (the push marker).

    Kept as the listing index's marker is (``Listing.keep_index``
    runs ``keep`` on the lease's schedule): while any live instance does not
    publish delivery entries (its heartbeat lacks ``DELIVERERS``, a version
    before them in a rolling update), or one was heard since the last
    ``keep`` (``Formats.lacked``: it may have written configs and left), the
    marker is removed and not trusted; once every
    instance does, the smallest live one publishes an entry for each config
    written without one (``index_delivered``, one read of the bucket) and
    writes the marker, then renews it every ``MARKER_RENEW`` seconds. A
    marker not renewed for ``PUSH_FRESH`` (the cluster was down, or a version
    before the entries ran alone meanwhile) is not trusted: the smallest
    instance indexes the bucket again.

    Args:
        store: The configs.
        index: Where the entries and the marker are.
        formats: What the live instances keep.
        me: This instance's id.
        clock: Monotonic clock that paces renewals.
    """

    def __init__(
        self,
        store: JetStreamPushConfigs,
        index: TaskIndex,
        formats: Formats,
        me: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store, self._formats, self._me = store, formats, me
        self._index = DeliveryIndex(index)
        self._clock = clock
        self._built = False
        self._unmarked = False
        self._renew_at = 0.0
        self.covered = asyncio.Event()
        """Set while this instance has seen the push marker stand (cleared when it does not)."""

    def due(self) -> bool:
        """Whether ``keep`` has something to do (cheap: no request)."""
        if self._formats.lacking(DELIVERERS):
            return not self._unmarked
        if self._formats.lacked(DELIVERERS):
            return True
        return not self._built or self._clock() >= self._renew_at

    async def trusted(self) -> bool:
        """Whether orphans may be found through delivery entries (``orphans(indexed=)``).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        formats = self._formats
        return (
            formats.everyone(DELIVERERS) and not formats.lacked(DELIVERERS) and await self._fresh()
        )

    async def _fresh(self) -> bool:
        at = await self._index.push_covered()
        return at is not None and time.time_ns() - at < PUSH_FRESH

    async def keep(self, live: set[str]) -> None:
        """Remove, build or renew the push marker (see the class docstring).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        lacking = self._formats.lacking(DELIVERERS)
        if lacking or self._formats.lacked(DELIVERERS):
            # One without entries is heard, or was since the last keep (it may have
            # written configs and left already): the marker goes.
            self._set_built(False)
            if not (lacking and self._unmarked):  # (once while such an instance is heard)
                await self._index.unmark_push()
                self._unmarked = True
            self._formats.forget_lacked(DELIVERERS)
            if lacking:
                return
        self._unmarked = False
        if not self._formats.everyone(DELIVERERS):
            self._set_built(False)
            return
        smallest = self._me == min(live | {self._me})
        if await self._fresh():
            if smallest:
                await self._index.mark_push_covered(self._me)
            self._set_built(True)
            return
        self._set_built(False)
        if not smallest:
            return
        done = await self._store.index_delivered()
        if self._formats.everyone(DELIVERERS):  # (no instance without them heard meanwhile)
            await self._index.mark_push_covered(self._me)
            self._set_built(True)
            logger.info("push configs indexed by deliverer (%d); sweeps read their entries", done)

    def _set_built(self, built: bool) -> None:
        self._built = built
        if built:
            self._renew_at = self._clock() + MARKER_RENEW
            self.covered.set()
        else:
            self.covered.clear()

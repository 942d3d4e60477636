"""The formats of what instances share on NATS, and the rule that lets two versions share a cluster.

Everything one instance writes and another reads says its format:

* a message of the record (``A2A_EVENTS``): header ``A2a-Format``;
* a task's snapshot (``A2A_TASKS``) and a push config (``A2A_PUSH``): the
  value starts with ``MAGIC``, the format's number and a newline;
* a routed request (``a2a.ctl.<instance>.<op>``): header ``A2a-Format``;
* a heartbeat (``A2A_INSTANCES``): its value, JSON ``{"formats": [...],
  "version": "...", "features": [...]}``: the formats that instance reads,
  its version, and what it keeps that others rely on (``index``: it writes
  the listing index, see ``index``; ``shards``: it reads a task's record in
  the event stream its snapshot names, see ``journal``; none before that).

Format 1 is what versions before formats were versioned wrote: the same
layouts without any of these marks (no header, no prefix, an empty
heartbeat). Format 2 is format 1 with them. A reader refuses a format it
does not know with ``UnknownFormatError`` naming it, and never guesses: a
record change of an unknown kind, a routed operation it does not serve, a
routed request that does not say who asked are refused the same way.

The upgrade rule: this version reads formats 1 and 2 and writes format 2
only once every live instance's heartbeat says it reads 2 (and it has heard
them all, a lease after it came up); until then it writes format 1, which the
previous version reads. A rolling update, old and new side by side, never
leaves an instance a value it cannot read; once the last old instance is
gone, the new format follows within a heartbeat. Headers an older reader does
not know it ignores, so they are written in every format.

Format 3 is the task log (``tasklog``): a task created in it lives there, one
message per change, in stream ``A2A_LOG``. This version reads it (a task is read
from the log when the snapshot bucket does not hold it) and creates tasks there
when every live instance reads 3 and the setting is on (``Formats.log_wanted``,
``nats_task_log``: on by default from this version, off in the one before, which
reads 3: a cluster can roll back to it). Tasks keep the layout they were created in.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import logging
from collections.abc import Mapping
from typing import NoReturn

from ..errors import UnknownFormatError

logger = logging.getLogger(__name__.replace("._internal", ""))

HEADER = "A2a-Format"
LEGACY = 1
"""The unmarked layouts of versions before formats were versioned."""
CURRENT = 2
"""The newest format of the values and messages above this version writes (once every
instance reads it)."""
LOG = 3
"""Tasks in the task log (``tasklog``, ``logjournal``): read by this version; written by
an instance that wants it (``Formats.log_wanted``, on by default), once every live
instance reads it."""
READS = frozenset({LEGACY, CURRENT, LOG})
"""The formats this version reads."""
FEATURES = frozenset({"deliverers", "index", "shards"})
"""What this version keeps that others rely on (see ``heartbeat``)."""
MAGIC = b"\x00a2a-format "
"""How a format-2 (or later) snapshot or push config value starts. No format-1 value can:
a snapshot starts with its owner's id (text), a push config with its creation number, big-
endian nanoseconds since 1970, whose first byte is not 0 for any time after 1972."""


@functools.cache
def version() -> str:
    """This package's version ("unknown" when it is not installed as a distribution)."""
    try:
        return importlib.metadata.version("a2a-grpc-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def mark(value: bytes, fmt: int) -> bytes:
    """``value`` as written in format ``fmt`` (format 1: unmarked)."""
    return value if fmt == LEGACY else MAGIC + str(fmt).encode() + b"\n" + value


def unmark(value: bytes, what: str) -> bytes:
    """The layout inside a stored value, after checking its format.

    Raises:
        UnknownFormatError: The value is in a format this version does not read.
    """
    if not value.startswith(MAGIC):
        return value
    number, _, rest = value[len(MAGIC) :].partition(b"\n")
    fmt = _number(number.decode(errors="replace"), what)
    return rest if fmt in READS else _refuse(what, fmt)


def check_header(headers: Mapping[str, str] | None, what: str) -> int:
    """The format a message's headers say (1 when they say none).

    Raises:
        UnknownFormatError: A format this version does not read.
    """
    given = (headers or {}).get(HEADER)
    if given is None:
        return LEGACY
    fmt = _number(given, what)
    return fmt if fmt in READS else _refuse(what, fmt)


@functools.cache
def heartbeat() -> bytes:
    """This instance's heartbeat value: the formats it reads, and its version."""
    return json.dumps(
        {"formats": sorted(READS), "version": version(), "features": sorted(FEATURES)}
    ).encode()


def read_heartbeat(value: bytes) -> frozenset[int]:
    """The formats an instance reads, from its heartbeat (an empty one: format 1 only)."""
    if not value:
        return frozenset({LEGACY})
    try:
        found = json.loads(value)
        formats = frozenset(int(f) for f in found["formats"])
    except (ValueError, TypeError, KeyError):
        logger.warning("a heartbeat this version cannot read: %r (taken for format 1)", value[:80])
        return frozenset({LEGACY})
    return formats or frozenset({LEGACY})


def read_features(value: bytes) -> frozenset[str]:
    """What an instance's heartbeat says it keeps (none from a heartbeat without the field)."""
    try:
        found = json.loads(value) if value else {}
        return frozenset(str(f) for f in found.get("features", ()))
    except (ValueError, TypeError, AttributeError):
        return frozenset()


class Formats:
    """Which format this instance writes now (see the module docstring's upgrade rule).

    The lease tells it what each live instance reads (``heard``, ``gone``)
    and when it has heard them all (``settle``, a lease after start).
    """

    def __init__(self) -> None:
        self._reads: dict[str, frozenset[int]] = {}
        self._features: dict[str, frozenset[str]] = {}
        self._lacked: set[str] = set()
        self._settled = False
        self.writing = LEGACY
        """The format written now."""
        self.log_wanted = True
        """Whether this instance creates tasks in the task log when the cluster reads it
        (``nats_task_log``)."""
        self._logging = False
        self._changed = asyncio.Event()

    def heard(self, instance: str, value: bytes) -> None:
        """``instance``'s heartbeat, as its value says."""
        features = read_features(value)
        self._features[instance] = features
        self._lacked |= FEATURES - features
        reads = read_heartbeat(value)
        if self._reads.get(instance) != reads:
            self._reads[instance] = reads
            self._update()

    def gone(self, instance: str) -> None:
        """``instance`` left the cluster: its heartbeat key was deleted or expired.

        (An instance only taken for lost is not gone: it may come back, and
        must be able to read what is written meanwhile.)
        """
        self._features.pop(instance, None)
        if self._reads.pop(instance, None) is not None:
            self._update()

    def lacking(self, feature: str) -> bool:
        """Whether a live instance heard from does not keep ``feature``."""
        return any(feature not in found for found in self._features.values())

    def lacked(self, feature: str) -> bool:
        """Whether an instance heard since ``forget_lacked`` did not keep ``feature``.

        Unlike ``lacking``, it stays after that instance left: whatever it wrote
        without the feature meanwhile is still there.
        """
        return feature in self._lacked

    def forget_lacked(self, feature: str) -> None:
        """What was written without ``feature`` is dealt with (see ``lacked``)."""
        self._lacked.discard(feature)

    def everyone(self, feature: str) -> bool:
        """Whether every live instance keeps ``feature`` (heard from them all: settled)."""
        return self._settled and not self.lacking(feature)

    def settle(self) -> None:
        """Every live instance has been heard from (a lease in touch)."""
        if not self._settled:
            self._settled = True
            self._update()

    def unsettle(self) -> None:
        """This instance lost touch: an instance may have joined unheard; format 1 until settled."""
        if self._settled:
            self._settled = False
            self._update()

    @property
    def writes_log(self) -> bool:
        """Whether new tasks go to the task log now (format 3, see ``LOG``)."""
        return (
            self.log_wanted
            and self._settled
            and all(LOG in reads for reads in self._reads.values())
        )

    async def wait_for(self, fmt: int) -> None:
        """Wait until this instance writes format ``fmt`` (a rolling update's progress)."""
        while self.writing != fmt:
            self._changed.clear()
            await self._changed.wait()

    def _update(self) -> None:
        if self.log_wanted and self.writes_log != self._logging:
            self._logging = self.writes_log
            older = [i for i, reads in self._reads.items() if LOG not in reads]
            logger.info(
                "creating tasks in the %s%s",
                "task log" if self._logging else "snapshot bucket",
                f" (instances {', '.join(older)} do not read the task log)" if older else "",
            )
        everyone = self._settled and all(CURRENT in reads for reads in self._reads.values())
        writing = CURRENT if everyone else LEGACY
        if writing != self.writing:
            old = [i for i, reads in self._reads.items() if CURRENT not in reads]
            logger.info(
                "writing format %d%s",
                writing,
                f" (instances {', '.join(old)} read format {LEGACY} only)" if old else "",
            )
            self.writing = writing
            self._changed.set()


def _number(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UnknownFormatError(what, text) from None


def _refuse(what: str, fmt: int) -> NoReturn:
    raise UnknownFormatError(what, str(fmt))

"""A NATS client whose writes wait a moment for company while replies are on their way.

nats-py writes what was published to the socket from a task of its own (its
flusher), woken by the first publish after each write: what is published in
one pass of the event loop goes out together. Under load the journal's
requests come one pass apart, each when the reply to its previous one arrives,
so nearly every message went out in a write of its own: on a loopback socket
each write also wakes nats-server, and that is what a message cost most
(``python -m bench``, SendMessage x16 on NATS: ~2.9 writes per task).

``CoalescingClient`` holds the flusher's wake-up while at least ``AWAITED``
requests are *unanswered*: written, their reply not yet received (those
published since the last write was asked for are not written yet, and a
reply already received counts even if its requester has not resumed). The
write goes out at the next reply or after ``HOLD`` seconds, whichever comes
first, with everything published meanwhile; a reply ends the hold one pass
of the loop after it woke its requester, so what that requester publishes
next goes too. Otherwise a publish is written at once, as before. Only the
wake-up is deferred: nats-py's flusher, its buffer and its limits are
untouched. What goes out at once regardless: a buffer past ``HOLD_BYTES``,
nats-py's forced flush, what is buffered when a PING is sent (written ahead
of it, so ``flush()`` is a barrier: its PONG comes after everything published
before it), anything while disconnected, and anything if nats-py's flusher
is gone (nats-py then writes inline). After a reconnect, requests written
before it are no longer counted: their replies were lost with the
connection.

Who runs what: ``JetStreamRequests`` says when it publishes a request
(``sent``), when its reply came (``answered``) and when it ended without one
(``abandoned``); nats-py calls ``_flush_pending`` from ``publish`` and
``_send_ping``, in the caller's task; a hold ends in a timer callback or in
the reply's.

It leans on nats-py's private internals: the two methods it overrides and
the attributes it reads. ``why_not`` checks them, and the installed version
against ``TESTED``, when an instance connects; if anything is off, the plain
client is used and one WARNING says why (``NatsConfig.coalesce_writes`` turns
it off outright). Kept by measurement: docs/decisions/0002-coalesced-nats-writes.md.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from nats.aio.client import Client

HOLD = 0.001
"""Most seconds a write waits for company (asyncio rounds a timer up to a millisecond)."""
HOLD_BYTES = 64 * 1024
"""A write this large goes out at once."""
AWAITED = 3
"""Unanswered requests from which a write waits for company. With fewer, the next reply
may be far off for a caller alone (a lone SendMessage has up to two requests in flight)."""

TESTED = ((2, 16), (2, 17))
"""The nats-py versions this is tested with: from the first, up to (not including) the
second. pyproject.toml pins the same range."""
HOOKS = ("_flush_pending", "_send_ping")
"""nats-py's private methods overridden here."""
ATTRIBUTES = (
    "_flusher_task",
    "_flush_queue",
    "_pending",
    "_pending_data_size",
    "_transport",
    "stats",
)
"""nats-py's private attributes read or written here (set by ``Client.__init__``)."""


def why_not(version: str | None = None) -> str | None:
    """Why ``CoalescingClient`` cannot be used with the installed nats-py (None: it can).

    Args:
        version: The nats-py version to judge (default: the installed one).
    """
    if version is None:
        try:
            version = importlib.metadata.version("nats-py")
        except importlib.metadata.PackageNotFoundError:
            return "the nats-py version is unknown"
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return f"nats-py {version} is not a version this was tested with"
    low, high = TESTED
    if not low <= found < high:
        tested = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
        return f"nats-py {version} is outside the tested range {tested}"
    missing = [name for name in HOOKS if not callable(getattr(Client, name, None))]
    client = Client()
    missing += [name for name in ATTRIBUTES if not hasattr(client, name)]
    if "stats" not in missing and "reconnects" not in client.stats:
        missing.append("stats['reconnects']")
    if missing:
        return f"nats-py {version} lacks {', '.join(missing)}"
    return None


class CoalescingClient(Client):
    """nats-py's ``Client``, its writes coalesced under load (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.unanswered = 0
        """Requests sent (``sent``) whose reply has not come, nor they ended without one."""
        self.queued = 0
        """Of those, the ones published since the last write was asked for."""
        self.held = 0
        """Writes that waited for company (a count, for tests and measurements)."""
        self.joined = 0
        """Of those, the ones a reply ended (the others ended at ``HOLD``)."""
        self._timer: asyncio.Handle | None = None
        """What ends the hold: a timer, or (``_ending``) the callback a reply scheduled."""
        self._ending = False
        self._pinging = False
        self._reconnects = 0
        self._inline: set[asyncio.Task[Any]] = set()

    async def _flush_pending(self, force_flush: bool = False) -> Any:
        """Ask the flusher to write, at once or once company came (see the module)."""
        if self._reconnects != self.stats["reconnects"]:
            # (what was written before the reconnect will not be answered)
            self._reconnects = self.stats["reconnects"]
            self.unanswered = self.queued = 0
        if (
            not force_flush
            and not self._pinging
            and self.is_connected
            and self._pending_data_size < HOLD_BYTES
            and self._flusher_task is not None
            and not self._flusher_task.done()
        ):
            if self._timer is not None:
                return None  # (a write is due: this publish goes with it)
            if self.unanswered - self.queued >= AWAITED:
                self.held += 1
                self._timer = asyncio.get_running_loop().call_later(HOLD, self._write)
                return None
        self._release()
        self.queued = 0
        return await super()._flush_pending(force_flush)

    async def _send_ping(self, future: asyncio.Future[Any] | None = None) -> None:
        """nats-py's PING, after whatever is buffered (``flush()`` is a barrier).

        nats-py writes the PING straight to the socket, ahead of its buffer;
        the buffer, held or not, is written first here, as nats-py writes it.
        """
        self._release()
        if self.is_connected and self._transport is not None and self._pending_data_size:
            self._transport.writelines(self._pending[:])
            self._pending = []
            self._pending_data_size = 0
            self.queued = 0
        self._pinging = True
        try:
            await super()._send_ping(future)
        finally:
            self._pinging = False

    def sent(self) -> None:
        """A request is about to be published."""
        self.unanswered += 1
        queue = self._flush_queue
        if queue is None or queue.empty():
            self.queued += 1
        # (else the flusher, already woken, writes it with what it finds)

    def answered(self) -> None:
        """A request's reply came (after its requester was woken): what waits goes out.

        The write is asked for one pass of the loop later, after the requester
        woken by this reply has run: what it publishes next goes with it.
        """
        self.unanswered = max(self.unanswered - 1, 0)
        if self._timer is not None and not self._ending:
            self.joined += 1
            self._timer.cancel()
            self._ending = True
            self._timer = asyncio.get_running_loop().call_soon(self._write)

    def abandoned(self) -> None:
        """A request ended without its reply (timed out, cancelled, or not published)."""
        self.unanswered = max(self.unanswered - 1, 0)
        self.queued = min(self.queued, self.unanswered)

    def _write(self) -> None:
        """End the hold: wake nats-py's flusher (unless a wake-up is queued already)."""
        self._release()
        self.queued = 0
        if not self.is_connected:
            return  # (nats-py writes its buffer once reconnected)
        flusher, queue = self._flusher_task, self._flush_queue
        if flusher is None or flusher.done() or queue is None:
            # No flusher to wake: nats-py's own path writes inline then.
            task = asyncio.get_running_loop().create_task(Client._flush_pending(self))
            self._inline.add(task)
            task.add_done_callback(self._inline.discard)
        elif queue.empty():
            queue.put_nowait(asyncio.get_running_loop().create_future())

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._ending = False

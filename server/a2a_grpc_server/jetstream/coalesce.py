"""A NATS client whose writes wait a moment for company while replies are awaited.

nats-py writes what was published to the socket from a task of its own (its
flusher), woken by the first publish after each write. Under load the
journal's requests come one at a time, each when the reply to its previous
one arrives, so nearly every message went out in a write of its own: on a
loopback socket each write also wakes nats-server, and that is what a message
cost most (``python -m bench``, SendMessage x16 on NATS: ~2.9 writes per task).

``CoalescingClient`` holds the flusher's wake-up while at least ``AWAITED``
replies are awaited for requests already written (those awaited beyond the
ones published since the last write was asked for): the write goes out at
the next reply (which wakes the requests that publish next) or after
``HOLD`` seconds, whichever comes first, with everything published
meanwhile. Otherwise a publish is written at once, as before: a caller alone
waits for nothing. Only the wake-up is deferred: nats-py's flusher, its
buffer and its limits are untouched (a buffer past ``HOLD_BYTES`` goes out
at once; nats-py writes what is buffered when the connection closes, and
after a reconnect).

Who runs what: ``JetStreamRequests`` says when it publishes a request
(``count_request``) and when a reply came (``replied``); nats-py calls
``_flush_pending`` from ``publish``, in the publisher's task; the hold ends
in a timer callback or in the reply's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client

HOLD = 0.0005
"""Most seconds a write waits for company."""
HOLD_BYTES = 64 * 1024
"""A write this large goes out at once."""
AWAITED = 3
"""Replies awaited for requests already written from which a write waits for company.
From one, a lone SendMessage on NATS lost ~6 % of its tasks/s (its own two writes
in flight held each other up); from three, nothing measurable (bench/README.md)."""


def _nothing_awaited() -> int:
    return 0


class CoalescingClient(Client):
    """nats-py's ``Client``, its writes coalesced under load (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.awaiting: Callable[[], int] = _nothing_awaited
        """Requests whose reply is awaited, written or not (``JetStreamRequests``)."""
        self.queued = 0
        """Requests published since the last write was asked for (``count_request``)."""
        self.held = 0
        """Writes that waited for company (a count, for metrics and tests)."""
        self._timer: asyncio.TimerHandle | None = None

    async def _flush_pending(self, force_flush: bool = False) -> Any:
        """Ask the flusher to write, at once or once company came (see the module)."""
        if not force_flush and self.is_connected and self._pending_data_size < HOLD_BYTES:
            if self._timer is not None:
                return None  # (a write is due: this publish goes with it)
            if self.awaiting() - self.queued >= AWAITED:  # (replies for what was written)
                self.held += 1
                self._timer = asyncio.get_running_loop().call_later(HOLD, self._write)
                return None
        self._release()
        self.queued = 0
        return await super()._flush_pending(force_flush)

    def count_request(self) -> None:
        """A request is about to be published (counted unless a write is due already)."""
        queue = self._flush_queue
        if queue is None or queue.empty():
            self.queued += 1
        # (else the flusher, already woken, writes it with what it finds)

    def replied(self) -> None:
        """A reply came: what waits for company goes out now."""
        if self._timer is not None:
            self._write()

    def _write(self) -> None:
        """End the hold: wake nats-py's flusher (unless a wake-up is queued already)."""
        self._release()
        self.queued = 0
        queue = self._flush_queue
        if queue is not None and queue.empty() and self.is_connected:
            queue.put_nowait(asyncio.get_running_loop().create_future())

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

"""Pacer: bounds how long bulk work runs on the event loop between two polls of its I/O.

asyncio polls its sockets once per loop round, after running every callback
that was ready when the round began. Bulk coroutines (an executor emitting, a
consumer committing, a stream writing) each run one step per round, so in a
burst to many tasks a round lasts the sum of dozens of steps (200-300 ms was
measured with 20 streams), and a unary call, which needs several rounds
(grpc.aio hands every completion over from its poller thread), waits that many
times as long: a GetTask took seconds.

Bulk work therefore asks the pacer before each unit (``due``). The first unit
of a round starts a *slice*; units go on at once until ``slice_seconds`` have
passed since, then their coroutines queue (``wait``). One round later (the
loop has polled its I/O meanwhile) the queued coroutines are woken, oldest
first, those that were woken last time but found the slice already spent
ahead of those that ran; each goes on until the new slice is spent. When
``CROWD`` or more wait, the slice opens only after ``IDLE_GAP`` seconds with
no bulk work, so grpc's threads get the interpreter too. Bulk work that
stays under a slice per round never waits: it costs a clock read per unit
and one callback per round.

Who runs what: everything runs on the event loop. ``ExecutorQueue.enqueue_event``
(producers, past a run's first ``supervisor.FREE_EVENTS`` events, so a short task
never queues behind a burst), ``ExecutionSupervisor._consume`` (after each committed batch) and
``RpcServicer._pump`` (before each frame written) call ``due`` and, when it
says so, ``await wait()``; the pacer's own callbacks (``_end_round``,
``_open``) wake them. One pacer serves the whole instance (``TaskEngine.pacer``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

IDLE_GAP = 0.002
"""Seconds without bulk work between two slices once ``CROWD`` or more coroutines wait:
the loop idles in its poll, which lets grpc's poller threads run (a busy loop thread
hands them the interpreter only every ``sys.getswitchinterval()``, 5 ms). Short rounds
alone are not enough: without the gap a GetTask still waited 1.5 s in a burst to 20
streams (2.3-2.6 s unpaced, 40-160 ms with it); it costs the burst ~10 % more loop CPU."""

CROWD = 4
"""Waiting coroutines from which a burst counts as many tasks at once (then ``IDLE_GAP``)."""


class Pacer:
    """Shares the event loop between bulk work and everything else (see the module docstring).

    Args:
        slice_seconds: Bulk work the loop runs between two polls of its I/O
            before it queues the rest (0: never; ``due`` is always False).
        clock: Seconds from a monotonic clock (tests pass their own).
    """

    __slots__ = ("_clock", "_limit", "_passed", "_start", "_turn", "_waiters", "waits")

    def __init__(
        self, slice_seconds: float, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if slice_seconds < 0:
            raise ValueError("slice_seconds must not be negative")
        self._limit = slice_seconds if slice_seconds > 0 else math.inf
        self._clock = clock
        self._start: float | None = None
        """When the current slice began (None: no slice; the next unit starts one)."""
        self._turn: asyncio.Handle | None = None
        """The callback that ends the current slice (set exactly while ``_start`` is)."""
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._passed: deque[asyncio.Future[None]] = deque()
        """Woken, but the slice was spent before their turn: first at the next one."""
        self.waits = 0
        """Times bulk work waited for a slice (a counter)."""

    @property
    def enabled(self) -> bool:
        """Whether the pacer ever makes bulk work wait."""
        return self._limit < math.inf

    def due(self) -> bool:
        """Whether the current slice is spent: the caller then awaits ``wait()``.

        Synchronous and O(1); the first call of a round starts a slice.
        """
        start = self._start
        if start is not None:
            return self._clock() - start > self._limit
        if self._limit < math.inf:
            self._start = self._clock()
            self._turn = asyncio.get_running_loop().call_soon(self._end_round)
        return False

    async def wait(self) -> None:
        """Wait until a slice has time left (FIFO; a cancelled waiter costs the others nothing)."""
        loop = asyncio.get_running_loop()
        queue = self._waiters
        while self.due():
            waiter = loop.create_future()  # one each: cancelling it touches no one else
            queue.append(waiter)
            self.waits += 1
            await waiter
            queue = self._passed  # woken, yet the slice is spent: keep the place in line

    def _end_round(self) -> None:
        """The loop polled since the slice began: open the next one (a loop callback)."""
        waiting = len(self._waiters) + len(self._passed)
        if not waiting:
            self._start = self._turn = None  # no one queued: the next unit starts a slice
        elif waiting >= CROWD:
            self._turn = asyncio.get_running_loop().call_later(IDLE_GAP, self._open)
        else:
            self._open()

    def _open(self) -> None:
        """Wake every waiter, oldest first; the first unit they run starts the slice."""
        self._start = self._turn = None
        passed, waiters = self._passed, self._waiters
        self._passed, self._waiters = deque(), deque()
        for queue in (passed, waiters):
            for waiter in queue:
                if not waiter.done():  # (cancelled)
                    waiter.set_result(None)

"""TaskLog: a task's frames in order, numbered 1, 2, 3, …; every reader is a cursor into it.

Who runs what: everything here is synchronous except ``LogReader.__anext__``
and ``TaskLog.wait_changed``; all of it runs on the server's event loop. A
log has one writer. On the instance that runs the task it is the task's
``LiveTask``, which appends a frame only after the journal accepted the change
(persist, then append) and holds the task's lock from changing the task to
appending, so ``subscribe`` (taken under the same lock) sees a snapshot and a
cursor that agree. On another instance it is the task's relay, which appends
the owner's frames with the owner's numbers. Each stream handler owns one
``LogReader`` and is its only user.

Who closes what:

* ``seal(final)`` ends the task's log, idempotently and always in this order:
  (1) append the final frame (the log is then sealed: nothing can follow it);
  (2) mark the log closed; (3) run the close callbacks, which cancel the
  task's producer and consumer; (4) wake every reader. Readers drain to the
  final frame, then see end-of-stream.
* A task's own log ends only that way, by construction: ``seal`` takes the
  final frame (there is no bare close), ``append(final=True)`` refuses a
  frame whose state is not terminal, ``answer`` ends it with the agent's
  message-only answer, and ``sever`` refuses a log that is not a relay. A
  writer that finds its task ended elsewhere seals with the recorded outcome
  (``LiveTask``), numbered as recorded (``seal(..., at=seq)``). The one
  exception is a task that has not ended here: ``hand_over(error)`` lets go
  of a task waiting for input whose continuation another instance serves from
  the shared record (cluster mode), or, with ``continued=True``, of one
  another instance already continued while this one was out of touch; it
  refuses any other task.
* The writer never waits for a reader, and a reader is never dropped for being
  behind. A reader ends early only when the frame it needs next has left the
  log (see "What is kept"): it then raises ``FrameNotKeptError``
  (OUT_OF_RANGE), never silently.
* A reader whose client went away calls ``LogReader.close()``; the task and
  the other readers are unaffected. When the last reader leaves an open log,
  ``on_idle`` runs (a relay stops relaying).
* ``sever(error)`` is for a log that is not the task's own (a relay of a task
  another instance runs): readers drain what is kept, then raise ``error``.

What is kept (sizes live in the log, not in readers):

* at most ``LogLimits.max_frames`` frames and ``max_bytes`` bytes per task; the
  oldest go first. The final frame is never dropped for the budget (it is
  always the newest);
* a frame that no open reader still needs is released (at once when the log
  has no reader; otherwise once every reader has read it, checked every
  ``TRIM_EVERY`` frames), unless the log is *resumable* (a client that
  activated the resume extension follows the task): then it is kept for
  ``resume_window`` seconds after it was appended, and an ended resumable log
  stays readable that long after its end (longer while a reader still drains
  it);
* across every log of a server, ``LogPool.max_bytes``: beyond it, ended logs
  kept for resumption that nobody reads go first (oldest first), then the
  oldest frames of the log being appended to.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from a2a.types.a2a_pb2 import Task

from ..errors import FrameNotKeptError
from ..model import taskops
from ..obs.metrics import Metrics

logger = logging.getLogger(__name__.replace("._internal", ""))

Entry = tuple[int, bytes, int]
"""What a reader gets: the frame's sequence number, the serialized ``StreamResponse``,
and the state the frame carries (``TaskState`` value, 0 for a frame without one)."""

ENTRY_OVERHEAD = 64
"""Bytes charged per kept frame beyond its own size (its slot, time and state)."""

TRIM_EVERY = 64
"""Frames appended between two scans of where the slowest reader is."""


class LogClosedError(Exception):
    """The log's task has ended; nothing can be appended or subscribed."""


class NotFinalError(ValueError):
    """A frame whose state is not terminal was offered as a log's final frame (a bug)."""


class EndReason(enum.Enum):
    """Why a reader stopped: each outcome has its own name."""

    FINISHED = "finished"
    """The log closed and the reader read every frame, the final one included."""
    DETACHED = "detached"
    """The reader left on its own (its client disconnected, or it had read enough)."""
    SEVERED = "severed"
    """This instance stopped relaying the task (it goes on elsewhere)."""


@dataclass(frozen=True, slots=True)
class LogLimits:
    """What one task's log may keep (see the module docstring).

    Attributes:
        max_frames: Most frames kept per task.
        max_bytes: Most bytes kept per task (frames plus ``ENTRY_OVERHEAD`` each).
        resume_window: Seconds a resumable log keeps a frame after appending it.
    """

    max_frames: int = 16_384
    max_bytes: int = 16 * 1024 * 1024
    resume_window: float = 60.0


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """What a ``LogPool`` holds now (``LogPool.statistics``).

    Attributes:
        used: Bytes all its logs keep.
        peak: The most bytes they kept at once.
        retained: Ended logs kept for resumption.
    """

    used: int
    peak: int
    retained: int


class LogPool:
    """Every log of one server instance: their common budget, and ended logs kept for resuming.

    Args:
        max_bytes: Most bytes all logs together keep.
        limits: The per-task limits every log of this pool gets.
        metrics: Where dropped frames are counted.
        clock: Monotonic clock.
    """

    def __init__(
        self,
        max_bytes: int,
        limits: LogLimits,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.limits = limits
        self.metrics = metrics
        self.clock = clock
        self.used = 0
        """Bytes all logs of this pool keep right now."""
        self.peak = 0
        """The most bytes they kept at once."""
        self._retained: OrderedDict[str, TaskLog] = OrderedDict()
        self._watched: dict[TaskLog, None] = {}
        self._timer: asyncio.TimerHandle | None = None

    @property
    def retained_count(self) -> int:
        """Ended logs kept for resumption."""
        return len(self._retained)

    def statistics(self) -> PoolStatistics:
        """What the pool holds now (read by the metrics collector)."""
        return PoolStatistics(self.used, self.peak, len(self._retained))

    def retained(self, task_id: str) -> TaskLog | None:
        """The ended, still readable log of ``task_id``, if it is kept."""
        return self._retained.get(task_id)

    def close(self) -> None:
        """Release every ended log and stop the sweep (the server is stopping)."""
        for log in list(self._retained.values()):
            log.release()
        self._retained.clear()
        self._watched.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _charge(self, log: TaskLog, nbytes: int) -> None:
        self.used += nbytes
        if self.used <= self.max_bytes:
            self.peak = max(self.peak, self.used)
            return
        for ended in [kept for kept in self._retained.values() if not kept.readers]:
            if self.used <= self.max_bytes:
                break
            ended.release()
        if self.used > self.max_bytes:
            log._shed(self.used - self.max_bytes)
        self.peak = max(self.peak, self.used)

    def _retain(self, log: TaskLog) -> None:
        older = self._retained.get(log.task_id)
        if older is not None and older is not log:
            # A relay of a task this instance then took over (cluster mode): the
            # newer log carries the task's end; the older one goes.
            older.release()
        self._retained[log.task_id] = log
        self._retained.move_to_end(log.task_id)
        self._watched.pop(log, None)
        self._schedule()

    def _watch(self, log: TaskLog) -> None:
        self._watched[log] = None
        self._schedule()

    def _forget(self, log: TaskLog) -> None:
        self._watched.pop(log, None)
        if self._retained.get(log.task_id) is log:
            del self._retained[log.task_id]

    def _schedule(self) -> None:
        if self._timer is None and (self._retained or self._watched):
            period = max(self.limits.resume_window / 4, 0.05)
            # (In a context of its own: not the call or run that happened to arm it.)
            self._timer = asyncio.get_running_loop().call_later(
                period, self._sweep, context=contextvars.Context()
            )

    def _sweep(self) -> None:
        """Release what the resume window no longer covers (runs every quarter window)."""
        self._timer = None
        horizon = self.clock() - self.limits.resume_window
        for log in (*self._watched, *self._retained.values()):
            log._expire(horizon)
        for log in list(self._retained.values()):
            if log._ended_at > horizon:
                break
            if not log.readers:  # (one still draining keeps it; it goes when they leave)
                log.release()
        self._schedule()


class LogReader:
    """One cursor into a task's log.

    Iterate it with ``async for``; iteration stops after the final frame (or
    when the reader was closed), raises ``FrameNotKeptError`` if the next frame
    left the log before it was read, and raises the severing error of a relay
    that stopped once the kept frames are read.
    """

    __slots__ = ("_end", "_log", "_next", "passive")

    def __init__(self, log: TaskLog, next_seq: int, passive: bool = False) -> None:
        self._log = log
        self._next = next_seq
        self._end: EndReason | None = None
        self.passive = passive
        """A background reader (a push delivery): not counted in ``TaskLog.readers``."""

    @property
    def task_id(self) -> str:
        """The task this reader follows."""
        return self._log.task_id

    @property
    def followers(self) -> int:
        """Readers of its log (this one included, unless it is passive): ``TaskLog.readers``."""
        return self._log.readers

    @property
    def next_seq(self) -> int:
        """The sequence number of the next frame this reader gets."""
        return self._next

    @property
    def end_reason(self) -> EndReason | None:
        """Why the reader stopped, or None while it reads."""
        return self._end

    def __aiter__(self) -> LogReader:
        return self

    async def __anext__(self) -> Entry:
        """Return the next frame, waiting for one if the reader is at the end of the log.

        Raises:
            StopAsyncIteration: The log closed and every frame was read, or the
                reader was closed.
            FrameNotKeptError: The next frame is no longer kept.
        """
        log = self._log
        while True:
            if self._end is EndReason.DETACHED:
                raise StopAsyncIteration
            seq = self._next
            if seq <= log._last_seq:
                if seq < log._first_seq:
                    raise FrameNotKeptError(log.task_id, seq, log._first_seq, log._last_seq)
                kept = log._kept
                assert kept is not None
                i = kept.head + seq - log._first_seq
                self._next = seq + 1
                frame = kept.frames[i]
                if not frame:
                    continue  # a change without a frame (a follow-up message)
                if seq == log._final_seq:
                    log.metrics.final_frames += 1
                return seq, frame, kept.states[i]
            if log._closed:
                self._finish(EndReason.SEVERED if log._severed else EndReason.FINISHED)
                if log._severed is not None:
                    raise log._severed
                raise StopAsyncIteration
            await log.wait_changed()

    def skip_to(self, seq: int) -> None:
        """Read from frame ``seq`` on: the caller has every frame before it (never moves back).

        A reader that is past the log's end waits for ``seq`` as for any next frame.
        """
        self._next = max(self._next, seq)

    def close(self) -> None:
        """Stop reading (the client is gone, or it read what it needed). Idempotent."""
        self._finish(EndReason.DETACHED)

    def _finish(self, reason: EndReason) -> None:
        if self._end is None:
            self._end = reason
        self._log._discard(self)


class _Kept:
    """The frames a log keeps: ``frames[head:]``, with the state and time of each."""

    __slots__ = ("frames", "head", "states", "times")

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.states = bytearray()
        self.times = array("d")
        self.head = 0


class TaskLog:
    """One task's frames and its readers.

    Args:
        task_id: The task.
        pool: The server's pool (budget across logs, resumption).
        relayed: The log relays a task another instance runs: its end is not
            counted as a task ended here, and it is never kept for resumption
            (the shared event log serves that).
        first_seq: The sequence number the first appended frame gets.
    """

    __slots__ = (
        "_bytes",
        "_close_callbacks",
        "_closed",
        "_ended_at",
        "_final_seq",
        "_first_seq",
        "_kept",
        "_last_seq",
        "_passive",
        "_pool",
        "_readers",
        "_relayed",
        "_severed",
        "_since_trim",
        "_waiters",
        "metrics",
        "on_idle",
        "resumable",
        "scope",
        "snapshot",
        "task_id",
    )

    def __init__(
        self, task_id: str, pool: LogPool, *, relayed: bool = False, first_seq: int = 1
    ) -> None:
        self.task_id = task_id
        self.scope = ""
        """Whose task it is (see ``scope``): checked before an ended log is resumed."""
        self._pool = pool
        self.metrics = pool.metrics
        self._relayed = relayed
        # Kept frames, numbered _first_seq ... _last_seq (None while none is kept).
        self._kept: _Kept | None = None
        self._first_seq = first_seq
        self._last_seq = first_seq - 1
        self._final_seq = 0
        self._bytes = 0
        self._since_trim = 0
        self._closed = False
        self._ended_at = 0.0
        self._severed: Exception | None = None
        # Made only when needed: a parked task with no reader pays for none.
        self._readers: dict[LogReader, None] | None = None
        self._passive = 0
        self._waiters: dict[asyncio.Future[None], None] | None = None
        self._close_callbacks: list[Callable[[], None]] | None = None
        self.on_idle: Callable[[], None] | None = None
        """Called when the last reader leaves an open log."""
        self.snapshot: Task | None = None
        """The task as of ``last_seq`` (None before it exists), kept up to date by
        the writer; ``subscribe`` copies it. Do not mutate it elsewhere."""
        self.resumable = False
        """A client that activated the resume extension follows the task: frames are
        kept for the resume window (set through ``make_resumable``)."""

    @classmethod
    def ended(cls, task_id: str, pool: LogPool, last_seq: int) -> TaskLog:
        """A closed log that keeps nothing, for a task that ended at ``last_seq``.

        A reader resumed after the final frame reads it and ends at once.
        """
        log = cls(task_id, pool, relayed=True, first_seq=last_seq + 1)
        log._closed = True
        return log

    @property
    def last_seq(self) -> int:
        """The sequence number of the newest frame (0 before the first)."""
        return self._last_seq

    @property
    def first_kept(self) -> int:
        """The sequence number of the oldest frame still kept (``last_seq + 1`` if none)."""
        return self._first_seq

    @property
    def final_seq(self) -> int:
        """The sequence number of the final frame (0 while the task has not ended)."""
        return self._final_seq

    @property
    def kept(self) -> int:
        """Frames kept."""
        kept = self._kept
        return len(kept.frames) - kept.head if kept is not None else 0

    @property
    def kept_bytes(self) -> int:
        """Bytes kept (frames plus ``ENTRY_OVERHEAD`` each)."""
        return self._bytes

    @property
    def closed(self) -> bool:
        """Whether the log's task has ended (or the relay stopped)."""
        return self._closed

    @property
    def readers(self) -> int:
        """Readers currently attached (clients; passive readers not counted)."""
        return len(self._readers) - self._passive if self._readers else 0

    @property
    def attached(self) -> int:
        """Readers currently attached, passive ones included."""
        return len(self._readers) if self._readers else 0

    def make_resumable(self) -> None:
        """Keep frames for the resume window from now on (a resume-aware client follows)."""
        if not self.resumable and not self._relayed:
            self.resumable = True
            if self._closed:
                self._ended_at = self._pool.clock()
                self._pool._retain(self)
            else:
                self._pool._watch(self)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the log closes (step 3 of ``seal``)."""
        if self._closed:
            callback()
        elif self._close_callbacks is None:
            self._close_callbacks = [callback]
        else:
            self._close_callbacks.append(callback)

    def remove_on_close(self, callback: Callable[[], None]) -> None:
        """Forget a callback registered with ``on_close`` (no error if absent)."""
        if self._close_callbacks and callback in self._close_callbacks:
            self._close_callbacks.remove(callback)

    def subscribe(self, *, passive: bool = False) -> tuple[Task | None, LogReader]:
        """Join the log at its current end (``passive``: see ``reader``).

        Returns:
            A copy of the snapshot (None if the task does not exist yet) and a
            reader of every frame after it: no gap, no duplicate between the two.

        Raises:
            LogClosedError: The task has already ended.
        """
        if self._closed:
            raise LogClosedError(self.task_id)
        reader = self.reader(self._last_seq + 1, passive=passive)
        return (taskops.copy(self.snapshot) if self.snapshot is not None else None), reader

    def reader(self, next_seq: int, *, passive: bool = False) -> LogReader:
        """A reader whose first frame is ``next_seq`` (a resumption, or ``subscribe``).

        The caller checks that ``next_seq`` is kept; a reader past the end waits
        for it, and one before ``first_kept`` raises ``FrameNotKeptError`` on read.
        A *passive* reader (a push delivery) keeps frames like any other but
        does not count as someone following the task (``readers``): a parked
        task it follows may still leave memory.
        """
        reader = LogReader(self, next_seq, passive)
        if self._readers is None:
            self._readers = {}
        self._readers[reader] = None
        self._passive += passive
        return reader

    def append(self, frame: bytes, state: int = 0, *, final: bool = False) -> int:
        """Append ``frame`` (after it was persisted) and wake the readers.

        Args:
            frame: The serialized ``StreamResponse``; empty for a change that has
                no frame (it still takes a number: numbers count the task's changes).
            state: The ``TaskState`` the frame carries (0 for none).
            final: The frame ends the task: the log is sealed (see ``seal``).

        Returns:
            The frame's sequence number.

        Raises:
            LogClosedError: The task has already ended.
            NotFinalError: ``final`` with a state that is not terminal.
        """
        if final and not taskops.is_final_state(state):  # type: ignore[arg-type]
            raise NotFinalError(f"task {self.task_id}: a final frame must carry a final state")
        return self._append(frame, state, final)

    def answer(self, frame: bytes) -> int:
        """End the log with the agent's message-only answer (a task that never existed)."""
        return self._append(frame, 0, True)

    def _append(self, frame: bytes, state: int, final: bool) -> int:
        if self._closed:
            raise LogClosedError(self.task_id)
        self._last_seq += 1
        if self._readers or self.resumable:
            self._keep(frame, state)
        else:
            self._first_seq = self._last_seq + 1  # nobody will read it: numbered, not kept
        if final:
            self._final_seq = self._last_seq
            self._close()
        else:
            self._wake()
        return self._last_seq

    def seal(self, final: bytes, state: int, *, at: int = 0) -> None:
        """End the log with ``final``; idempotent. See the module docstring for the order.

        Args:
            final: The final frame (a serialized ``StreamResponse``).
            state: The terminal state it carries.
            at: The number the record gave the final change (0: the next one).
                Changes in between that this log never had (another instance
                wrote them) are numbered without a frame, so a resumed stream's
                numbers stay those of the record.

        Raises:
            NotFinalError: ``state`` is not terminal.
        """
        if self._closed:
            return
        if at:
            self.number_to(at - 1)
        self.append(final, state, final=True)

    def number_to(self, seq: int) -> None:
        """Number the changes up to ``seq`` that this log never had (another writer's).

        Each takes its number without a frame (readers skip it), so the log's
        numbers stay those of the record.

        Raises:
            LogClosedError: The task has already ended.
        """
        while self._last_seq < seq:
            self._append(b"", 0, False)

    def sever(self, error: Exception) -> None:
        """Stop carrying a task this log only relays; idempotent, no final frame.

        Readers drain what is kept, then raise ``error``. Close callbacks run as
        for ``seal``.

        Raises:
            ValueError: The log is the task's own (it ends only by ``seal``).
        """
        if not self._relayed:
            raise ValueError(f"task {self.task_id}: its own log ends only with a final frame")
        if self._closed:
            return
        self._severed = error
        self._close()

    def hand_over(self, error: Exception, *, continued: bool = False) -> None:
        """Stop carrying a task another instance continues; idempotent, no final frame.

        The one way a task's own log ends without a final frame: the task has
        not ended here, it waits for input (its last state is INPUT_REQUIRED
        or AUTH_REQUIRED) or, with ``continued``, another instance already
        continued it while this one was out of touch, and whoever continues it
        does so from the shared record, where every reader can follow it.
        Readers drain what is kept, then raise ``error``. Close callbacks run
        as for ``seal``.

        Raises:
            ValueError: Not ``continued``, and the task is not waiting for input.
        """
        if self._closed:
            return
        state = self.snapshot.status.state if self.snapshot is not None else 0
        if not continued and state not in taskops.INTERRUPTED:
            raise ValueError(f"task {self.task_id}: only a task waiting for input is handed over")
        self._severed = error
        self._close()

    def notify(self) -> None:
        """Wake ``wait_changed`` callers without appending (e.g. a run ended)."""
        self._wake()

    async def wait_changed(self) -> None:
        """Wait until the next append, close or ``notify``."""
        if self._closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = {waiter: None}
        else:
            self._waiters[waiter] = None
        try:
            await waiter
        finally:
            if self._waiters is not None:  # (a waiter that gave up leaves no trace)
                self._waiters.pop(waiter, None)

    def release(self) -> None:
        """Drop every kept frame (an ended log that is no longer needed)."""
        self._drop(self.kept)
        self._pool._forget(self)

    def _close(self) -> None:
        self._closed = True
        if not self._relayed and self._severed is None:
            ended = self.snapshot
            state = taskops.state_name(ended.status.state) if ended is not None else "MESSAGE"
            self.metrics.tasks_ended[state] += 1
        callbacks, self._close_callbacks = self._close_callbacks, None
        try:
            for callback in callbacks or ():
                try:
                    callback()
                except Exception:  # one faulty callback must not keep the others from running
                    logger.exception("a close callback of task %s's log failed", self.task_id)
        finally:
            self._wake()
            if self.resumable and self._severed is None:
                # (A severed or handed-over log is not kept for resuming: the task goes
                # on elsewhere, and a resumption reads it from there.)
                self._ended_at = self._pool.clock()
                self._pool._retain(self)
            elif not self._readers:
                self.release()

    def _keep(self, frame: bytes, state: int) -> None:
        kept = self._kept
        if kept is None:
            kept = self._kept = _Kept()
        size = len(frame) + ENTRY_OVERHEAD
        kept.frames.append(frame)
        kept.states.append(state)
        kept.times.append(self._pool.clock() if self.resumable else 0.0)
        self._bytes += size
        limits = self._pool.limits
        over = self.kept - limits.max_frames
        while over > 0 or (self._bytes > limits.max_bytes and self.kept > 1):
            self._drop(1, budget=True)
            over -= 1
        self._pool._charge(self, size)
        if not self.resumable:
            self._since_trim += 1
            if self._since_trim >= TRIM_EVERY:
                self._trim_read()

    def _trim_read(self) -> None:
        """Release the frames every reader has read (the log is not resumable)."""
        self._since_trim = 0
        if self._readers:
            slowest = min(reader._next for reader in self._readers)
            self._drop(min(slowest - self._first_seq, self.kept))

    def _expire(self, horizon: float) -> None:
        """Release frames appended before ``horizon`` that every reader has read."""
        kept = self._kept
        if kept is None:
            return
        slowest = min((r._next for r in self._readers or ()), default=self._last_seq + 1)
        drop = 0
        while drop < self.kept and kept.times[kept.head + drop] < horizon:
            drop += 1
        self._drop(min(drop, slowest - self._first_seq))

    def _shed(self, nbytes: int) -> None:
        """Drop the oldest frames until ``nbytes`` are freed (the pool is over budget)."""
        freed = 0
        while freed < nbytes and self.kept > 1:
            assert self._kept is not None
            freed += len(self._kept.frames[self._kept.head]) + ENTRY_OVERHEAD
            self._drop(1, budget=True)

    def _drop(self, count: int, *, budget: bool = False) -> None:
        kept = self._kept
        if count <= 0 or kept is None:
            return
        frames, start = kept.frames, kept.head
        freed = ENTRY_OVERHEAD * count
        for i in range(start, start + count):
            freed += len(frames[i])
            frames[i] = b""  # released now, not at the next compaction
        kept.head += count
        self._first_seq += count
        self._bytes -= freed
        self._pool.used -= freed
        if budget:
            self.metrics.frames_dropped += count
        if kept.head == len(frames):
            self._kept = None  # nothing left: the log holds no containers
        elif kept.head >= 64 and kept.head * 2 >= len(frames):
            del frames[: kept.head]
            del kept.states[: kept.head]
            del kept.times[: kept.head]
            kept.head = 0

    def _discard(self, reader: LogReader) -> None:
        if not self._readers or reader not in self._readers:
            return
        del self._readers[reader]
        self._passive -= reader.passive
        if self._readers:
            return
        self._readers = None
        if self._closed:
            expired = self._pool.clock() - self._ended_at > self._pool.limits.resume_window
            if not self.resumable or expired:
                self.release()
        else:
            if not self.resumable:
                self._drop(self.kept)
            if self.on_idle is not None:
                self.on_idle()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

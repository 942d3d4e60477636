"""Relays: on an instance that does not run a task, a log of it fed from the shared record.

Who runs what: a gRPC handler calls ``Relays.subscribe``; the first one for a
task creates its shared ``Relay`` and starts it (read the task, then follow
its changes from just after the last one read), later ones wait for that
start and join the same log. ``Relays.replay`` starts a private relay for
one resumed stream, from the task's snapshot when the cursor is at or past
it, else from the first change the stream still keeps. A relay nobody joins
(its callers left while it started) stops. The JetStream
consumer's callback (nats-py runs it in its own task, one message at a time)
applies each change to the relay's snapshot and appends the owner's frame,
with the owner's number, to the relay's ``TaskLog``: relayed readers are
cursors into it exactly as local readers are into the owner's log.

Who closes what: a final frame seals the log; when the last reader leaves,
the relay stops (the task goes on elsewhere); at shutdown every relay is
severed with ``RelayLostError``; a change missing from the record (the
stream dropped it) severs it with ``FrameNotKeptError``. In each case the
JetStream subscription is removed by a cleanup task that ``wait_closed``
waits for.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from a2a.types.a2a_pb2 import Task
from a2a.utils.errors import TaskNotFoundError
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from ..engine.engine import ended
from ..errors import FrameNotKeptError, RelayLostError, UnknownFormatError, quote
from ..journal import RecordedTask
from ..log.tasklog import LogClosedError, LogPool, LogReader, TaskLog
from ..model import taskops
from ..model.names import TASK_PREFIX
from ..obs.metrics import Metrics
from .records import Entry
from .store import ClusterJournal

logger = logging.getLogger(__name__.replace("._internal", ""))


class Relay:
    """Feeds one task's log on this instance from the journal's event stream.

    Args:
        task_id: The task.
        pool: This instance's log pool.
        shared: Whether every subscriber of the task here joins it (False: a
            private relay of one resumed stream).
    """

    def __init__(self, task_id: str, pool: LogPool, *, shared: bool) -> None:
        self.task_id = task_id
        self.shared = shared
        self._pool = pool
        self.log: TaskLog | None = None
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.subscription: JetStreamContext.PushSubscription | None = None
        self.reader: LogReader | None = None
        """A private relay's one reader (made before the first change arrives)."""
        self.waiting = 0
        """Callers waiting for a shared relay to start."""
        self._index: taskops.ArtifactIndex = {}
        self._unpack: Callable[[Msg, int], list[Entry]] = Entry.unpack
        """Decodes a delivered message (the journal's, set at start: its task's format)."""

    async def start(self, journal: ClusterJournal) -> TaskLog:
        """Read the task as recorded and follow the changes after it (no gap, no duplicate).

        Raises:
            TaskNotFoundError: The task is gone.
            UnsupportedOperationError: The task has ended.
            StoreUnavailableError: NATS did not answer.
        """
        self._unpack = journal.unpack
        recorded = await journal.get(self.task_id)
        if recorded is None:
            raise TaskNotFoundError(f"task {quote(self.task_id)} not found")
        task = recorded.task
        if taskops.is_final(task):
            raise ended(task)
        log = self._open(recorded.seq + 1)
        log.snapshot = task
        self._index = taskops.index_artifacts(task)
        self.subscription = await journal.follow(self.task_id, recorded.version, self._deliver)
        return log

    async def start_replay(self, journal: ClusterJournal, after: int, last: int) -> TaskLog:
        """Follow the task's changes from the one after ``after`` (a resumed stream).

        From the task's snapshot when it is at or before the cursor, else from
        the first change the stream still holds.

        Args:
            journal: The record.
            after: The cursor (the last change the stream had).
            last: The task's last change, as recorded when the stream resumed.

        Raises:
            FrameNotKeptError: The record no longer holds change ``after + 1``.
            StoreUnavailableError: NATS did not answer.
        """
        self._unpack = journal.unpack
        start = await journal.replay_start(self.task_id, after, last)
        log = self._open(after + 1)
        self.reader = log.reader(after + 1)
        self.subscription = await journal.follow(self.task_id, start, self._deliver)
        return log

    def _open(self, first_seq: int) -> TaskLog:
        self.log = TaskLog(self.task_id, self._pool, relayed=True, first_seq=first_seq)
        return self.log

    async def _deliver(self, msg: Msg) -> None:
        meta = msg.metadata
        try:
            entries = self._unpack(msg, int(meta.sequence.stream) if meta else 0)
        except UnknownFormatError as exc:
            # A newer version wrote it: end the relayed streams saying so, never misread.
            if self.log is not None:
                self.log.sever(exc)
            return
        for entry in entries:
            self._take(entry)

    def _take(self, entry: Entry) -> None:
        log = self.log
        if log is None or log.closed or entry.seq <= log.last_seq:
            return  # before where this relay starts, or after its end
        if entry.seq != log.last_seq + 1:
            log.sever(FrameNotKeptError(self.task_id, log.last_seq + 1, entry.seq, entry.seq))
            return
        if self.shared:
            try:
                task = log.snapshot
                assert task is not None
                applied = entry.apply(task, self._index)
                if applied is not task:
                    self._index = taskops.index_artifacts(applied)
                log.snapshot = applied
            except Exception:  # a change the owner accepted: only a bug of ours gets here
                logger.exception("relay of task %s could not apply a change", self.task_id)
        log.append(entry.frame, entry.state, final=entry.final)


def _close_reader(relay: Relay, _: object = None) -> None:
    if relay.reader is not None:
        relay.reader.close()


class Relays:
    """This instance's relays: at most one shared relay per task, and private replays.

    Args:
        journal: The shared record.
        pool: This instance's log pool.
        metrics: Where open relays are counted.
    """

    def __init__(self, journal: ClusterJournal, pool: LogPool, metrics: Metrics) -> None:
        self._journal = journal
        self._pool = pool
        self._metrics = metrics
        self._shared: dict[str, Relay] = {}
        self._open: set[Relay] = set()
        self._cleanups: set[asyncio.Task[None]] = set()
        self._severed: str | None = None

    def __len__(self) -> int:
        return len(self._open)

    async def subscribe(self, task_id: str, *, passive: bool = False) -> tuple[Task, LogReader]:
        """Join the shared relay of ``task_id``, starting it if this instance has none.

        A ``passive`` reader (a long-poll) is not one of the task's subscribers
        here (``TaskLog.readers``), yet keeps the relay going while it reads.

        Returns:
            The snapshot and a reader of every frame after it.

        Raises:
            TaskNotFoundError: The task is gone.
            UnsupportedOperationError: The task has ended.
            StoreUnavailableError: NATS did not answer.
            RelayLostError: This instance is shutting down.
        """
        while True:
            if self._severed is not None:
                raise RelayLostError(self._severed)
            relay = self._shared.get(task_id)
            if relay is None:
                relay = self._start(Relay(task_id, self._pool, shared=True), None)
            relay.waiting += 1
            try:
                await asyncio.shield(relay.started)
            finally:
                relay.waiting -= 1
                if relay.waiting == 0:
                    # (a caller that gave up may leave a started relay nobody reads)
                    relay.started.add_done_callback(functools.partial(self._unread, relay))
            assert relay.log is not None
            try:
                snapshot, reader = relay.log.subscribe(passive=passive)
            except LogClosedError:
                final = relay.log.snapshot
                if relay.log.final_seq and final is not None:
                    raise ended(final) from None
                continue  # it stopped as we arrived (its last reader left): start anew
            assert snapshot is not None
            return snapshot, reader

    async def replay(self, recorded: RecordedTask, after: int) -> LogReader:
        """A private relay's reader of the task's frames after ``after``.

        Raises:
            FrameNotKeptError: The record no longer holds frame ``after + 1``.
            StoreUnavailableError: NATS did not answer.
            RelayLostError: This instance is shutting down.
        """
        if self._severed is not None:
            raise RelayLostError(self._severed)
        relay = self._start(
            Relay(recorded.task.id, self._pool, shared=False), (after, recorded.seq)
        )
        try:
            await asyncio.shield(relay.started)
        except asyncio.CancelledError:
            # The caller left while the replay started: its reader goes when it does.
            relay.started.add_done_callback(functools.partial(_close_reader, relay))
            raise
        assert relay.reader is not None
        return relay.reader

    def sever_all(self, why: str) -> None:
        """End every relayed stream with ``RelayLostError(why)``; relay no more."""
        self._severed = why
        for relay in list(self._open):
            if relay.log is not None:
                relay.log.sever(RelayLostError(why))

    async def wait_closed(self) -> None:
        """Wait until every relay that ended has removed its JetStream subscription."""
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    def _unread(self, relay: Relay, _: object = None) -> None:
        """Stop a started shared relay that no reader joined (its callers left)."""
        log = relay.log
        if log is not None and not log.closed and not log.attached and not relay.waiting:
            log.sever(RelayLostError("no reader left"))

    def _start(self, relay: Relay, after: tuple[int, int] | None) -> Relay:
        if relay.shared:
            self._shared[relay.task_id] = relay
        self._open.add(relay)
        self._metrics.relays_open += 1
        starter = asyncio.create_task(
            self._run_start(relay, after), name=f"{TASK_PREFIX}:relay-start:{relay.task_id}"
        )
        self._track(starter)
        return relay

    async def _run_start(self, relay: Relay, after: tuple[int, int] | None) -> None:
        try:
            if after is None:
                log = await relay.start(self._journal)
            else:
                log = await relay.start_replay(self._journal, *after)
        except BaseException as exc:
            self._ended(relay)
            failed = exc if isinstance(exc, Exception) else RelayLostError("relay start stopped")
            relay.started.set_exception(failed)
            relay.started.exception()  # retrieved here: the waiters re-raise it
            if not isinstance(exc, Exception):
                raise  # (cancelled: never swallowed)
            return
        log.on_close(lambda: self._ended(relay))
        log.on_idle = lambda: log.sever(RelayLostError("no reader left"))
        if self._severed is not None:
            log.sever(RelayLostError(self._severed))
        relay.started.set_result(None)

    def _ended(self, relay: Relay) -> None:
        if relay not in self._open:
            return
        self._open.discard(relay)
        self._metrics.relays_open -= 1
        if self._shared.get(relay.task_id) is relay:
            del self._shared[relay.task_id]
        if relay.subscription is not None:
            self._track(
                asyncio.create_task(self._unsubscribe(relay), name=f"{TASK_PREFIX}:relay-end")
            )

    async def _unsubscribe(self, relay: Relay) -> None:
        if relay.subscription is not None:
            try:
                await relay.subscription.unsubscribe()
            except Exception as exc:  # the connection may be closing: nothing left to do
                logger.debug("relay of %s: unsubscribe failed: %s", relay.task_id, exc)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

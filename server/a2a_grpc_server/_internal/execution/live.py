"""LiveTask: one running task's state, its log, and the only code that writes it.

Who runs what: ``commit`` is called by the task's consumer with the events
the executor enqueued (as many as are waiting, in order: they are recorded
in one write); ``finalize`` by the consumer (executor failed or ended
without an outcome), by CancelTask (the executor did not cancel in time, or
its ``cancel()`` ended without a final state) and by shutdown. Each holds the
task's lock from changing the task to appending its frame, and so does every
reader of the task's current state (``snapshot``, ``subscribe``): persist,
then append, and nobody sees a change the journal has not accepted. Once the
task is final nothing more is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from a2a.types.a2a_pb2 import (
    Message,
    StreamResponse,
    Task,
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import InvalidAgentResponseError

from ..config import DEFAULT_MAX_TASK_BYTES
from ..errors import OwnerTooLateError, TaskHandedOverError, quote
from ..journal import (
    Change,
    FinalTaskError,
    PartialWriteError,
    RecordedTask,
    StoreError,
    TaskExistsError,
    TaskJournal,
    UnknownTaskError,
    VersionConflictError,
)
from ..log.tasklog import LogReader, TaskLog
from ..model import taskops
from ..model.sizing import TaskSize, TaskTooLargeError
from ..model.taskops import Event
from ..obs import tracing

logger = logging.getLogger(__name__.replace("._internal", ""))


class LiveTask:
    """A task that has not ended yet, on the instance that runs it.

    Args:
        task_id: The task's id.
        context_id: The task's context id.
        journal: Where the task is recorded.
        log: The task's frames.
        task: The recorded task, or None for a task the executor has not
            created yet.
        version: The recorded version of ``task``.
        first_message: The user message that starts a new task.
        max_bytes: The most bytes the task may take (``ServerConfig.max_task_bytes``).
        scope: Whose task it is (see ``scope``).
    """

    __slots__ = (
        "_dirty",
        "_first_message",
        "_index",
        "_journal",
        "_landed",
        "_size",
        "_task",
        "_unconfirmed",
        "_version",
        "admitting",
        "answer",
        "context_id",
        "final_unrecorded",
        "letting_go",
        "lock",
        "log",
        "scope",
        "state_seq",
        "task_id",
    )

    def __init__(
        self,
        task_id: str,
        context_id: str,
        journal: TaskJournal,
        log: TaskLog,
        task: Task | None = None,
        version: int = 0,
        first_message: Message | None = None,
        max_bytes: int = DEFAULT_MAX_TASK_BYTES,
        scope: str = "",
    ) -> None:
        self.task_id = task_id
        self.context_id = context_id
        self.scope = scope
        """Whose task it is (see ``scope``); recorded when the task is created."""
        log.scope = scope
        self.log = log
        self.lock = asyncio.Lock()
        self.answer: Message | None = None
        """The executor's message-only answer, when it gave one."""
        self._journal = journal
        self._task = task
        self._index = taskops.index_artifacts(task) if task is not None else {}
        self._version = version
        self._size = TaskSize(max_bytes, task)
        self._first_message = first_message
        self._dirty = False
        self._unconfirmed: list[Change] = []
        self._landed = 0
        """How many of ``_unconfirmed`` may have landed (see ``_reconcile``)."""
        self.admitting = False
        """A follow-up message is being admitted (its run is about to start)."""
        self.final_unrecorded = False
        """The log ended with a final frame the journal could not record yet."""
        self.state_seq = 0
        """The sequence number of the last change that carried a state."""
        self.letting_go: Callable[[], None] | None = None
        """Called before the log is handed over (the registry lets go of the task)."""
        log.snapshot = task

    @property
    def task(self) -> Task | None:
        """The task as last recorded (do not mutate), or None before it exists.

        Between the lock's acquisition and release a writer may be changing
        it; read it under ``lock`` (or through ``snapshot``) for a state that
        matches the log.
        """
        return self._task

    @property
    def state(self) -> TaskState:
        """The task's current state (UNSPECIFIED before it exists)."""
        return self._task.status.state if self._task is not None else taskops.UNSPECIFIED

    async def snapshot(self) -> tuple[Task | None, int]:
        """A copy of the task as recorded and the seq of the last change it includes.

        Raises:
            StoreError: A write failed and the journal cannot be read to tell
                what it holds.
        """
        async with self.lock:
            await self._settled()
            task = taskops.copy(self._task) if self._task is not None else None
            return task, self.log.last_seq

    async def subscribe(self) -> tuple[Task | None, LogReader]:
        """A copy of the task and a reader of every frame after it (see ``TaskLog.subscribe``).

        Raises:
            LogClosedError: The task has ended.
            StoreError: As for ``snapshot``.
        """
        async with self.lock:
            await self._settled()
            return self.log.subscribe()

    def watch(self, after: int) -> LogReader | None:
        """A passive reader of the task's next frame, if it is still at change ``after``.

        For a long-poll (GetTask with v1.1's ``current_generation``): the
        reader is not one of the task's subscribers (``TaskLog.readers``,
        which ``quota_subscribers`` bounds), so polls never take a
        subscriber's place. Needs no lock: it takes no snapshot, and a
        change made meanwhile is one it reads.

        Returns:
            A reader from the frame after the log's last, or None when the
            task has ended or moved past ``after`` already.
        """
        log = self.log
        if log.closed or log.last_seq > after:
            return None
        return log.reader(log.last_seq + 1, passive=True)

    async def _settled(self) -> None:
        """Make the task what the journal holds again, if a write failed (lock held)."""
        if self._dirty:
            await self._reconcile()

    async def commit(self, events: Sequence[Event]) -> None:
        """Record the effect of ``events``, in order, in one write; then append their frames.

        Events that arrive after the task ended (or after one that ended it)
        are dropped and logged. If an event does not fit the task, the ones
        before it are recorded, then the error is raised.

        Raises:
            InvalidAgentResponseError: An event does not fit this task.
            StoreError: The journal refused the write.
        """
        async with self.lock:
            task, creating = self._task, self._task is None
            changes: list[Change] = []
            error: InvalidAgentResponseError | None = None
            for event in events:
                if self.log.closed or (task is not None and taskops.is_final(task)):
                    self.drop(event, "the task already ended")
                    continue
                try:
                    if task is None:
                        if isinstance(event, Message):
                            self._answer(event)
                            continue
                        task = self._new(event if isinstance(event, Task) else None)
                        changes.append(self._change(changes, StreamResponse(task=task)))
                        if isinstance(event, Task):
                            continue
                    # (Anything but an event: apply() refuses it below.)
                    if isinstance(event, taskops.EVENT_TYPES):
                        adding = event.ByteSize()
                        self._size.admit(task, self.task_id, adding, f"a {type(event).__name__}")
                    # Applied in place, not on a copy (a copy per event would make
                    # a long stream quadratic), under the lock, so no reader sees
                    # it before the journal accepted it. apply() validates before
                    # it mutates; if the journal then refuses, the task is "dirty"
                    # and ends (finalize) from what the journal holds.
                    frame, state = taskops.apply_serialized(task, event, self._index)
                except InvalidAgentResponseError as exc:
                    error = exc
                    break
                changes.append(Change(self.log.last_seq + len(changes) + 1, frame, state))
            if changes:
                assert task is not None
                if not creating and self._size.should_rebuild(task):
                    # Its arena holds more replaced bytes than live ones: a fresh copy
                    # frees them (see ``sizing``).
                    task = taskops.copy(task)
                await self._record(task, changes, creating=creating)
            if error is not None:
                raise error

    async def add_user_message(self, message: Message, act_by: float | None = None) -> None:
        """Record a follow-up user message in the task's history (a change without a frame).

        Raises:
            OwnerTooLateError: The event loop's time is past ``act_by`` (a routed
                follow-up whose asker may have given up): nothing is recorded.
        """
        async with self.lock:
            if act_by is not None and asyncio.get_running_loop().time() > act_by:
                raise OwnerTooLateError("the follow-up reached its task too late to be recorded")
            assert self._task is not None
            self._size.admit(self._task, self.task_id, message.ByteSize(), "this message")
            updated = taskops.copy(self._task)
            taskops.add_user_message(updated, message)
            change = Change(self.log.last_seq + 1, message=message)
            await self._record(updated, [change], creating=False)

    async def finalize(self, state: TaskState, text: str, *, deadline: float | None = None) -> None:
        """End the task in ``state`` unless it already ended; every reader gets the frame.

        The frame goes to the readers even if the journal cannot record it
        now: the task is then ``final_unrecorded``, and the engine's
        ``FinalRetries`` retries ``record_final`` until the journal holds it.

        Args:
            state: A terminal state.
            text: The status message, for a person to read.
            deadline: Event-loop time after which the journal is not waited for
                (the frame goes to the readers, the write is retried later).
        """
        async with self.lock:
            if self.log.closed:
                return
            readable = True
            try:
                async with asyncio.timeout_at(deadline):
                    await self._settled()
                    if self.log.closed:  # the write that failed had landed, and ended it
                        return
                    if self._task is None:
                        await self._create(None)
            except (StoreError, TimeoutError):
                logger.exception("could not read or create task %s to end it", self.task_id)
                readable = False
            # (A task that reads final here ended in a write that failed: the log
            # has no final frame yet, so it gets this one.)
            base = self._task or taskops.new_task(
                self.task_id, self.context_id, self._first_message
            )
            updated = taskops.copy(base)
            frame = taskops.apply(updated, taskops.status_event(updated, state, text))
            data = frame.SerializeToString()
            recorded = False
            if readable and self._task is not None:
                try:
                    change = Change(self.log.last_seq + 1, data, state)
                    async with asyncio.timeout_at(deadline):
                        self._version = await self._journal.update(updated, self._version, [change])
                    recorded = True
                except REFUSED:
                    # Someone else wrote the task (a survivor that took this
                    # instance for lost): its outcome is the task's.
                    try:
                        async with asyncio.timeout_at(deadline):
                            if await self._close_as_recorded():
                                return
                    except TimeoutError:
                        pass  # (the frame below goes out; the record is reconciled later)
                except (StoreError, TimeoutError):
                    logger.exception("could not record the final state of task %s", self.task_id)
            # Readers get the frame now, recorded or not; what is not is retried.
            self.final_unrecorded = not recorded
            self._task = self.log.snapshot = updated
            self.log.seal(data, state)

    async def record_final(self) -> None:
        """Record the final state the log ended with (after ``finalize`` could not).

        Written on top of what the journal holds now, with the status the
        streams received, so the journal, later reads and later subscribers
        agree with them.

        Once it returns, the journal holds a final state: this one, or one
        another instance recorded first.

        Raises:
            StoreError: The journal could not be read or refused the write (or
                someone wrote the task meanwhile): try again.
        """
        final = self.log.snapshot
        assert final is not None and self.log.closed
        recorded = await self._journal.get(self.task_id)
        if recorded is not None and taskops.is_final(recorded.task):
            if recorded.task.status.state != final.status.state:
                logger.warning(
                    "task %s: streams got %s, but another instance recorded %s first",
                    self.task_id,
                    taskops.state_name(final.status.state),
                    taskops.state_name(recorded.task.status.state),
                )
            self.final_unrecorded = False
            return
        if recorded is None:  # it was never created
            task = taskops.copy(final)
            first = Change(1, StreamResponse(task=task).SerializeToString(), task.status.state)
            await self._journal.create(task, [first], keep_frames=False, scope=self.scope)
        else:
            task = taskops.copy(recorded.task)
            event = TaskStatusUpdateEvent(task_id=self.task_id, context_id=self.context_id)
            event.status.CopyFrom(final.status)
            frame, state = taskops.apply_serialized(task, event)
            change = Change(recorded.seq + 1, frame, state)
            await self._journal.update(task, recorded.version, [change])
        self.final_unrecorded = False

    async def _reconcile(self) -> None:
        """Start again from what the journal holds, after a write of ours failed.

        Which of our unconfirmed changes landed depends on how the write
        failed (``_landed``): none when the journal refused it (a compare-and-set
        lost to another instance's write, e.g. a survivor that ended the task),
        the first ``recorded`` of a partial write that the journal refused, and
        for a write whose outcome is unknown (a timeout, a cancellation) those
        the record's numbers leave room for. Their frames are appended, so the
        log and the journal number the same changes; the task becomes the
        journal's. If the record is final, the log is sealed with the recorded
        status, numbered as recorded, whoever wrote it (the same status as ours
        when ours landed): every reader ends with the task's recorded outcome.

        Raises:
            StoreError: The journal could not be read (the task stays dirty).
        """
        recorded = await self._journal.get(self.task_id)
        unconfirmed, self._unconfirmed = self._unconfirmed, []
        ahead = 0 if recorded is None else recorded.seq - self.log.last_seq
        # (Final only with a change beyond this log's: a journal that keeps the
        # object it was given may show a refused write's in-place changes.)
        final = recorded is not None and ahead > 0 and taskops.is_final(recorded.task)
        landed = max(0, min(ahead, len(unconfirmed), self._landed))
        if final:
            # The record's last change is final: whoever wrote it, the log is sealed
            # with the recorded status (the same as ours when ours landed).
            landed = min(landed, ahead - 1)
        if recorded is not None and self._continued_elsewhere(recorded, ahead - landed, final):
            self._dirty = False
            return
        if recorded is not None:
            self._task = self.log.snapshot = recorded.task
            self._version = recorded.version
            self._index = taskops.index_artifacts(recorded.task)
            self._size.measure(recorded.task)
            self._first_message = None
        for change in unconfirmed[:landed]:
            self.log.append(change.frame, change.state)
        if recorded is not None and final and not self.log.closed:
            self._seal_as_recorded(recorded)
        elif recorded is not None and not final:
            self.log.number_to(recorded.seq)  # (changes of another writer's)
        self._dirty = False

    def _seal_as_recorded(self, recorded: RecordedTask) -> None:
        """Seal the log with ``recorded``'s final status, numbered as the record numbers it."""
        task = recorded.task
        logger.warning(
            "task %s was ended %s by another instance",
            self.task_id,
            taskops.state_name(task.status.state),
        )
        update = TaskStatusUpdateEvent(task_id=task.id, context_id=task.context_id)
        update.status.CopyFrom(task.status)
        self._task = self.log.snapshot = task
        frame = StreamResponse(status_update=update).SerializeToString()
        self.log.seal(frame, task.status.state, at=recorded.seq)

    async def close_if_ended_elsewhere(self) -> bool:
        """End the log with the recorded outcome if another instance ended the task.

        For an owner that was out of touch longer than its lease (paused,
        partitioned): a survivor may have ended its tasks meanwhile, and a
        task that writes nothing more would never learn it otherwise.

        Returns:
            Whether the task had ended elsewhere (its streams got that outcome)
            or another instance continued it (its streams were handed over).
        """
        async with self.lock:
            if self.log.closed:
                return False
            return await self._close_as_recorded(strict=True)

    async def _close_as_recorded(self, *, strict: bool = False) -> bool:
        """End the log with the outcome another instance already recorded.

        In cluster mode a survivor that thought this instance lost may have
        ended the task (and logged its frame); local readers then get that
        same outcome, not one of ours. If another instance continued the task
        meanwhile, the log is handed over instead (``_continued_elsewhere``).

        Returns:
            Whether the log ended (or was handed over) because of what another
            instance wrote.

        Raises:
            StoreError: With ``strict``, the journal could not be read (otherwise
                that answers False).
        """
        try:
            await self._settled()  # (our own changes of unknown outcome counted first)
            if self.log.closed:
                return True
            recorded = await self._journal.get(self.task_id)
        except StoreError:
            if strict:
                raise
            return False
        if recorded is None or recorded.seq <= self.log.last_seq:
            return False  # no change beyond this log's: not ended elsewhere (see _reconcile)
        final = taskops.is_final(recorded.task)
        if self._continued_elsewhere(recorded, recorded.seq - self.log.last_seq, final):
            return True
        if not final:
            return False
        self._seal_as_recorded(recorded)
        return True

    def _continued_elsewhere(self, recorded: RecordedTask, others: int, final: bool) -> bool:
        """Hand the log's readers over if another instance continued the task meanwhile.

        The record holds ``others`` changes beyond this log's that this
        instance did not write. One final change alone is a survivor (or a
        cancel) ending the task: the log is sealed with it (``_seal_as_recorded``),
        and its readers miss nothing. Anything more, or a change that is not
        final, means another instance ran the task while this one was out of
        touch (a survivor released it, another claimed it, and its executor
        went on there, even while this instance's executor was still
        emitting). Sealing the log, or numbering past those changes, would
        skip their frames, so its readers are handed over (UNAVAILABLE
        TASK_HANDED_OVER): they resubscribe, or resume from their cursor,
        through the record, which holds every frame. Nothing more of this
        instance's run is written: its run sees the log closed.

        Args:
            recorded: The task as recorded.
            others: How many of the record's changes beyond this log's are not ours.
            final: Whether the record's last change ended the task.
        """
        if others <= 0 or (final and others == 1) or self.log.closed:
            return False
        logger.warning(
            "task %s was continued by instance %s while this one was out of touch "
            "(%d change(s) of its record are not this instance's): its streams here "
            "are handed over",
            self.task_id,
            recorded.owner or "(none)",
            others,
        )
        # (The task as recorded, not a copy a refused write changed in place.)
        self._task = self.log.snapshot = recorded.task
        self._version = recorded.version
        self.hand_over(
            "another instance continued it while this one was out of touch", continued=True
        )
        return True

    def hand_over(self, why: str, *, continued: bool = False) -> None:
        """Let go of the task: another instance continues it from the shared record.

        Its readers here end with ``TaskHandedOverError`` (UNAVAILABLE), after
        ``letting_go`` (the registry's part: it leaves memory, its deliveries
        here stop) ran. See ``TaskLog.hand_over``.

        Args:
            why: For the readers' error.
            continued: Another instance already continued it (it need not be
                waiting for input here).
        """
        if self.log.closed:
            return
        if self.letting_go is not None:
            self.letting_go()
        self.log.hand_over(TaskHandedOverError(self.task_id, why), continued=continued)

    async def _create(self, given: Task | None) -> None:
        task = self._new(given)
        await self._record(task, [self._change([], StreamResponse(task=task))], creating=True)

    def _new(self, given: Task | None) -> Task:
        """The task this one starts as: the executor's (checked), or a new one."""
        if given is not None:
            if given.id and given.id != self.task_id:
                raise InvalidAgentResponseError(
                    f"agent created task {quote(given.id)} while serving task {quote(self.task_id)}"
                )
            task = taskops.copy(given)
            task.id, task.context_id = self.task_id, task.context_id or self.context_id
            if task.context_id != self.context_id:
                raise InvalidAgentResponseError(
                    f"agent created a task in context {quote(task.context_id)}, "
                    f"not {quote(self.context_id)}"
                )
            if task.status.state == taskops.UNSPECIFIED:
                task.status.state = taskops.SUBMITTED
            if not task.status.HasField("timestamp"):
                task.status.timestamp.CopyFrom(taskops.now())
            first = self._first_message
            if first is not None and all(m.message_id != first.message_id for m in task.history):
                task.history.insert(0, first)
        else:
            task = taskops.new_task(self.task_id, self.context_id, self._first_message)
        self._size.measure(task)
        if self._size.exact > self._size.limit:
            raise TaskTooLargeError(
                self.task_id, 0, self._size.exact, self._size.limit, "the agent's Task"
            )
        self._index = taskops.index_artifacts(task)
        return task

    def _change(self, before: list[Change], frame: StreamResponse) -> Change:
        """The change of ``frame``, numbered after the log and the ``before`` changes."""
        seq = self.log.last_seq + len(before) + 1
        return Change(seq, frame.SerializeToString(), taskops.frame_state(frame))

    async def _record(self, task: Task, changes: list[Change], *, creating: bool) -> None:
        """Persist the changes that made ``task``, then append their frames.

        The journal first: a frame is in the log only once it is durable. If
        the journal recorded only the first changes, their frames are appended
        and the task starts again from what the journal holds (then the error
        goes on up: the task ends).
        """
        try:
            if creating:
                ended_unseen = taskops.is_final(task) and not self.log.resumable
                self._version = await self._journal.create(
                    task, changes, keep_frames=not ended_unseen, scope=self.scope
                )
            else:
                self._version = await self._journal.update(task, self._version, changes)
        except StoreError as exc:
            # Nothing is appended yet, and the task changed in place is not what
            # the journal holds: dirty until reconciled (here if the journal can
            # be read, else by the next reader of the task or by finalize).
            self._dirty, self._unconfirmed = True, changes
            self._landed = _landed(exc, len(changes))
            with contextlib.suppress(StoreError):
                await self._reconcile()
            raise
        except asyncio.CancelledError:
            # The caller gave up (its deadline passed) mid-write: the write may
            # have landed. Dirty: the next reader of the task, or finalize, reads
            # the journal back first.
            self._dirty, self._unconfirmed, self._landed = True, changes, len(changes)
            raise
        if creating:
            self._first_message = None  # in the task's history now
        self._task = self.log.snapshot = task
        self._dirty = False
        final, last = taskops.is_final(task), changes[-1]
        for change in changes:
            self.log.append(change.frame, change.state, final=final and change is last)
            if change.state:
                self.state_seq = change.seq
                tracing.state_event(taskops.state_name(change.state))  # type: ignore[arg-type]

    def _answer(self, message: Message) -> None:
        size = message.ByteSize()
        if size > self._size.limit:
            raise TaskTooLargeError(self.task_id, 0, size, self._size.limit, "the agent's answer")
        self.answer = message
        self.log.answer(StreamResponse(message=message).SerializeToString())

    def drop(self, event: Event, why: str) -> None:
        """Count and log an event that is not applied."""
        self.log.metrics.dropped_events += 1
        logger.warning(
            "dropped a %s for task %s (%s): %s",
            type(event).__name__,
            self.task_id,
            taskops.state_name(self.state),
            why,
        )


REFUSED = (VersionConflictError, FinalTaskError, UnknownTaskError, TaskExistsError)
"""Write errors after which none of the write's changes is recorded (the journal refused it)."""


def _landed(error: StoreError, written: int) -> int:
    """How many of ``written`` changes may be recorded after a write failed with ``error``."""
    if isinstance(error, REFUSED):
        return 0
    if isinstance(error, PartialWriteError):
        if isinstance(error.__cause__, REFUSED):
            return error.recorded
        return written  # the one that failed may have landed too: as the record's numbers say
    return written  # unknown: as many as the record's numbers leave room for

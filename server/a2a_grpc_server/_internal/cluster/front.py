"""ClusterFront: the task operations in cluster mode, routing what another instance owns.

Who runs what: the gRPC servicer calls it as it would call the engine (both
are ``engine.ports.TaskOperations``). For each operation on an existing task
it reads the task as recorded, checking the caller's scope first (another
scope's task is answered exactly as a missing one, before anything else is
done), then either hands the operation to this instance's engine, with what
it read, or, for a task another instance owns, serves it through the peers:
a subscription joins this instance's relay of the task, a resumption reads
the shared record, and a cancel or follow-up message is sent to the owner,
which runs it through its own engine, so every reader everywhere sees the
same frames and outcome. A task that waits for input owned by nobody (its
owner shut down or was lost) is claimed by the instance that takes its next
message or cancel, and runs there. A cancel or follow-up its owner refuses
because it is shutting down waits (bounded by the client's deadline) until the
owner has handed the task over, then goes on where it went.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from a2a.types.a2a_pb2 import Message, SendMessageRequest, Task
from a2a.utils.errors import UnsupportedOperationError

from ..engine.engine import Started, TaskEngine
from ..engine.ports import Peers
from ..errors import OwnerTimeoutError, ServerShuttingDownError
from ..journal import RecordedTask, TaskJournal
from ..log.tasklog import LogReader
from ..model import taskops
from ..model.caller import Caller

HANDOVER_WAIT = 10.0
"""Seconds a follow-up or cancel waits for a task's owner, shutting down, to hand it over."""
HANDOVER_MARGIN = 0.5
"""Seconds before the client's deadline by which that wait gives up."""
HANDOVER_FIRST = 0.05
HANDOVER_MOST = 0.5
"""Seconds between two reads of the task meanwhile: from the first, doubling to the most."""


@dataclass(slots=True)
class Routed:
    """A follow-up message this instance sent to the task's owner (cluster mode).

    Attributes:
        snapshot: The task as the message found it (the message included).
        reader: This caller's reader of the task's relay.
        journal: Where the task is read back from.
    """

    snapshot: Task
    reader: LogReader
    journal: TaskJournal
    since: int = 0
    """The number of the message's change (the last before its run: nothing runs for a
    waiting task, so the owner records the message as the change after the reader's
    snapshot)."""

    @property
    def task_id(self) -> str:
        """The task the message continues."""
        return self.snapshot.id

    async def outcome(self, *, immediately: bool) -> tuple[Task | Message, int]:
        """Wait for what a blocking SendMessage answers (see ``Started.outcome``)."""
        reader = self.reader
        try:
            if not immediately:
                async for _, _, state in reader:
                    if taskops.is_final_state(state) or state in taskops.INTERRUPTED:  # type: ignore[arg-type]
                        break
        finally:
            reader.close()
        recorded = await self.journal.get(self.snapshot.id)
        if recorded is None:
            return self.snapshot, reader.next_seq - 1
        return recorded.task, recorded.seq


class ClusterFront:
    """The task operations of an instance in a cluster (see the module docstring).

    Args:
        engine: This instance's engine (its own tasks).
        peers: The other instances.
    """

    def __init__(self, engine: TaskEngine, peers: Peers) -> None:
        self._engine = engine
        self._peers = peers

    async def send(
        self,
        request: SendMessageRequest,
        call: Caller,
        *,
        subscribe: bool,
        resumable: bool = False,
    ) -> Started | Routed:
        """``TaskEngine.send``; a follow-up for a task another instance owns goes to its owner.

        Raises:
            As ``TaskEngine.send``, and OwnerUnavailableError: the owner did not answer.
        """
        engine, message = self._engine, request.message
        if not engine.accepting or not message.task_id:
            return await engine.send(request, call, subscribe=subscribe, resumable=resumable)
        started = time.monotonic()
        found = await engine.check_follow_up(message.task_id, message.context_id, call.scope)
        found = await self._take_if_free(found)
        while True:
            if not engine.tasks.owned_elsewhere(found):
                return await engine.send(
                    request, call, subscribe=subscribe, resumable=resumable, found=found
                )
            # Subscribed before the owner starts: no frame of this message is missed.
            snapshot, reader = await self._peers.subscribe(found)
            since = reader.next_seq  # (the owner records the message as the next change)
            try:
                await self._peers.send(found, request, call)
            except ServerShuttingDownError:
                reader.close()
                found = await self._handed_over(found, call, started)
                continue
            except OwnerTimeoutError as exc:  # (it may have run: say whom, and from where)
                reader.close()
                exc.asked, exc.after, exc.seen = found.owner, since - 1, len(snapshot.history)
                raise
            except BaseException:
                reader.close()
                raise
            break
        message.context_id = snapshot.context_id
        taskops.add_user_message(snapshot, message)
        return Routed(snapshot, reader, engine.tasks.journal, since)

    async def cancel(self, task_id: str, call: Caller) -> Task:
        """``TaskEngine.cancel``; a task another instance runs is canceled by its owner.

        Raises:
            As ``TaskEngine.cancel``, and OwnerUnavailableError: the owner did not answer.
        """
        engine = self._engine
        live = engine.tasks.live_in(task_id, call.scope)
        if live is not None and live.task is not None and not taskops.is_final(live.task):
            return await engine.cancel(task_id, call)
        started = time.monotonic()
        found = await self._take_if_free(await engine.tasks.recorded(task_id, call.scope))
        while True:
            if taskops.is_final(found.task) or not engine.tasks.owned_elsewhere(found):
                return await engine.cancel(task_id, call, found=found, started=started)
            try:
                final = await self._peers.cancel(found, call)
            except ServerShuttingDownError:
                found = await self._handed_over(found, call, started)
                continue
            engine.tasks.metrics.cancel_seconds.observe(time.monotonic() - started)
            return final

    async def _handed_over(self, found: RecordedTask, call: Caller, started: float) -> RecordedTask:
        """The task once its owner, shutting down, has handed it over (or ended it).

        An owner that refuses because it is leaving releases its waiting tasks to
        the cluster (and ends the rest) as it goes: the task is read again, with a
        growing back-off, until its record shows another owner, nobody (then it
        is claimed here) or its end; within ``HANDOVER_WAIT`` and the client's
        deadline.

        Raises:
            ServerShuttingDownError: The owner did not hand it over in time.
        """
        limit = HANDOVER_WAIT
        if call.timeout is not None:
            limit = min(limit, call.timeout - HANDOVER_MARGIN)
        delay = HANDOVER_FIRST
        while time.monotonic() - started + delay < limit:
            await asyncio.sleep(delay)  # (the owner is releasing its waiting tasks)
            again = await self._engine.tasks.recorded(found.task.id, found.scope)
            if again.owner != found.owner or taskops.is_final(again.task):
                return await self._take_if_free(again)
            delay = min(delay * 2, HANDOVER_MOST)
        raise ServerShuttingDownError(
            "the task's instance is shutting down and did not hand it over in time; retry"
        )

    async def _take_if_free(self, found: RecordedTask) -> RecordedTask:
        """The task, claimed for this instance first if it waits owned by nobody.

        A waiting task is released when its owner shuts down or is lost; a
        follow-up or a cancel through any instance claims it (compare-and-set)
        and runs it there. Lost to another instance's claim, the task is read
        again: the caller then routes to the winner.
        """
        if found.owner or not self._engine.accepting:
            return found
        if found.task.status.state not in taskops.INTERRUPTED:
            return found
        claimed = await self._peers.claim(found)
        if claimed is None:
            return await self._engine.tasks.recorded(found.task.id, found.scope)
        self._engine.tasks.metrics.tasks_claimed += 1
        return claimed

    async def read(self, task_id: str, scope: str, *, resumable: bool = False) -> tuple[Task, int]:
        """``TaskEngine.read`` (the shared record answers for every instance)."""
        return await self._engine.read(task_id, scope, resumable=resumable)

    async def subscribe(
        self, task_id: str, scope: str, *, resumable: bool = False
    ) -> tuple[Task, LogReader]:
        """``TaskEngine.subscribe``; a task another instance runs is joined through its relay.

        Raises:
            As ``TaskEngine.subscribe``, and RelayLostError: this instance is leaving.
        """
        engine = self._engine
        found = await engine.tasks.recorded(task_id, scope)
        if taskops.is_final(found.task) or engine.tasks.revivable(found) is not None:
            return await engine.subscribe(task_id, scope, resumable=resumable, found=found)
        relayed, reader = await self._peers.subscribe(found)
        try:
            engine.tasks.quotas.check_subscribers(reader.followers - 1)
        except BaseException:
            reader.close()
            raise
        return relayed, reader

    async def watch(self, task_id: str, scope: str, after: int) -> LogReader | None:
        """``TaskEngine.watch``; a task another instance runs is watched through its relay.

        The relay's reader is passive (``Peers.subscribe``): the poll holds a
        poll slot (``Quotas.long_poll``), never a subscriber's place.

        Raises:
            As ``TaskEngine.watch``, and RelayLostError: this instance is leaving.
        """
        engine = self._engine
        found = await engine.tasks.recorded(task_id, scope)
        if taskops.is_final(found.task) or engine.tasks.revivable(found) is not None:
            return await engine.watch(task_id, scope, after, found)
        try:
            _, reader = await self._peers.subscribe(found, passive=True)
        except UnsupportedOperationError:
            return None  # it ended meanwhile
        if reader.next_seq - 1 > after:
            reader.close()
            return None
        return reader

    async def resume(self, task_id: str, after: int, scope: str) -> LogReader:
        """``TaskEngine.resume``, reading the shared record for what this instance does not keep."""
        return await self._engine.resume(task_id, after, scope, replay=self._peers.replay)

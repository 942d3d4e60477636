"""Relays: on an instance that does not run a task, one channel per task fed from the log.

Who runs what: a gRPC handler calls ``Relays.subscribe``; the first one for a
task creates its ``Relay`` and starts it (tail, snapshot, follow — see
``events``), later ones wait for that start and join the same channel. The
JetStream subscription's callback (nats-py runs it in its own task, one
message at a time) applies each frame to the relay's snapshot and publishes
it to the channel, so relayed subscribers get the owner's frames in the
owner's order, through the same ``TaskChannel`` and close rule as local ones.

Who closes what: a final frame closes the channel (``TaskChannel.close``);
when the last subscriber leaves, the relay stops (the task goes on
elsewhere); at shutdown every relay is severed with ``RelayLostError``. In
each case the JetStream subscription is removed by a cleanup task that
``wait_closed`` waits for.
"""

from __future__ import annotations

import asyncio
import logging

from a2a.types.a2a_pb2 import StreamResponse, Task, TaskState
from a2a.utils.errors import TaskNotFoundError, UnsupportedOperationError
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from .. import taskops
from ..channel import ChannelClosedError, Subscription, TaskChannel
from ..errors import RelayLostError
from ..metrics import Metrics
from ..store.nats import NatsTaskStore
from ..supervisor import TASK_PREFIX
from .events import FRAME, KIND, SNAPSHOT, VERSION, NatsEventLog, is_final_frame

logger = logging.getLogger(__name__)


class Relay:
    """Feeds one task's channel on this instance from the event log.

    Args:
        task_id: The task.
        channel: The channel it feeds.
    """

    def __init__(self, task_id: str, channel: TaskChannel) -> None:
        self.task_id = task_id
        self.channel = channel
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.subscription: JetStreamContext.PushSubscription | None = None
        self._task: Task | None = None
        self._index: taskops.ArtifactIndex = {}
        self._version = 0

    async def start(self, log: NatsEventLog, store: NatsTaskStore) -> None:
        """Read the snapshot and follow the log from it (no gap, no duplicate).

        Raises:
            TaskNotFoundError: The task is gone.
            UnsupportedOperationError: The task has ended.
        """
        tail = await log.tail(self.task_id)
        stored = await store.get(self.task_id)
        if stored is None:
            raise TaskNotFoundError(f"task {self.task_id!r} not found")
        if taskops.is_final(stored.task):
            raise _ended(stored.task)
        self._task, self._version = stored.task, stored.version
        self._index = taskops.index_artifacts(stored.task)
        self.channel.set_snapshot(stored.task)
        self.subscription = await log.follow(self.task_id, tail, self._deliver)

    async def _deliver(self, msg: Msg) -> None:
        if self.channel.closed or self._task is None:
            return
        headers = msg.headers or {}
        version = int(headers.get(VERSION, "0"))
        kind = headers.get(KIND, FRAME)
        if kind == SNAPSHOT:
            if version > self._version:
                self._replace(Task.FromString(msg.data), version)
                self.channel.set_snapshot(self._task)
            return
        frame = StreamResponse.FromString(msg.data)
        final = is_final_frame(frame)
        if version <= self._version and not final:
            return  # already in the snapshot this relay started from
        self._version = max(version, self._version)
        try:
            self._apply(frame)
        except Exception:  # a frame the owner accepted: only a bug of ours gets here
            logger.exception("relay of task %s could not apply a frame", self.task_id)
        self.channel.publish(frame, self._task, final=final)
        if final:
            self.channel.close()

    def _apply(self, frame: StreamResponse) -> None:
        assert self._task is not None
        kind = frame.WhichOneof("payload")
        if kind == "task":
            self._replace(taskops.copy(frame.task), self._version)
        elif kind == "status_update":
            taskops.apply(self._task, frame.status_update, self._index)
        elif kind == "artifact_update":
            taskops.apply(self._task, frame.artifact_update, self._index)
        elif kind == "message":
            taskops.apply(self._task, frame.message, self._index)

    def _replace(self, task: Task, version: int) -> None:
        self._task, self._version = task, version
        self._index = taskops.index_artifacts(task)


def _ended(task: Task) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"task {task.id!r} is {TaskState.Name(task.status.state)}; "
        "a terminal task cannot be subscribed to (use GetTask)"
    )


class Relays:
    """This instance's relays, at most one per task.

    Args:
        log: The event log.
        store: The task store.
        capacity: Frames buffered per subscriber.
        metrics: Where the channels count what they do.
    """

    def __init__(
        self, log: NatsEventLog, store: NatsTaskStore, capacity: int, metrics: Metrics
    ) -> None:
        self._log = log
        self._store = store
        self._capacity = capacity
        self._metrics = metrics
        self._relays: dict[str, Relay] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._severed: str | None = None

    def __len__(self) -> int:
        return len(self._relays)

    async def subscribe(self, task_id: str) -> tuple[Task, Subscription]:
        """Join the relay of ``task_id``, starting it if this instance has none.

        Returns:
            The snapshot and a subscription to every frame after it.

        Raises:
            TaskNotFoundError: The task is gone.
            UnsupportedOperationError: The task has ended.
            StoreUnavailableError: NATS did not answer.
            RelayLostError: This instance is shutting down.
        """
        while True:
            if self._severed is not None:
                raise RelayLostError(self._severed)
            relay = self._relays.get(task_id)
            if relay is None:
                relay = self._create(task_id)
            await asyncio.shield(relay.started)
            try:
                snapshot, sub = relay.channel.subscribe()
            except ChannelClosedError:
                final = relay.channel.snapshot
                if final is not None and taskops.is_final(final):
                    raise _ended(final) from None
                continue  # it stopped as we arrived (its last subscriber left): start anew
            assert snapshot is not None
            return snapshot, sub

    def sever_all(self, why: str) -> None:
        """End every relayed subscription with ``RelayLostError(why)``; relay no more."""
        self._severed = why
        for relay in list(self._relays.values()):
            relay.channel.sever(RelayLostError(why))

    async def wait_closed(self) -> None:
        """Wait until every relay that ended has removed its JetStream subscription."""
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    def _create(self, task_id: str) -> Relay:
        channel = TaskChannel(task_id, self._capacity, self._metrics, relayed=True)
        relay = Relay(task_id, channel)
        self._relays[task_id] = relay
        self._metrics.relays_open += 1
        channel.on_close(lambda: self._ended(relay))
        channel.on_idle = lambda: channel.sever(RelayLostError("no subscriber left"))
        starter = asyncio.create_task(
            self._start(relay), name=f"{TASK_PREFIX}:relay-start:{task_id}"
        )
        self._track(starter)
        return relay

    async def _start(self, relay: Relay) -> None:
        try:
            await relay.start(self._log, self._store)
        except Exception as exc:
            relay.started.set_exception(exc)
            relay.channel.sever(RelayLostError("relay could not start"))
        else:
            relay.started.set_result(None)

    def _ended(self, relay: Relay) -> None:
        self._metrics.relays_open -= 1
        if self._relays.get(relay.task_id) is relay:
            del self._relays[relay.task_id]
        self._track(asyncio.create_task(self._unsubscribe(relay), name=f"{TASK_PREFIX}:relay-end"))

    async def _unsubscribe(self, relay: Relay) -> None:
        if not relay.started.done():
            await asyncio.wait([relay.started])
        if relay.subscription is not None:
            try:
                await relay.subscription.unsubscribe()
            except Exception as exc:  # the connection may be closing: nothing left to do
                logger.debug("relay of %s: unsubscribe failed: %s", relay.task_id, exc)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

"""TaskChannel: the per-task broadcast every stream of a task reads from.

Who runs what: everything here is synchronous except ``Subscription.__anext__``
and ``TaskChannel.wait_changed``; all of it runs on the server's event loop.
The task's consumer (see ``supervisor``) is the only publisher; it publishes a
frame only after the store has accepted it ("persist, then broadcast").
Each gRPC stream handler owns one ``Subscription`` and is its only reader.

Who closes what:

* The channel is closed exactly when its task ends (or, for a message-only
  answer, when the answer is out). ``close(final)`` is idempotent and always,
  in this order: (1) puts the final frame into every subscriber's buffer,
  using the slot reserved for it, unless a final frame was already published;
  (2) marks the channel closed; (3) runs the close callbacks, which cancel
  the task's producer and consumer; (4) wakes the subscribers, which drain
  what is buffered and then see end-of-stream.
* A subscriber that falls a whole buffer behind is evicted: it drains what
  it has, then its stream ends with ``SlowSubscriberError``. The publisher
  never waits for a subscriber and siblings lose nothing.
* A subscriber whose client went away calls ``Subscription.close()``; the
  task and the other subscribers are unaffected. When the last subscriber
  leaves, the ``on_idle`` callback runs (a relay uses it to stop relaying).
* ``sever(error)`` is for a channel that is not the task's own: a relay of a
  task another instance runs (cluster mode). It ends every subscription with
  ``error`` once its buffer is drained; the task itself goes on elsewhere.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable

from a2a.types.a2a_pb2 import StreamResponse, Task, TaskState

from . import taskops
from .errors import SlowSubscriberError
from .metrics import Metrics

logger = logging.getLogger(__name__)


class ChannelClosedError(Exception):
    """The channel's task has ended; nothing can be published or subscribed."""


class EndReason(enum.Enum):
    """Why a subscription ended: each outcome has its own name."""

    FINISHED = "finished"
    """The channel closed and the subscriber drained every frame, final included."""
    EVICTED = "evicted"
    """The subscriber fell a whole buffer behind and was dropped."""
    DETACHED = "detached"
    """The subscriber left on its own (its client disconnected)."""
    SEVERED = "severed"
    """This instance stopped relaying the task (it goes on elsewhere)."""


class Subscription:
    """One reader's bounded view of a channel.

    Iterate it with ``async for``; iteration stops after the final frame, or
    raises ``SlowSubscriberError`` once the buffered frames of an evicted
    subscriber are drained.
    """

    __slots__ = ("_buffer", "_capacity", "_channel", "_end", "_waiter")

    def __init__(self, channel: TaskChannel, capacity: int) -> None:
        self._channel = channel
        self._capacity = capacity
        self._buffer: deque[StreamResponse] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._end: EndReason | None = None

    @property
    def task_id(self) -> str:
        """The task this subscription follows."""
        return self._channel.task_id

    @property
    def end_reason(self) -> EndReason | None:
        """Why the subscription ended, or None while it is live."""
        return self._end

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> StreamResponse:
        """Return the next frame, waiting for one if none is buffered.

        Raises:
            StopAsyncIteration: The channel closed and every frame was read.
            SlowSubscriberError: This subscriber was evicted for falling behind.
        """
        while not self._buffer:
            if self._end is EndReason.EVICTED:
                raise SlowSubscriberError(self.eviction_message())
            if self._end is EndReason.SEVERED:
                assert self._channel._severed is not None
                raise self._channel._severed
            if self._end is not None:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._buffer.popleft()

    def eviction_message(self) -> str:
        """What an evicted subscriber is told, for a person to act on."""
        return (
            f"stream of task {self._channel.task_id} fell {self._capacity} frames behind and was "
            "dropped; read faster, or resubscribe with SubscribeToTask"
        )

    def close(self) -> None:
        """Detach from the channel (the reader is gone). Idempotent."""
        if self._end is None:
            self._end = EndReason.DETACHED
        self._channel._discard(self)
        self._buffer.clear()
        self._wake()

    def _offer(self, frame: StreamResponse) -> int:
        """Buffer ``frame`` (or evict this slow subscriber); return the frames waiting."""
        # The last slot is reserved for the final frame.
        if len(self._buffer) >= self._capacity - 1:
            self._evict()
            return 0
        self._buffer.append(frame)
        self._wake()
        return len(self._buffer)

    def _offer_final(self, frame: StreamResponse) -> None:
        self._buffer.append(frame)
        self._wake()

    def _finish(self, reason: EndReason = EndReason.FINISHED) -> None:
        if self._end is None:
            self._end = reason
        self._wake()

    def _evict(self) -> None:
        self._end = EndReason.EVICTED
        self._channel._discard(self)
        self._channel.metrics.evictions += 1
        logger.warning(
            "evicted a slow subscriber of task %s (%d frames behind)",
            self._channel.task_id,
            len(self._buffer),
        )
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class TaskChannel:
    """Per-task broadcast with bounded subscriber buffers.

    Args:
        task_id: The task this channel carries.
        capacity: Frames buffered per subscriber, the final frame's slot included.
        metrics: Where evictions, final frames and task ends are counted.
        relayed: The channel relays a task another instance runs; its end is
            not counted as a task ended here.
    """

    __slots__ = (
        "_backlog",
        "_capacity",
        "_changed",
        "_close_callbacks",
        "_closed",
        "_final_published",
        "_relayed",
        "_seq",
        "_severed",
        "_snapshot",
        "_subscribers",
        "metrics",
        "on_idle",
        "task_id",
    )

    def __init__(
        self,
        task_id: str,
        capacity: int,
        metrics: Metrics | None = None,
        *,
        relayed: bool = False,
    ) -> None:
        self.task_id = task_id
        self._capacity = capacity
        # A dict as an ordered set: empty, it costs a quarter of an empty set.
        self._subscribers: dict[Subscription, None] = {}
        self._snapshot: Task | None = None
        self._seq = 0
        self._backlog = 0
        self._closed = False
        self._final_published = False
        # Made only when someone waits: a parked task with no waiter pays nothing.
        self._changed: asyncio.Event | None = None
        self._close_callbacks: list[Callable[[], None]] = []
        self._severed: Exception | None = None
        self.on_idle: Callable[[], None] | None = None
        """Called when the last subscriber leaves an open channel."""
        self.metrics = metrics or Metrics()
        self._relayed = relayed

    @property
    def closed(self) -> bool:
        """Whether the channel's task has ended."""
        return self._closed

    @property
    def snapshot(self) -> Task | None:
        """The task as last published (None before the task exists). Do not mutate."""
        return self._snapshot

    @property
    def backlog(self) -> int:
        """The most frames any subscriber had waiting right after the last publish."""
        return self._backlog if self._subscribers else 0

    @property
    def seq(self) -> int:
        """How many frames were published so far."""
        return self._seq

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the channel closes (step 3 of ``close``)."""
        if self._closed:
            callback()
        else:
            self._close_callbacks.append(callback)

    def remove_on_close(self, callback: Callable[[], None]) -> None:
        """Forget a callback registered with ``on_close`` (no error if absent)."""
        if callback in self._close_callbacks:
            self._close_callbacks.remove(callback)

    def subscribe(self) -> tuple[Task | None, Subscription]:
        """Join the broadcast.

        Returns:
            The current task snapshot (a copy; None if the task does not exist
            yet) and a subscription that yields every frame published after
            it, with no gap and no duplicate between the two.

        Raises:
            ChannelClosedError: The task has already ended.
        """
        if self._closed:
            raise ChannelClosedError(self.task_id)
        sub = Subscription(self, self._capacity)
        self._subscribers[sub] = None
        if self._snapshot is None:
            return None, sub
        return taskops.copy(self._snapshot), sub

    def publish(self, frame: StreamResponse, snapshot: Task | None, *, final: bool = False) -> None:
        """Send ``frame`` to every subscriber; call only after it was persisted.

        Args:
            frame: The frame to broadcast.
            snapshot: The task after the frame was applied (None for a
                message-only answer).
            final: Whether this frame ends the task (it uses the reserved slot).

        Raises:
            ChannelClosedError: The task has already ended.
        """
        if self._closed:
            raise ChannelClosedError(self.task_id)
        self._seq += 1
        if snapshot is not None:
            self._snapshot = snapshot
        if final:
            self._final_published = True
            self.metrics.final_frames += len(self._subscribers)
            for sub in self._subscribers:
                sub._offer_final(frame)
        else:
            backlog = 0
            for sub in tuple(self._subscribers):
                backlog = max(backlog, sub._offer(frame))
            self._backlog = backlog
        self._signal_changed()

    def close(self, final: StreamResponse | None = None, snapshot: Task | None = None) -> None:
        """End the broadcast; idempotent. See the module docstring for the order.

        Args:
            final: The final frame, put into every buffer unless a final frame
                was already published.
            snapshot: The task as the final frame leaves it.
        """
        if self._closed:
            return
        if final is not None and not self._final_published:
            self._final_published = True
            self._seq += 1
            self.metrics.final_frames += len(self._subscribers)
            for sub in self._subscribers:
                sub._offer_final(final)
        if snapshot is not None:
            self._snapshot = snapshot
        self._closed = True
        ended = self._snapshot
        if not self._relayed:
            state = TaskState.Name(ended.status.state) if ended else "MESSAGE"
            self.metrics.tasks_ended[state] += 1
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback()
        for sub in self._subscribers:
            sub._finish()
        self._subscribers.clear()
        self._signal_changed()

    def sever(self, error: Exception) -> None:
        """Stop carrying a task this channel only relays; idempotent, no final frame.

        Subscribers drain what is buffered, then their iteration raises ``error``.
        Close callbacks run as for ``close``.
        """
        if self._closed:
            return
        self._closed = True
        self._severed = error
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback()
        for sub in self._subscribers:
            sub._finish(EndReason.SEVERED)
        self._subscribers.clear()
        self._signal_changed()

    def _discard(self, sub: Subscription) -> None:
        if sub not in self._subscribers:
            return
        self._subscribers.pop(sub, None)
        if not self._subscribers and not self._closed and self.on_idle is not None:
            self.on_idle()

    def set_snapshot(self, snapshot: Task) -> None:
        """Replace the snapshot without a frame (a follow-up message was recorded)."""
        self._snapshot = snapshot
        self._signal_changed()

    def notify(self) -> None:
        """Wake ``wait_changed`` callers without publishing (e.g. a run ended)."""
        self._signal_changed()

    async def wait_changed(self) -> None:
        """Wait until the next publish or close."""
        if self._closed:
            return
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    def _signal_changed(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

"""The event log on JetStream: one subject per task, one message per frame.

Each message carries headers ``A2a-Seq`` (its position in the task's log: 1,
2, 3, … with no gap), ``A2a-Version`` (the task version the frame was
persisted at; versions only grow within a task, with gaps) and ``A2a-Kind``
(``frame``, or ``snapshot`` for a change without a frame, whose payload is
the whole task). ``Nats-Msg-Id`` (task id and seq) makes a retried append a
no-op within JetStream's duplicate window.

Who runs what: the owner's consumer calls ``append`` under the task's lock,
so appends of one task are in version order. A relay calls ``tail`` before it
reads the task's snapshot, then ``follow`` from just after that tail: every
frame persisted after the snapshot was appended after the tail, so nothing
is missed, and frames at or below the snapshot's version are skipped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import nats.js.errors
from a2a.types.a2a_pb2 import StreamResponse, Task
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from ..store.nats import retrying
from .natsconn import EVENTS_STREAM, EVENTS_SUBJECT

SEQ = "A2a-Seq"
VERSION = "A2a-Version"
KIND = "A2a-Kind"
FRAME = "frame"
SNAPSHOT = "snapshot"
IDLE_HEARTBEAT = 1.0
"""Seconds between JetStream heartbeats of a relay's consumer (how soon a lost one is noticed)."""


def subject(task_id: str) -> str:
    """The subject that carries ``task_id``'s frames."""
    return f"{EVENTS_SUBJECT}.{task_id}"


class NatsEventLog:
    """``EventLog`` on the ``A2A_EVENTS`` stream.

    Args:
        js: The JetStream context.
    """

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js

    async def append(
        self, task_id: str, seq: int, version: int, frame: StreamResponse | None, snapshot: Task
    ) -> None:
        """Append a frame (or a snapshot-only change) persisted at ``version``.

        Raises:
            StoreUnavailableError: JetStream did not take it within the retry budget.
        """
        kind = FRAME if frame is not None else SNAPSHOT
        payload = (frame if frame is not None else snapshot).SerializeToString()
        headers = {
            SEQ: str(seq),
            VERSION: str(version),
            KIND: kind,
            "Nats-Msg-Id": f"{task_id}:{seq}",
        }
        await retrying(
            lambda: self._js.publish(subject(task_id), payload, headers=headers),
            f"append a frame of task {task_id}",
        )

    async def tail(self, task_id: str) -> int:
        """The stream sequence of the task's last entry (0 if it has none).

        Raises:
            StoreUnavailableError: JetStream did not answer.
        """
        return (await self._last(task_id))[0]

    async def last_seq(self, task_id: str) -> int:
        """The ``A2a-Seq`` of the task's last entry (0 if it has none).

        Raises:
            StoreUnavailableError: JetStream did not answer.
        """
        return (await self._last(task_id))[1]

    async def _last(self, task_id: str) -> tuple[int, int]:
        async def last() -> tuple[int, int]:
            try:
                msg = await self._js.get_last_msg(EVENTS_STREAM, subject(task_id))
            except nats.js.errors.NotFoundError:
                return 0, 0
            return int(msg.seq or 0), int((msg.headers or {}).get(SEQ, "0"))

        return await retrying(last, f"find the last frame of task {task_id}")

    async def follow(
        self, task_id: str, after: int, handle: Callable[[Msg], Awaitable[None]]
    ) -> JetStreamContext.PushSubscription:
        """Deliver every frame of the task after stream sequence ``after`` to ``handle``.

        An ordered consumer: in order, and recreated from the last delivered
        sequence if the server serving it is lost.

        Raises:
            StoreUnavailableError: JetStream did not answer.
        """
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if after else api.DeliverPolicy.ALL,
            opt_start_seq=after + 1 if after else None,
        )
        return await retrying(
            lambda: self._js.subscribe(
                subject(task_id),
                stream=EVENTS_STREAM,
                cb=handle,
                ordered_consumer=True,
                idle_heartbeat=IDLE_HEARTBEAT,
                config=config,
            ),
            f"follow task {task_id}",
        )


def is_final_frame(frame: StreamResponse) -> bool:
    """Whether ``frame`` ends its task."""
    from .. import taskops

    kind = frame.WhichOneof("payload")
    if kind == "status_update":
        return taskops.is_final_state(frame.status_update.status.state)
    if kind == "task":
        return taskops.is_final(frame.task)
    return False

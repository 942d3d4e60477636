"""Ownership leases: instances heartbeat; survivors end a lost owner's tasks FAILED.

Who runs what: ``start`` writes this instance's first heartbeat (before it
serves anything), subscribes to the instances bucket (nats-py runs the
callback, which only records when each instance was last heard from), and
runs one asyncio task: the heartbeat loop, a put to ``A2A_INSTANCES/<id>``
every ``lease / 4`` seconds that also judges the others and sweeps.

An instance not heard from for ``lease`` seconds, or whose key was deleted
(graceful shutdown), is lost, but only while this instance's own heartbeats
have succeeded for a whole lease: when NATS itself fails over, every
instance misses heartbeats, and none judges the others until it has been
healthy for a lease again. Every survivor then sweeps the task bucket:
each task that is not final and whose owner is not live is compare-and-set
to FAILED ("owner instance lost"); the CAS lets exactly one survivor win per
task, and the winner appends the FAILED frame to the event log, so every
relayed subscriber ends with it. One sweep also runs ``lease`` seconds after
start (every live instance has been heard from by then), for owners that
died while no survivor was watching.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors
import nats.js.errors
from a2a.types.a2a_pb2 import TaskState
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from .. import taskops
from ..metrics import Metrics
from ..store import FinalTaskError, StoredTask, StoreError, UnknownTaskError, VersionConflictError
from ..store.nats import NatsTaskStore
from ..supervisor import TASK_PREFIX
from .events import NatsEventLog
from .natsconn import INSTANCES_BUCKET, NatsConnection

logger = logging.getLogger(__name__)

DELETED = ("DEL", "PURGE")


async def stop_task(task: asyncio.Task[None], within: float) -> None:
    """Let ``task`` end on its own for ``within`` seconds, then cancel it until it ends.

    Cancelled more than once on purpose: Python 3.11's ``asyncio.wait_for``
    (used inside nats-py's requests) can swallow a cancellation that arrives
    as its inner call completes, and a loop would then run on.
    """
    await asyncio.wait([task], timeout=within)
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
    if not task.cancelled() and task.exception() is not None:
        logger.error("lease task failed", exc_info=task.exception())


class Lease:
    """This instance's heartbeat, and the reaper of lost instances' tasks.

    Args:
        conn: The NATS connection.
        store: The task store (writes as this instance).
        log: The event log.
        metrics: Where reaped tasks are counted.
    """

    def __init__(
        self, conn: NatsConnection, store: NatsTaskStore, log: NatsEventLog, metrics: Metrics
    ) -> None:
        self._kv = conn.instances
        self._id = conn.config.instance_id
        self._lease = conn.config.lease
        self._store = store
        self._log = log
        self._metrics = metrics
        self._seen: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._watch: JetStreamContext.PushSubscription | None = None
        self._js = conn.js
        self._sweep_requested = False
        self._healthy_since: float | None = None
        self._swept_at_start = False

    def live(self) -> set[str]:
        """Instances heard from within the lease (this one included)."""
        now = asyncio.get_running_loop().time()
        return {i for i, t in self._seen.items() if now - t <= self._lease} | {self._id}

    async def start(self) -> None:
        """Heartbeat, end what an earlier process with this id left, watch the others.

        Tasks still owned by this instance's id when it starts were left by a
        process that had the same ``--instance-id`` and died: they end FAILED.

        Raises:
            StoreError: The store could not be read.
        """
        await self._kv.put(self._id, b"")
        for stored in await self._store.unfinished():
            # Nothing runs here yet: a task this id owns was left by a process
            # that had the same --instance-id and died.
            if stored.owner == self._id:
                await self._claim(stored, f"instance {self._id} restarted")
        self._watch = await self._js.subscribe(
            f"$KV.{INSTANCES_BUCKET}.>",
            stream=f"KV_{INSTANCES_BUCKET}",
            cb=self._heard,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            idle_heartbeat=1.0,
        )
        self._task = asyncio.create_task(self._heartbeat(), name=f"{TASK_PREFIX}:lease")

    async def stop(self, *, release: bool) -> None:
        """Stop heartbeating; with ``release`` delete the key so survivors act at once."""
        if self._task is not None:
            self._stopping.set()
            await stop_task(self._task, within=self._lease)
            self._task = None
        if self._watch is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._watch.unsubscribe()
            self._watch = None
        if release:
            try:
                await self._kv.delete(self._id)
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                logger.warning("could not release this instance's lease: %s", exc)

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            try:
                await self._kv.put(self._id, b"")
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                logger.warning("heartbeat failed: %s", type(exc).__name__)
                self._healthy_since = None
            else:
                if self._healthy_since is None:
                    self._healthy_since = loop.time()
            now = loop.time()
            healthy = self._healthy_since is not None and now - self._healthy_since >= self._lease
            lost = [i for i, t in self._seen.items() if healthy and now - t > self._lease]
            for instance in lost:
                del self._seen[instance]
                logger.warning("instance %s lost (no heartbeat for %.1f s)", instance, self._lease)
            due = healthy and not self._swept_at_start
            if lost or due or self._sweep_requested:
                self._swept_at_start = self._swept_at_start or due
                self._sweep_requested = False
                await self._sweep_logged()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._lease / 4):  # the heartbeat period
                    await self._stopping.wait()

    async def _heard(self, msg: Msg) -> None:
        key = msg.subject.rsplit(".", 1)[-1]
        if key == self._id:
            return
        op = (msg.headers or {}).get("KV-Operation")
        if op in DELETED:
            if self._seen.pop(key, None) is not None:
                logger.info("instance %s released its lease", key)
                self._sweep_requested = True
        else:
            self._seen[key] = asyncio.get_running_loop().time()

    async def _sweep_logged(self) -> None:
        try:
            await self.sweep()
        except StoreError as exc:
            logger.warning("lease sweep failed: %s", exc)

    async def sweep(self) -> int:
        """End FAILED every live-looking task whose owner is lost; return how many this won.

        Raises:
            StoreError: The store could not be read.
        """
        live = self.live()
        won = 0
        for stored in await self._store.unfinished():
            if taskops.is_final(stored.task) or stored.owner in live or not stored.owner:
                continue
            won += await self._claim(stored, f"owner instance {stored.owner} was lost")
        return won

    async def _claim(self, stored: StoredTask, text: str) -> int:
        task = taskops.copy(stored.task)
        frame = taskops.apply(task, taskops.status_event(task, TaskState.TASK_STATE_FAILED, text))
        try:
            version = await self._store.update(task, stored.version)
        except (VersionConflictError, FinalTaskError, UnknownTaskError):
            return 0  # another survivor won, or the owner wrote after all
        seq = await self._log.last_seq(task.id) + 1
        await self._log.append(task.id, seq, version, frame, task)
        self._metrics.tasks_reaped += 1
        logger.warning("task %s ended FAILED: %s", task.id, text)
        return 1

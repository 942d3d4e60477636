"""Ownership leases: instances heartbeat; survivors end a lost owner's running tasks FAILED.

Who runs what: ``start`` writes this instance's first heartbeat (before it
serves anything), subscribes to the instances bucket (nats-py runs the
callback, which only records when each instance was last heard from), and
runs one asyncio task: the heartbeat loop, a put to ``A2A_INSTANCES/<id>``
every ``lease / 4`` seconds that also judges the others. A sweep runs in an
asyncio task of its own (one at a time; one asked for meanwhile runs next),
so a long sweep never delays a heartbeat; it reads ``SWEEP_BATCH`` tasks
at a time and claims at most ``CLAIM_CONCURRENCY`` of them at once.

The ownership rule (docs/explanation/cluster.md): an instance not heard from
for ``lease`` seconds, or whose key was deleted (graceful shutdown), is
lost, but only on evidence that survives an outage:

* this instance judges nobody until it has been *in touch* with the cluster
  for a whole lease. It is out of touch from any failed heartbeat, any
  heartbeat that took longer than half a lease (a write that waited out an
  outage in the client's reconnect buffer), any disconnect or reconnect of
  its NATS connection, and any stall of its own event loop longer than half
  a lease (the process was paused); in touch again from the first prompt
  heartbeat after that. A NATS outage every instance saw thus ends nobody's
  tasks, however long it lasted, when they come back within a lease of each
  other: after it, every instance hears the others' heartbeats for a lease
  before it could judge them;
* an instance whose last heartbeat is older than the lease is read once
  more, directly from the bucket, before it is judged: a revision newer
  than the last one heard means it is alive (the watch fell behind), and
  it keeps its tasks; a read that does not answer judges nobody that round;
* a sweep that could not claim a task runs again at the next heartbeat, and
  checks before each claim that the owner is still unheard of.

Every survivor then sweeps the snapshots: each
task that is not final and whose owner is not live gets a FAILED change
("owner instance lost") appended to its record with the journal's
compare-and-set, which lets exactly one survivor win per task; every relayed
reader ends with that frame. A task that waits for input (nothing runs for
it) is released instead: recorded as owned by nobody, it goes on when its
next message comes, through whichever instance takes it (``Peers.claim``).
A task whose record already ended but whose snapshot was not written gets
its snapshot (the owner died in between).
One sweep also runs ``lease`` seconds after start (every live instance has
been heard from by then), for owners that died while no survivor watched.
After each sweep ``on_swept`` runs with the live instances: the cluster
adopts the push deliveries the lost ones had not finished (see
``NatsCluster._adopt_push``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

import nats.errors
import nats.js.errors
from a2a.types.a2a_pb2 import TaskState
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from ..journal import (
    Change,
    FinalTaskError,
    Released,
    StoreError,
    UnknownTaskError,
    VersionConflictError,
)
from ..model import taskops
from ..model.names import TASK_PREFIX
from ..obs.metrics import Metrics
from .conn import INSTANCES_BUCKET, NatsConnection
from .formats import CURRENT, Formats, heartbeat
from .journal import SWEEP_BATCH
from .store import ClusterJournal

logger = logging.getLogger(__name__.replace("._internal", ""))

DELETED = ("DEL", "PURGE")
FORGET_LEASES = 10
"""Leases after which an instance taken for lost no longer holds back a newer format."""
CLAIM_CONCURRENCY = 16
"""Tasks one sweep claims at once (each a read and a compare-and-set write)."""


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
        journal: The shared record (writes as this instance).
        metrics: Where reaped tasks are counted.
        on_gap: Run (in a task of its own) when a heartbeat succeeds after none
            did for longer than the lease: survivors may have ended this
            instance's tasks meanwhile.
    """

    def __init__(
        self,
        conn: NatsConnection,
        journal: ClusterJournal,
        metrics: Metrics,
        on_gap: Callable[[], Awaitable[object]] | None = None,
        on_swept: Callable[[set[str]], Awaitable[None]] | None = None,
        formats: Formats | None = None,
    ) -> None:
        self._formats = formats or Formats()
        self._kv = conn.instances
        self._id = conn.config.instance_id
        self._lease = conn.config.lease
        self._journal = journal
        self._metrics = metrics
        self._lost_at: dict[str, float] = {}
        """When each instance taken for lost was judged (until it is heard again or forgotten)."""
        self._seen: dict[str, tuple[float, int]] = {}
        """When each other instance was last heard from, and its key's revision then."""
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._watch: JetStreamContext.PushSubscription | None = None
        self._js = conn.js
        self._nc = conn.nc
        self._sweep_requested = False
        self._sweeping: asyncio.Task[None] | None = None
        self._on_gap = on_gap
        self._on_swept = on_swept
        self._last_beat: float | None = None
        self._recheck_due = False
        """A recheck after a gap failed: it runs again after the next heartbeat."""
        self._rechecking: asyncio.Task[None] | None = None
        self._indexing: asyncio.Task[None] | None = None
        self._healthy_since: float | None = None
        """Since when this instance has been in touch (None: out of touch now)."""
        self._reconnects = 0
        self._last_tick: float | None = None
        self._reading_all = asyncio.Lock()
        self._read_all = False
        """Whether ``read_all_heartbeats`` has read (or tried to) already."""
        """Held by ``read_all_heartbeats`` (a shutdown's releases ask for it at once)."""
        self._swept_at_start = False

    def live(self) -> set[str]:
        """Instances not judged lost by the rule in the module docstring (this one included)."""
        return set(self._seen) | {self._id}

    @property
    def in_touch_for(self) -> float:
        """Seconds this instance has been in touch with the cluster (0 while it is not)."""
        if self._healthy_since is None:
            return 0.0
        return asyncio.get_running_loop().time() - self._healthy_since

    async def start(self) -> None:
        """Heartbeat, end what an earlier process with this id left, watch the others.

        Tasks still owned by this instance's id when it starts were left by a
        process that had the same ``--instance-id`` and died: they end FAILED.

        Raises:
            StoreError: The journal could not be read.
        """
        await self._kv.put(self._id, heartbeat())
        async with contextlib.aclosing(
            self._unfinished_batches(lambda owner: owner == self._id)
        ) as batches:
            async for batch in batches:
                for owner, task_id in batch:
                    # Nothing runs here yet: a task this id owns was left by a
                    # process that had the same --instance-id and died.
                    if owner == self._id:
                        await self._claim(task_id, self._id, f"instance {self._id} restarted")
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
        for task in (self._sweeping, self._rechecking, self._indexing):
            if task is not None:
                await stop_task(task, within=0)
        self._sweeping = self._rechecking = self._indexing = None
        if self._watch is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._watch.unsubscribe()
            self._watch = None
        if release:
            try:
                await self._kv.delete(self._id)
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                logger.warning("could not release this instance's lease: %s", exc)

    async def read_all_heartbeats(self) -> None:
        """Read every heartbeat in the bucket now, as a lease of listening would hear them.

        For a shutdown within this instance's first lease: it has not yet
        heard every instance (``formats``), so it writes format 1 and would
        release no waiting task. One read of every key tells it what each live
        instance reads. A read that fails, or takes longer than a quarter of
        the lease, changes nothing (the waiting tasks then end FAILED). Read
        once per process: the releases of one shutdown share the first read.
        """
        async with self._reading_all:
            if self._formats.writing >= CURRENT or self._read_all:
                return
            self._read_all = True
            heard: dict[str, bytes] = {}
            try:
                async with asyncio.timeout(self._lease / 4):
                    watcher = await self._kv.watchall(ignore_deletes=True)
                    try:
                        async for entry in watcher:
                            if entry is None:
                                break  # (every key's latest value was delivered)
                            heard[entry.key] = entry.value or b""
                    finally:
                        await watcher.stop()
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                logger.warning("could not read every heartbeat: %s", type(exc).__name__)
                return
            for instance, value in heard.items():
                if instance != self._id:
                    self._formats.heard(instance, value)
            self._formats.settle()

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        period = self._lease / 4
        slow = self._lease / 2  # (a heartbeat or a stall longer than this: out of touch)
        while not self._stopping.is_set():
            began = loop.time()
            if self._last_tick is not None and began - self._last_tick > slow:
                # This loop did not run for a while (the process was paused, or the
                # event loop stalled): whatever it saw before is stale.
                self._lose_touch(f"this instance did not run for {began - self._last_tick:.1f} s")
            try:
                # Bounded: a put whose answer was lost in a reconnect would otherwise
                # wait out JetStream's request timeout (seconds past the lease) while
                # the connection is already back and the next heartbeat would land.
                async with asyncio.timeout(slow):
                    await self._kv.put(self._id, heartbeat())
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                logger.warning("heartbeat failed: %s", type(exc).__name__)
                self._lose_touch(None)
            else:
                now = loop.time()
                reconnects = self._connection_changes()
                if now - began > slow:
                    self._lose_touch(f"a heartbeat took {now - began:.1f} s")
                elif reconnects != self._reconnects:
                    self._lose_touch("the NATS connection was re-established")
                elif self._healthy_since is None:
                    self._healthy_since = now
                self._reconnects = reconnects
                self._after_beat(began, now)
            lost = await self._judge()
            self._forget_long_lost(loop.time())
            due = self._judging() and not self._swept_at_start
            if self._judging():
                self._formats.settle()  # (a lease in touch: every live instance was heard)
            if (lost or due or self._sweep_requested) and not self._sweep_running():
                self._swept_at_start = self._swept_at_start or due
                self._sweep_requested = False
                self._sweeping = asyncio.create_task(
                    self._sweep_logged(), name=f"{TASK_PREFIX}:lease-sweep"
                )
            elif lost:
                self._sweep_requested = True  # after the one running
            if (
                self._judging()
                and self._journal.listing.index_due()
                and not self._indexing_running()
            ):
                self._indexing = asyncio.create_task(
                    self._keep_index(), name=f"{TASK_PREFIX}:lease-index"
                )
            self._last_tick = loop.time()  # (the wait below takes a period unless stalled)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period):
                    await self._stopping.wait()

    def _forget_long_lost(self, now: float) -> None:
        """Stop writing for instances lost ``FORGET_LEASES`` leases ago (see ``formats``).

        One only taken for lost may come back, so the formats it reads still
        count for a while; one silent that long is gone (its key is not deleted
        when it dies, and expires only after ``INSTANCES_TTL``).
        """
        for instance, since in list(self._lost_at.items()):
            if now - since > FORGET_LEASES * self._lease:
                del self._lost_at[instance]
                self._formats.gone(instance)

    def _connection_changes(self) -> int:
        """How often the NATS connection was lost or re-established so far."""
        nc = self._nc
        stats = getattr(nc, "stats", {})
        return int(stats.get("reconnects", 0)) + (0 if nc.is_connected else 1)

    def _lose_touch(self, why: str | None) -> None:
        """This instance is out of touch: it judges nobody for a lease from the next beat."""
        if self._healthy_since is not None and why is not None:
            logger.warning(
                "out of touch with the cluster (%s): judging no instance for a lease", why
            )
        self._healthy_since = None
        self._formats.unsettle()

    def _judging(self) -> bool:
        """Whether this instance has been in touch for a whole lease (it may judge others)."""
        return self._healthy_since is not None and self.in_touch_for >= self._lease

    async def _judge(self) -> list[str]:
        """The instances lost since the last beat (forgotten from ``live`` as they go).

        One whose last heartbeat is older than the lease is read again from the
        bucket first: a newer revision than the one last heard keeps it.
        """
        if not self._judging():
            return []
        loop = asyncio.get_running_loop()
        suspects = {
            i: seen for i, seen in self._seen.items() if loop.time() - seen[0] > self._lease
        }
        if not suspects:
            return []
        try:
            async with asyncio.timeout(self._lease / 4):  # never holds up a heartbeat long
                entries = await asyncio.gather(*(self._key(i) for i in suspects))
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            logger.warning(
                "could not read the heartbeats of %s: %s", ", ".join(suspects), type(exc).__name__
            )
            return []  # judged at a later beat (not lost on a read that did not answer)
        lost: list[str] = []
        for (instance, (heard, rev)), entry in zip(suspects.items(), entries, strict=True):
            if self._seen.get(instance, (None, 0))[0] != heard:
                continue  # heard from meanwhile, or it released its lease (that sweep is asked)
            if entry is not None and (entry.revision or 0) > rev:
                self._seen[instance] = (asyncio.get_running_loop().time(), entry.revision or 0)
                continue  # alive: the watch had not delivered its heartbeats yet
            del self._seen[instance]
            self._lost_at[instance] = loop.time()
            lost.append(instance)
            logger.warning("instance %s lost (no heartbeat for %.1f s)", instance, self._lease)
        return lost

    async def _key(self, instance: str) -> KeyValue.Entry | None:
        try:
            return await self._kv.get(instance)
        except nats.js.errors.KeyNotFoundError:
            return None

    def _after_beat(self, began: float, now: float) -> None:
        """Note a heartbeat; after a gap longer than the lease, recheck this instance's tasks.

        The gap is from the start of the last heartbeat that succeeded to the end
        of this one: at least the gap between the two writes NATS received,
        which is what others judge by (an acknowledgement read late cannot hide
        a gap).
        """
        last, self._last_beat = self._last_beat, began
        gap = now - last if last is not None else 0.0
        if gap > self._lease / 2:
            # (Others judge by this gap: past the lease they may take this instance
            # for lost. The fault suite reads this line.)
            logger.warning("heartbeats of %s were %.1f s apart", self._id, gap)
        if gap <= self._lease and not self._recheck_due:
            return
        if self._on_gap is None:
            return
        logger.warning(
            "no heartbeat for %.1f s (lease %.1f s): checking whether other instances "
            "ended this instance's tasks meanwhile",
            gap,
            self._lease,
        )
        if self._rechecking is None or self._rechecking.done():
            self._rechecking = asyncio.create_task(self._recheck(), name=f"{TASK_PREFIX}:recheck")

    async def _recheck(self) -> None:
        assert self._on_gap is not None
        self._recheck_due = False
        try:
            await self._on_gap()
        except StoreError as exc:
            self._recheck_due = True  # again after the next heartbeat
            logger.warning("could not recheck this instance's tasks (again soon): %s", exc)
        try:  # (after the recheck: a sweep may have deregistered it from the task log)
            await self._journal.log.owners.renew()
        except StoreError as exc:
            self._recheck_due = True
            logger.warning("could not register again as an owner (again soon): %s", exc)

    def _indexing_running(self) -> bool:
        return self._indexing is not None and not self._indexing.done()

    async def _keep_index(self) -> None:
        try:
            await self._journal.listing.keep_index(self.live())
        except StoreError as exc:
            logger.warning("could not keep the listing index (again soon): %s", exc)

    def _sweep_running(self) -> bool:
        return self._sweeping is not None and not self._sweeping.done()

    async def _heard(self, msg: Msg) -> None:
        key = msg.subject.rsplit(".", 1)[-1]
        if key == self._id:
            return
        op = (msg.headers or {}).get("KV-Operation")
        if op in DELETED:
            self._formats.gone(key)
            if self._seen.pop(key, None) is not None:
                logger.info("instance %s released its lease", key)
                self._sweep_requested = True
        else:
            meta = msg.metadata
            rev = int(meta.sequence.stream) if meta is not None else 0
            self._seen[key] = (asyncio.get_running_loop().time(), rev)
            self._lost_at.pop(key, None)
            self._formats.heard(key, msg.data)

    async def _sweep_logged(self) -> None:
        if not self._judging():
            self._sweep_requested = True  # (out of touch since it was asked for: later)
            return
        try:
            await self.sweep()
        except StoreError as exc:
            self._sweep_requested = True  # again at the next heartbeat
            logger.warning("lease sweep failed (again soon): %s", exc)

    async def sweep(self) -> int:
        """End FAILED every live-looking task whose owner is lost; return how many this won.

        A batch at a time (``SWEEP_BATCH`` snapshots read, then ended or
        released by ``CLAIM_CONCURRENCY`` claims at once, before the next is
        read): however many tasks a lost owner held, memory holds one batch
        and no step holds the event loop for long.

        Raises:
            StoreError: The journal could not be read.
        """
        won, failed = 0, False
        async with contextlib.aclosing(
            self._unfinished_batches(lambda owner: owner not in self.live())
        ) as batches:
            async for batch in batches:
                if not self._judging():  # (lost touch: the rest waits for the next sweep)
                    failed = True
                    break
                live = self.live()  # (after the read: one heard from meanwhile keeps its tasks)
                lost = [(owner, task_id) for owner, task_id in batch if owner and owner not in live]
                done, missed = await self._run_claims(lost)
                won, failed = won + done, failed or missed
        if failed:
            self._sweep_requested = True  # what could not be claimed is tried again
        if self._on_swept is not None:  # what the lost instances were still delivering
            await self._on_swept(self.live())
        return won

    async def _run_claims(self, lost: list[tuple[str, str]]) -> tuple[int, bool]:
        """Claim each (owner, task id), ``CLAIM_CONCURRENCY`` at once; how many won, any failed.

        A claim is skipped when its owner was heard from again, or this
        instance lost touch (then counted as failed: the sweep runs again),
        since the batch was read.
        """
        todo = iter(lost)
        won, failed = 0, False

        async def claimer() -> None:
            nonlocal won, failed
            for owner, task_id in todo:  # (shared: each claimer takes the next)
                if owner in self._seen:
                    continue  # it came back
                if not self._judging():
                    failed = True  # this instance lost touch: tried again at a later sweep
                    continue
                try:
                    done = await self._claim(task_id, owner, f"owner instance {owner} was lost")
                except StoreError as exc:
                    failed = True
                    logger.warning("could not end task %s of lost %s: %s", task_id, owner, exc)
                    continue
                won += done  # (after the await: += across it would lose others' counts)

        async with asyncio.TaskGroup() as group:
            for _ in range(min(CLAIM_CONCURRENCY, len(lost))):
                group.create_task(claimer(), name=f"{TASK_PREFIX}:lease-claim")
        return won, failed

    async def _unfinished_batches(
        self, owners: Callable[[str], bool]
    ) -> AsyncGenerator[list[tuple[str, str]]]:
        """(owner, task id) of unfinished tasks, of the ``owners`` chosen at least.

        Of the snapshot bucket: through the index's entries of each instance's
        unfinished tasks when it can be trusted (it costs what those owners hold,
        a batch read at a time), else by reading every snapshot (then handed out
        in batches). Then of the task log: from its owners' own subjects
        (``logowners``).
        """
        if self._journal.listing.indexed or await self._journal.listing.index_fresh():
            async with contextlib.aclosing(
                self._journal.ownership.owned_unfinished_batches(owners)
            ) as batches:
                async for snaps in batches:
                    yield [(snap.owner, snap.task().id) for snap in snaps]
        else:
            snaps = await self._journal.ownership.unfinished()
            for at in range(0, len(snaps), SWEEP_BATCH):
                yield [(snap.owner, snap.task().id) for snap in snaps[at : at + SWEEP_BATCH]]
        async with contextlib.aclosing(
            self._journal.log.owners.unfinished_batches(owners, SWEEP_BATCH)
        ) as logged:
            async for batch in logged:
                yield batch

    async def _claim(self, task_id: str, owner: str, text: str) -> int:
        """End ``owner``'s task FAILED with ``text`` unless someone wrote it first; 1 if this did.

        A task that waits for input is released instead (recorded as owned
        by nobody: the next message, through any instance, continues it).
        """
        recorded = await self._journal.get(task_id)
        if recorded is None:
            return 0
        if taskops.is_final(recorded.task):
            await self._journal.repair(recorded)
            return 0
        if recorded.owner != owner:
            return 0  # claimed or written by another instance since the scan
        if recorded.task.status.state in taskops.INTERRUPTED:
            released = await self._journal.ownership.release(task_id, owner)
            if released:
                self._metrics.tasks_released += 1
                logger.warning("task %s waits for input: released (%s)", task_id, text)
                return 1
            if released is Released.MOVED_ON:
                return 0  # claimed, ended or written by another instance since
            # Kept (an older version is in the cluster): ended FAILED, as before
            # waiting tasks belonged to the cluster.
            recorded = await self._journal.get(task_id)
            if recorded is None or recorded.owner != owner or taskops.is_final(recorded.task):
                return 0
        task = taskops.copy(recorded.task)
        frame = taskops.apply(task, taskops.status_event(task, TaskState.TASK_STATE_FAILED, text))
        change = Change(recorded.seq + 1, frame.SerializeToString(), TaskState.TASK_STATE_FAILED)
        try:
            await self._journal.update(task, recorded.version, [change])
        except (VersionConflictError, FinalTaskError, UnknownTaskError):
            return 0  # another survivor won, or the owner wrote after all
        self._metrics.tasks_reaped += 1
        logger.warning("task %s ended FAILED: %s", task.id, text)
        return 1

"""A fake cluster in memory: several instances in one process sharing a record, no NATS.

This is a test double, not an implementation: it stands in for
``jetstream.node.NatsCluster`` where the core's routing logic (``TaskEngine``
with a ``cluster.Cluster``) is under test and NATS itself is not the point.
``test_cluster*.py`` test the real thing against nats-server.

* ``FakeHub`` is what the instances share: one ``MemoryJournal`` (the shared
  record), which instance wrote each task last (its owner), the changes
  written to each task (its event log), and who is a member and reachable.
* ``FakeCluster`` is one instance's membership (implements ``Cluster``):

  * ``journal`` is the shared record as this instance writes it: what it
    writes, it owns (``RecordedTask.owner``), as on JetStream, where the
    writer's id goes in the task's snapshot (a survivor that ends a lost
    owner's task becomes its owner; see ``end_as_survivor``).
  * ``subscribe`` and ``replay`` hand out readers of relays: ``TaskLog``
    (``relayed=True``) of this instance's pool, fed with every change the
    record accepts for the task, with the owner's sequence numbers; one
    shared relay per task and instance, a private one per replay; a relay
    whose last reader left stops, ``leave`` severs them all
    (``RelayLostError``), a change missing from a relay severs it
    (``FrameNotKeptError``).
  * ``cancel`` and ``send`` run the owner's engine (which serves its own tasks) in a
    serving task of the owner (it goes on if the asker gives up), bounded as
    ``jetstream.routing`` bounds a request; errors cross "the wire" as their
    class, message and field (``routed.encode_error`` / ``decode_error``, as over NATS);
    an owner that left or is marked down gives ``OwnerUnavailableError``, one
    that answers too late ``OwnerTimeoutError``.

Simplifications (what the fake does not model):

* The record never fails, is never slow and never drops a change: no
  ``StoreUnavailableError``, no partial write, no retention of the event log
  beyond ``events_per_task`` changes per task (every change is kept, even
  when ``create`` is told ``keep_frames=False``), nothing forgotten for the
  hub's life but what ``MemoryJournal`` prunes.
* Relays are fed synchronously, inside the writer's ``create``/``update``,
  before the owner appends the frames to its own log (on NATS a relay gets
  them a little later, from its consumer's task). Readers only ever see
  whole writes either way.
* No lease, heartbeat or sweep: an instance that is down or gone keeps its
  tasks as they are until a test ends them (``end_as_survivor``) or the
  owner's ``recheck_ownership`` runs.
* ``mark_down`` cuts only routed requests to the instance (a partition of
  the control channel): its own writes and every relay go on.
* No size limit of its own (``max_record_bytes`` is None).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from a2a.client.transports.grpc import GrpcTransport
from a2a.server.agent_execution import AgentExecutor
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import SendMessageRequest, Task, TaskState
from a2a.utils.errors import (
    A2AError,
    InternalError,
    TaskNotFoundError,
)

from a2a_grpc_server import A2AService, ServerConfig
from a2a_grpc_server._internal.cluster import Local
from a2a_grpc_server._internal.cluster.routed import (
    ANSWER_MARGIN,
    decode_caller,
    decode_error,
    default_wait,
    encode_caller,
    encode_error,
)
from a2a_grpc_server._internal.engine.engine import TaskEngine, ended
from a2a_grpc_server._internal.errors import (
    FrameNotKeptError,
    OwnerTimeoutError,
    OwnerUnavailableError,
    RelayLostError,
    ServerError,
    quote,
)
from a2a_grpc_server._internal.journal import (
    Change,
    RecordedTask,
    Released,
    StoreUnavailableError,
    TaskPage,
    TaskQuery,
)
from a2a_grpc_server._internal.journal.keys import MemorySentKeys
from a2a_grpc_server._internal.journal.memory import MemoryJournal
from a2a_grpc_server._internal.log.tasklog import LogReader, TaskLog
from a2a_grpc_server._internal.model import taskops
from a2a_grpc_server._internal.model.caller import Caller
from a2a_grpc_server._internal.model.names import TASK_PREFIX
from a2a_grpc_server._internal.push.configs import MemoryPushConfigs
from tests.support.clusterharness import assert_idle
from tests.support.harness import Harness, expose

logger = logging.getLogger(__name__)

T = TypeVar("T")

READ_ATTEMPTS = 8
"""Times ``subscribe`` reads the record again when it changed while being read."""


@dataclass(frozen=True, slots=True)
class Event:
    """One change as the hub's event log keeps it (what a relay appends).

    Attributes:
        seq: Its number in the task's log.
        frame: The serialized ``StreamResponse`` (empty for a follow-up message).
        state: The ``TaskState`` the frame carries (0 for none).
        final: It ended the task.
    """

    seq: int
    frame: bytes
    state: int
    final: bool


class Hold:
    """A test's gate: routed requests to one instance wait here, once received, until released."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        """Set once a routed request waits here."""
        self._released = asyncio.Event()

    def release(self) -> None:
        """Let every waiting (and later) request through."""
        self._released.set()

    async def wait(self) -> None:
        """Wait for ``release`` (the caller is a routed request)."""
        self.arrived.set()
        await self._released.wait()


class FakeHub:
    """What the instances of one fake cluster share (see the module docstring).

    Args:
        events_per_task: Most changes per task the event log keeps (the oldest go).
    """

    def __init__(self, events_per_task: int = 16_384) -> None:
        self.record = MemoryJournal()
        """The shared record (owner-less; ``FakeCluster.journal`` adds the owner)."""
        self.push_configs = MemoryPushConfigs()
        """Push configs, shared as the KV bucket is."""
        self.sent_keys: MemorySentKeys | None = None
        """The message ids sent (made by the first member that asks)."""
        self._events_per_task = events_per_task
        self._owners: dict[str, str] = {}
        self._events: dict[str, deque[Event]] = {}
        self._followers: dict[str, dict[TaskLog, bool]] = {}
        self._members: dict[str, FakeCluster] = {}
        self._down: set[str] = set()
        self._holds: dict[str, Hold] = {}

    def member(self, instance_id: str) -> FakeCluster:
        """A new instance's membership (it joins with ``join``)."""
        return FakeCluster(self, instance_id)

    def owner(self, task_id: str) -> str:
        """The instance that wrote the task last ("" for an unknown task)."""
        return self._owners.get(task_id, "")

    def events(self, task_id: str) -> list[Event]:
        """The changes of the task the event log still keeps, oldest first."""
        return list(self._events.get(task_id, ()))

    def last_seq(self, task_id: str) -> int:
        """The number of the task's last change written (0 for an unknown task)."""
        events = self._events.get(task_id)
        return events[-1].seq if events else 0

    def mark_down(self, instance_id: str) -> None:
        """Routed requests to the instance get ``OwnerUnavailableError`` from now on."""
        self._down.add(instance_id)

    def mark_up(self, instance_id: str) -> None:
        """Routed requests reach the instance again."""
        self._down.discard(instance_id)

    def hold(self, instance_id: str) -> Hold:
        """Hold every routed request the instance receives until the gate is released."""
        return self._holds.setdefault(instance_id, Hold())

    def _reachable(self, instance_id: str) -> FakeCluster | None:
        if instance_id in self._down:
            return None
        return self._members.get(instance_id)

    def _join(self, member: FakeCluster) -> None:
        if member.instance_id in self._members:
            raise ValueError(f"instance id {member.instance_id} is taken")
        self._members[member.instance_id] = member

    def _leave(self, member: FakeCluster) -> None:
        if self._members.get(member.instance_id) is member:
            del self._members[member.instance_id]

    def _written(self, writer: str, task: Task, changes: Sequence[Change]) -> None:
        """After the record accepted a write: note its owner and changes, feed the relays."""
        self._owners[task.id] = writer
        final = taskops.is_final(task)
        last = changes[-1]
        written = [Event(c.seq, c.frame, c.state, final and c is last) for c in changes]
        events = self._events.get(task.id)
        if events is None:
            events = self._events[task.id] = deque(maxlen=self._events_per_task)
        events.extend(written)
        followers = self._followers.get(task.id)
        if followers:
            snapshot = taskops.copy(task)  # (the record keeps the writer's object)
            for log, shared in list(followers.items()):
                feed(log, written, snapshot if shared else None)

    def _follow(self, log: TaskLog, *, shared: bool) -> None:
        self._followers.setdefault(log.task_id, {})[log] = shared

    def _unfollow(self, log: TaskLog) -> None:
        followers = self._followers.get(log.task_id)
        if followers is not None:
            followers.pop(log, None)
            if not followers:
                del self._followers[log.task_id]


def feed(log: TaskLog, events: Iterable[Event], snapshot: Task | None) -> None:
    """Append to a relay the events it does not have yet, in order.

    Args:
        log: The relay.
        events: Consecutive changes of its task.
        snapshot: The task after the last of them (None: a private relay keeps none).
    """
    for event in events:
        if log.closed or event.seq <= log.last_seq:
            continue  # after its end, or before where it starts
        if event.seq != log.last_seq + 1:
            log.sever(FrameNotKeptError(log.task_id, log.last_seq + 1, event.seq, event.seq))
            return
        if snapshot is not None:
            log.snapshot = snapshot
        log.append(event.frame, event.state, final=event.final)


class InstanceJournal:
    """The shared record as one instance writes it (a ``TaskJournal``): what it writes, it owns.

    Args:
        hub: The shared hub.
        instance_id: The writing instance.
    """

    def __init__(self, hub: FakeHub, instance_id: str) -> None:
        self._hub = hub
        self._id = instance_id

    def scope_of(self, task_id: str) -> str | None:
        """The task's scope, as the shared record knows it without a read."""
        return self._hub.record.scope_of(task_id)

    async def get(self, task_id: str) -> RecordedTask | None:
        """The task as recorded, with its owner."""
        found = await self._hub.record.get(task_id)
        if found is None:
            return None
        owner = self._hub.owner(task_id)
        return RecordedTask(found.task, found.version, owner, found.seq, found.scope)

    async def create(
        self, task: Task, changes: Sequence[Change], *, keep_frames: bool = True, scope: str = ""
    ) -> int:
        """Record a new task, owned by this instance."""
        version = await self._hub.record.create(task, changes, keep_frames=keep_frames, scope=scope)
        self._hub._written(self._id, task, changes)
        return version

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        """Record changes (compare-and-set), as this instance."""
        version = await self._hub.record.update(task, expected_version, changes)
        self._hub._written(self._id, task, changes)
        return version

    async def list(self, query: TaskQuery) -> TaskPage:
        """One page of the shared record."""
        return await self._hub.record.list(query)


class FakeCluster:
    """One instance's membership of a fake cluster (implements ``cluster.Cluster``).

    Args:
        hub: What the instances share.
        instance_id: This instance's id.
    """

    def __init__(self, hub: FakeHub, instance_id: str) -> None:
        self._hub = hub
        self._id = instance_id
        self._journal = InstanceJournal(hub, instance_id)
        self._local: Local | None = None
        self._shared: dict[str, TaskLog] = {}
        self._open: dict[TaskLog, None] = {}
        self._serving: set[asyncio.Task[bytes]] = set()
        self._severed: str | None = None

    @property
    def hub(self) -> FakeHub:
        """The hub this instance shares."""
        return self._hub

    @property
    def instance_id(self) -> str:
        """This instance's id."""
        return self._id

    @property
    def journal(self) -> InstanceJournal:
        """The shared record, written as this instance."""
        return self._journal

    @property
    def max_record_bytes(self) -> int | None:
        """No limit of its own."""
        return None

    @property
    def local(self) -> Local:
        """What this instance joined with."""
        assert self._local is not None, "join() first"
        return self._local

    @property
    def relays(self) -> int:
        """Relays open on this instance."""
        return len(self._open)

    async def join(self, local: Local) -> None:
        """Serve routed requests with ``local``."""
        self._local = local
        self._hub._join(self)

    async def leave(self) -> None:
        """Take no more routed requests, sever every relay, wait for the requests being served."""
        self._hub._leave(self)
        self._severed = "this instance is shutting down; resubscribe through another"
        for log in list(self._open):
            log.sever(RelayLostError(self._severed))
        await self.wait_idle()

    async def close(self) -> None:
        """Nothing to release."""

    async def wait_idle(self) -> None:
        """Wait until the routed requests this instance is serving have ended."""
        if self._serving:
            await asyncio.wait(list(self._serving))

    async def subscribe(
        self, recorded: RecordedTask, *, passive: bool = False
    ) -> tuple[Task, LogReader]:
        """Join this instance's shared relay of the task, starting it from the record."""
        task_id = recorded.task.id
        for _ in range(READ_ATTEMPTS):
            if self._severed is not None:
                raise RelayLostError(self._severed)
            log = self._shared.get(task_id)
            if log is None:
                found = await self._hub.record.get(task_id)
                if found is None:
                    raise TaskNotFoundError(f"task {quote(task_id)} not found")
                if taskops.is_final(found.task):
                    raise ended(found.task)
                if task_id in self._shared or self._hub.last_seq(task_id) != found.seq:
                    continue  # started, or written, while it was read: no gap, no duplicate
                log = self._open_relay(task_id, found.seq + 1, shared=True)
                log.snapshot = found.task
            snapshot, reader = log.subscribe(passive=passive)  # (a closed relay left _shared)
            assert snapshot is not None
            return snapshot, reader
        raise StoreUnavailableError(f"task {quote(task_id)} kept changing while it was read")

    async def replay(self, recorded: RecordedTask, after: int) -> LogReader:
        """A private relay's reader of the task's frames after ``after``, from the event log."""
        if self._severed is not None:
            raise RelayLostError(self._severed)
        task_id = recorded.task.id
        events = self._hub.events(task_id)
        oldest = events[0].seq if events else recorded.seq + 1
        if oldest > after + 1:
            raise FrameNotKeptError(task_id, after + 1, oldest, recorded.seq)
        log = self._open_relay(task_id, after + 1, shared=False)
        reader = log.reader(after + 1)
        feed(log, events, None)
        return reader

    async def cancel(self, recorded: RecordedTask, call: Caller) -> Task:
        """Have the owner cancel the task (its engine)."""
        task_id = recorded.task.id

        async def serve(local: Local, routed: Caller) -> bytes:
            return (await local.owner.cancel(task_id, routed)).SerializeToString()

        return Task.FromString(await self._request(recorded.owner, "cancel", serve, call))

    async def send(self, recorded: RecordedTask, request: SendMessageRequest, call: Caller) -> None:
        """Have the owner start a follow-up message (its engine)."""
        payload = request.SerializeToString()

        async def serve(local: Local, routed: Caller) -> bytes:
            request = SendMessageRequest.FromString(payload)
            await local.owner.send(request, routed, subscribe=False)
            return b""

        await self._request(recorded.owner, "send", serve, call)

    @property
    def push_store(self) -> MemoryPushConfigs:
        """The hub's push configs."""
        return self._hub.push_configs

    def sent_keys(self, window: float, most: int = 100_000) -> MemorySentKeys:
        """The hub's message ids sent (shared by its members, as ``A2A_KEYS`` is)."""
        hub = self._hub
        if hub.sent_keys is None:
            hub.sent_keys = MemorySentKeys(window, most)
        return hub.sent_keys

    async def push(self, recorded: RecordedTask, config_id: str, call: Caller) -> None:
        """Have the owner deliver a stored push config (its ``follow_stored``)."""
        task_id = recorded.task.id

        async def serve(local: Local, routed: Caller) -> bytes:
            push = local.push
            if push is not None:
                await push.follow_stored(task_id, config_id)
            return b""

        await self._request(recorded.owner, "push", serve, call)

    async def claim(self, recorded: RecordedTask) -> RecordedTask | None:
        """Take over a waiting task owned by nobody (the hub's owner, compare-and-set)."""
        task_id = recorded.task.id
        found = await self._journal.get(task_id)
        if found is None or found.owner or found.task.status.state not in taskops.INTERRUPTED:
            return None
        self._hub._owners[task_id] = self._id
        return RecordedTask(found.task, found.version, self._id, found.seq, found.scope)

    async def release(self, task_id: str) -> Released:
        """Leave a waiting task of this instance's to the cluster (owned by nobody)."""
        found = await self._journal.get(task_id)
        if found is None:
            return Released.KEPT
        if found.owner != self._id or taskops.is_final(found.task):
            return Released.MOVED_ON
        if found.task.status.state not in taskops.INTERRUPTED:
            return Released.KEPT
        self._hub._owners[task_id] = ""
        return Released.RELEASED

    async def end_as_survivor(self, task_id: str, text: str) -> bool:
        """End the task FAILED through this instance, as a survivor ends a lost owner's task.

        Returns:
            Whether this ended it (False: it had ended, or someone wrote it first).
        """
        recorded = await self._journal.get(task_id)
        if recorded is None or taskops.is_final(recorded.task):
            return False
        task = taskops.copy(recorded.task)
        frame = taskops.apply(task, taskops.status_event(task, TaskState.TASK_STATE_FAILED, text))
        change = Change(recorded.seq + 1, frame.SerializeToString(), TaskState.TASK_STATE_FAILED)
        await self._journal.update(task, recorded.version, [change])
        return True

    def _open_relay(self, task_id: str, first_seq: int, *, shared: bool) -> TaskLog:
        log = TaskLog(task_id, self.local.tasks.pool, relayed=True, first_seq=first_seq)
        self._open[log] = None
        if shared:
            self._shared[task_id] = log
        self.local.tasks.metrics.relays_open += 1
        self._hub._follow(log, shared=shared)
        log.on_close(functools.partial(self._relay_ended, log))
        log.on_idle = functools.partial(log.sever, RelayLostError("no reader left"))
        return log

    def _relay_ended(self, log: TaskLog) -> None:
        if log not in self._open:
            return
        del self._open[log]
        if self._shared.get(log.task_id) is log:
            del self._shared[log.task_id]
        self._hub._unfollow(log)
        self.local.tasks.metrics.relays_open -= 1

    async def _request(
        self,
        owner: str,
        op: str,
        serve: Callable[[Local, Caller], Awaitable[bytes]],
        call: Caller,
    ) -> bytes:
        """Ask ``owner`` to ``serve``, as ``jetstream.routing.Router._request`` asks."""
        bound = default_wait(self.local.tasks.config.cancel_timeout)
        timeout = bound if call.timeout is None else call.timeout - ANSWER_MARGIN
        if timeout <= 0:
            raise OwnerTimeoutError("too little of the call's deadline is left to ask the owner")
        target = self._hub._reachable(owner)
        if target is None:
            raise OwnerUnavailableError(
                f"instance {owner}, which runs this task, is not reachable; if it is gone, "
                "the task ends FAILED once its lease expires"
            )
        # Across as over NATS: principal and tenant, credentials left out.
        serving = target._receive(op, serve, decode_caller(*encode_caller(call), timeout))
        # The owner goes on if this gives up (its client left, or no answer in time).
        done, _ = await asyncio.wait({serving}, timeout=timeout)
        if not done:
            raise OwnerTimeoutError(
                f"instance {owner}, which runs this task, did not answer within {timeout:.1f} s; "
                "the request may or may not have taken effect (GetTask tells)"
            )
        return serving.result()  # (what the owner raised, as it came over the wire)

    def _receive(
        self, op: str, serve: Callable[[Local, Caller], Awaitable[bytes]], call: Caller
    ) -> asyncio.Task[bytes]:
        task = asyncio.create_task(self._serve(serve, call), name=f"{TASK_PREFIX}:fake-routed-{op}")
        self._serving.add(task)
        task.add_done_callback(self._served)
        return task

    def _served(self, task: asyncio.Task[bytes]) -> None:
        self._serving.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an asker that gave up never reads it

    async def _serve(
        self, serve: Callable[[Local, Caller], Awaitable[bytes]], call: Caller
    ) -> bytes:
        try:
            if call.timeout is not None and call.timeout < ANSWER_MARGIN:
                raise OwnerTimeoutError("the request reached the task's owner too late to act")
            hold = self._hub._holds.get(self._id)
            if hold is not None:
                await hold.wait()
            return await serve(self.local, call)
        except (A2AError, ServerError) as exc:
            data, headers = encode_error(exc)
            error = decode_error(data, headers)
            assert error is not None
            raise error from None
        except Exception:
            logger.exception("fake routed request failed")
            raise InternalError(
                "internal error on the instance running the task; its log has the details"
            ) from None


@dataclass
class FakeInstance:
    """One instance of a fake cluster, served on a real grpc.aio server, and its clients."""

    name: str
    service: A2AService
    cluster: FakeCluster
    served: Harness

    @property
    def instance_id(self) -> str:
        """The id this instance records as owner."""
        return self.cluster.instance_id

    @property
    def engine(self) -> TaskEngine:
        """The instance's engine."""
        return self.service.engine

    @property
    def hub(self) -> FakeHub:
        """The hub the instance shares."""
        return self.cluster.hub

    @property
    def stub(self) -> a2a_pb2_grpc.A2AServiceStub:
        """A raw stub of the instance."""
        return self.served.stub

    @property
    def client(self) -> GrpcTransport:
        """An a2a-sdk client of the instance."""
        return self.served.client


async def start_instance(
    hub: FakeHub, name: str, executor: AgentExecutor, config: ServerConfig | None = None
) -> FakeInstance:
    """Start one instance joined to ``hub``, served on 127.0.0.1:0."""
    cluster = hub.member(f"{name}-{uuid.uuid4().hex[:6]}")
    service = A2AService(
        executor, config=config or ServerConfig(cancel_timeout=1.0), cluster=cluster
    )
    await service.start()
    return FakeInstance(name, service, cluster, await expose(service))


async def stop_instance(instance: FakeInstance) -> None:
    """Shut the instance down (its tasks end FAILED) and close what it opened."""
    served = instance.served
    await instance.service.shutdown(grace=0)
    await instance.cluster.close()
    await served.client.close()
    await served.channel.close()
    await served.server.stop(grace=None)


@contextlib.asynccontextmanager
async def fake_instances(
    executors: AgentExecutor | Sequence[AgentExecutor],
    names: Sequence[str] = ("A", "B"),
    *,
    config: ServerConfig | None = None,
    hub: FakeHub | None = None,
) -> AsyncIterator[list[FakeInstance]]:
    """Start one instance per name on one hub; on a normal exit check nothing is left.

    Args:
        executors: One executor every instance shares, or one per name.
        names: The instances' names.
        config: Every instance's limits.
        hub: The hub (a new one if None).

    The check (as ``clusterharness``): within 1 s every instance is idle, no
    relay is open, and no coroutine of the package is alive.
    """
    hub = hub or FakeHub()
    if isinstance(executors, AgentExecutor):
        executors = [executors] * len(names)
    assert len(executors) == len(names), "one executor per instance"
    started: list[FakeInstance] = []
    try:
        for name, executor in zip(names, executors, strict=True):
            started.append(await start_instance(hub, name, executor, config))
        yield started
        await assert_idle({i.name: i.service for i in started})
    finally:
        for instance in started:
            async with asyncio.timeout(10):
                await stop_instance(instance)

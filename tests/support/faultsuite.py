"""A randomized fault suite with an invariant checker, in the spirit of Jepsen (issue 19).

A seeded generator makes a *schedule*: a few faults at chosen times (SIGSTOP
and SIGCONT, SIGKILL, SIGTERM and restart of server instances and of
nats-server nodes). ``run`` starts the cluster (real ``serve`` processes with
an agent that keeps emitting, real ``nats-server -js`` processes: one node, or
three with ``--nats-replicas 3``), drives a workload through it while the
faults happen (streaming tasks sent through either instance, subscribers on
every instance, cancels and follow-ups through either, streams resumed
through another instance when theirs is cut), then checks, from what the
clients recorded, what every instance answers and what the record holds:

* every stream the client did not abandon ends with a final frame, or at an
  interrupted state (a SendStreamingMessage stream), or with a documented
  error status (UNAVAILABLE, OUT_OF_RANGE) — never OK without a final frame;
* that final frame's state and message are the stored final state's, on
  every instance, and GetTask agrees;
* each resume-aware stream's sequence numbers are exactly the record's
  numbered frames from its snapshot on: strictly increasing, no gap, no
  repeat (across its resumptions);
* nothing follows a final change in the record; no task is left non-final;
  a cancel that answered CANCELED left the task CANCELED;
* no task of an instance that kept heartbeating through the schedule is
  reaped (ended "owner instance … was lost" or "… restarted");
* ListTasks through every instance still up lists each task once, in the
  final state GetTask answers (the listing index agrees with the snapshots
  after the faults); on a 3-node cluster, within ``LIST_CATCH_UP`` s of GetTask
  agreeing: reads are
  direct gets, which any replica answers from what it has, one behind (resumed
  after a pause) too, until it catches up, stream by stream (docs/explanation/cluster.md,
  "Reads on a NATS cluster"). How many readings it took is printed when more than one.

A failing schedule names its seed; ``python -m tests.support.faultsuite SEED [NODES]
[--bucket]`` runs it again (NODES: 1, or 3 for a 3-node NATS cluster; ``--bucket``: tasks
in the snapshot bucket, format 2, rather than the task log).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import grpc
import nats
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)

from a2a_grpc_server._internal.jetstream.conn import EVENTS_STREAM
from a2a_grpc_server._internal.jetstream.journal import Entry, subject
from a2a_grpc_server._internal.model import taskops
from a2a_grpc_server._internal.rpc.resume import RESUME_AFTER_KEY, URI
from tests.support import natsserver
from tests.support.harness import RESUME, V1, rich_status, user_message
from tests.support.serveproc import NotReadyError, Process, start

S = TaskState
AGENT = "tests.support.agents:Ticking"
FINAL = (S.TASK_STATE_COMPLETED, S.TASK_STATE_FAILED, S.TASK_STATE_CANCELED, S.TASK_STATE_REJECTED)
GAP = re.compile(r"^(\S+ \S+) .*heartbeats of (\S+) were ([0-9.]+) s apart")
LOST = re.compile(r"owner instance (\S+) was lost|instance (\S+) restarted")
LIST_PAGE = 7
LIST_PAGES = 1000
LIST_CATCH_UP = 15.0
"""Seconds ListTasks may take, once GetTask agrees everywhere, to list every task as it
ended (a replica behind catches up: see the module docstring)."""


@dataclass(frozen=True)
class Fault:
    """One fault: what, to whom, when (seconds into the workload), for how long."""

    kind: str
    """``pause`` (SIGSTOP, SIGCONT after ``length``), ``kill`` (SIGKILL, restart after
    ``length``), ``term`` (SIGTERM, restart after ``length``), ``crash`` (SIGKILL, no
    restart: the survivors must end its tasks), each of an instance or,
    with the ``nats-`` prefix, of a nats-server node; ``partition`` (an instance cut off
    from NATS, still serving its clients, healed after ``length``; one NATS node only)."""
    target: int
    at: float
    length: float

    def __str__(self) -> str:
        return f"{self.kind}[{self.target}]@{self.at:.1f}s/{self.length:.1f}s"


@dataclass(frozen=True)
class Schedule:
    """A seeded schedule: the cluster's shape, the faults, the workload's seed."""

    seed: int
    nats_nodes: int
    lease: float
    faults: tuple[Fault, ...]

    def __str__(self) -> str:
        shape = f"{self.nats_nodes} NATS node(s), lease {self.lease}"
        return f"seed {self.seed} ({shape}): {', '.join(map(str, self.faults)) or 'no fault'}"


def schedule(seed: int, *, nats_nodes: int = 1, lease: float = 2.0, instances: int = 2) -> Schedule:
    """The schedule of ``seed``: one to three faults on distinct targets, lengths around
    the lease (just under, at, well past) and around NATS's own failover."""
    rng = random.Random(seed)
    targets = [("i", n) for n in range(instances)] + [("n", n) for n in range(nats_nodes)]
    rng.shuffle(targets)
    faults: list[Fault] = []
    for kind_of, n in targets[: rng.randint(1, 3)]:
        at = round(rng.uniform(0.5, 3.5), 2)
        if kind_of == "i":
            kinds = ("pause", "pause", "kill", "term") + (("partition",) * 2 * (nats_nodes == 1))
            if not any(f.kind == "crash" for f in faults):  # (one instance stays)
                kinds += ("crash",)
            kind = rng.choice(kinds)
            gone = kind in ("kill", "term", "crash")
            lengths = (0.5, 2 * lease) if gone else (0.5 * lease, lease, 2.5 * lease)
        else:
            kind = "nats-" + rng.choice(("pause", "kill"))
            lengths = (0.5 * lease, 1.5 * lease, 2.5 * lease)
        faults.append(Fault(kind, n, at, round(rng.choice(lengths), 2)))
    return Schedule(seed, nats_nodes, lease, tuple(sorted(faults, key=lambda f: f.at)))


# --- the cluster -----------------------------------------------------------------------


class Partition:
    """A TCP proxy on 127.0.0.1 between one instance and its NATS node that can be cut.

    Cut, it forwards nothing either way but keeps every connection open (a
    network that drops packets, not one that refuses them): the instance
    notices only by its requests timing out, exactly as behind a real
    partition. Healed, what was held flows on.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.open = asyncio.Event()
        self.open.set()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.open.set()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.open.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.ensure_future(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self.open.wait()
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sink.close()


@dataclass
class Member:
    """One ``serve`` process of the cluster (restarted under the same instance id)."""

    index: int
    instance_id: str
    args: tuple[str, ...]
    process: Process | None = None
    channel: grpc.aio.Channel | None = None
    stub: a2a_pb2_grpc.A2AServiceStub | None = None
    paused: bool = False
    crashed: bool = False
    """Killed for good (a ``crash`` fault): the survivors must end its tasks."""
    partition: Partition | None = None
    """Its way to NATS (one NATS node only), which a ``partition`` fault cuts."""
    logs: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        args = self.args
        if self.partition is not None:
            args += ("--nats", f"nats://127.0.0.1:{self.partition.port}")
        for attempt in range(60):  # as a supervisor restarts it (NATS may be down now)
            try:
                self.process = await start(*args, "--instance-id", self.instance_id)
                break
            except AssertionError:
                if attempt == 59:
                    raise
                await asyncio.sleep(0.5)  # sync-ok: a supervisor's restart back-off
        assert self.process is not None
        self.channel = grpc.aio.insecure_channel(self.process.grpc_addr)
        self.stub = a2a_pb2_grpc.A2AServiceStub(self.channel)
        self._reader = asyncio.create_task(self._read_log(self.process))

    async def _read_log(self, process: Process) -> None:
        stream = process.proc.stderr
        assert stream is not None
        while line := await stream.readline():
            self.logs.append(line.decode(errors="replace"))

    def signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.proc.returncode is None:
            self.process.proc.send_signal(sig)

    async def stopped(self) -> int | None:
        """Wait for the process to exit (after a kill or term), then drop the client.

        Returns:
            Its exit status (None if none ran).
        """
        code = None
        if self.process is not None:
            code = await self.process.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 5)
        if self.channel is not None:
            await self.channel.close()
        self.process, self.channel, self.stub = None, None, None
        return code

    @property
    def up(self) -> bool:
        return self.stub is not None and not self.paused


@dataclass
class StreamRecord:
    """What the client saw of one stream (and of its resumptions)."""

    task_id: str
    kind: str
    """``send``, ``subscribe``, or ``follow-up``."""
    via: int
    numbered: bool
    frames: list[StreamResponse] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)
    """How each leg ended: ``OK`` or a status code's name (a resumption starts a leg)."""
    legs: list[tuple[int, str]] = field(default_factory=list)
    """Each leg's instance, and the ErrorInfo reason it ended with ("" for none)."""
    done: bool = False


@dataclass
class Run:
    """Everything one schedule's run recorded."""

    schedule: Schedule
    members: list[Member]
    streams: list[StreamRecord] = field(default_factory=list)
    tasks: dict[str, str] = field(default_factory=dict)
    """Each task's kind: ``plain``, ``ask`` or ``cancel``."""
    canceled: set[str] = field(default_factory=set)
    """Tasks a CancelTask answered with CANCELED."""
    stored: dict[str, list[Task]] = field(default_factory=dict)
    listed: dict[int, list[Task]] = field(default_factory=dict)
    """What ListTasks listed through each instance still up (by its index), once all ended."""
    list_readings: dict[int, int] = field(default_factory=dict)
    """How many readings of ListTasks each instance took to list every task as it ended."""
    record: dict[str, list[Entry]] = field(default_factory=dict)
    injected: list[str] = field(default_factory=list)
    nats_down: list[tuple[float, float]] = field(default_factory=list)
    """Wall-clock windows in which a NATS node was paused or down."""
    violations: list[str] = field(default_factory=list)

    def live(self, rng: random.Random) -> Member | None:
        up = [m for m in self.members if m.up]
        return rng.choice(up) if up else None


# --- the workload ----------------------------------------------------------------------


def _seq(frame: StreamResponse) -> int:
    kind = frame.WhichOneof("payload")
    assert kind is not None
    meta = getattr(frame, kind).metadata
    return int(meta[URI]["seq"]) if URI in meta else 0


def state_of(frame: StreamResponse) -> TaskState | None:
    """The state a frame carries (None for a frame without one)."""
    return taskops.frame_state(frame) or None


async def _read(call: Any, record: StreamRecord, via: int, *, resumed: bool = False) -> None:
    """Read ``call`` to its end into ``record``.

    ``resumed``: a SendStreamingMessage stream resumed through SubscribeToTask, which
    stays open while the task waits for input; it is read up to an interrupted state,
    where the stream it resumes would have ended (then its client stops: ``OK``).
    """
    reason = ""
    try:
        async for frame in call:
            record.frames.append(frame)
            if record.numbered:
                record.seqs.append(_seq(frame))
            if resumed and state_of(frame) in taskops.INTERRUPTED:
                call.cancel()
                break
        record.ends.append("OK")
    except grpc.aio.AioRpcError as err:
        record.ends.append(err.code().name)
        reason = _reason(err)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # (this reader itself is being cancelled)
        record.ends.append("CANCELLED")  # its channel was closed: its instance went away
    record.legs.append((via, reason))


def _reason(err: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason of a failed call ("" when it carries none, e.g. a lost connection)."""
    try:
        return str(rich_status(err)[1].reason)
    except AssertionError:  # (rich_status's word for "no ErrorInfo")
        return ""


async def follow(run: Run, record: StreamRecord, call: Any, rng: random.Random) -> None:
    """Read a stream to its end; a numbered one cut by a fault resumes elsewhere."""
    await _read(call, record, record.via)
    tries = 0  # (160 x 0.25 s: as long as a supervisor restarts an instance, and then some)
    while record.numbered and record.ends[-1] in ("UNAVAILABLE", "CANCELLED") and tries < 160:
        last = state_of(record.frames[-1]) if record.frames else None
        if last in FINAL or (record.kind != "subscribe" and last in taskops.INTERRUPTED):
            break
        member = run.live(rng)
        if member is None or member.stub is None or not record.seqs:
            tries += 1
            await asyncio.sleep(0.25)  # sync-ok: waiting for an instance to come back
            continue
        tries += 1
        metadata = (*RESUME, (RESUME_AFTER_KEY, str(record.seqs[-1])))
        call = member.stub.SubscribeToTask(
            SubscribeToTaskRequest(id=record.task_id), metadata=metadata
        )
        await _read(call, record, member.index, resumed=record.kind != "subscribe")
        if record.ends[-1] == "UNAVAILABLE":
            await asyncio.sleep(0.25)  # sync-ok: a back-off before the next resumption
    record.done = True


def _cancelling() -> bool:
    """Whether this coroutine's own task is being cancelled (not just a call of it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _metadata(numbered: bool) -> tuple[tuple[str, str], ...]:
    return RESUME if numbered else V1


async def one_task(
    run: Run, n: int, rng: random.Random, followers: list[asyncio.Task[None]]
) -> None:
    """Start one task through a random instance, follow it everywhere, cancel or continue it."""
    kind = rng.choice(("plain", "plain", "ask", "cancel"))
    text = {
        "plain": f"{rng.randint(15, 40)} 0.08",
        "ask": f"ask {rng.randint(8, 20)} 0.08",
        "cancel": "100 0.05",
    }[kind]
    await asyncio.sleep(n * 0.15)  # sync-ok: the workload's own pacing, not synchronisation
    member = None
    for _ in range(40):  # an instance may be down: another, or the same once back
        member = run.live(rng)
        if member is not None and member.stub is not None:
            break
        await asyncio.sleep(0.25)  # sync-ok: waiting for an instance to come back
    if member is None or member.stub is None:
        return
    numbered = rng.random() < 0.7
    request = SendMessageRequest(message=user_message(text))
    call = member.stub.SendStreamingMessage(request, metadata=_metadata(numbered), timeout=60)
    try:
        first: StreamResponse = await asyncio.wait_for(anext(aiter(call)), 10)
    except (grpc.aio.AioRpcError, TimeoutError, StopAsyncIteration):
        call.cancel()
        return  # never started (its instance was down): nothing to check
    except asyncio.CancelledError:
        if _cancelling():
            raise
        # Its instance went down as the call began (the suite closed its channel: grpc.aio
        # raises CancelledError for that). Never started here: nothing to check.
        return
    task_id, context_id = first.task.id, first.task.context_id
    run.tasks[task_id] = kind
    sender = StreamRecord(
        task_id, "send", member.index, numbered, [first], [_seq(first)] if numbered else []
    )
    run.streams.append(sender)
    sending = asyncio.ensure_future(follow(run, sender, call, rng))
    followers.append(sending)
    for other in run.members:
        if not other.up or other.stub is None:
            continue
        sub_numbered = rng.random() < 0.7
        sub = other.stub.SubscribeToTask(
            SubscribeToTaskRequest(id=task_id), metadata=_metadata(sub_numbered), timeout=60
        )
        record = StreamRecord(task_id, "subscribe", other.index, sub_numbered)
        run.streams.append(record)
        followers.append(asyncio.ensure_future(follow(run, record, sub, rng)))
    if kind == "cancel":
        await asyncio.sleep(rng.uniform(0.3, 3.0))  # sync-ok: the cancel's random moment
        await cancel(run, task_id, rng)
    elif kind == "ask":
        await sending
        if await asks_for_input(run, task_id, sender, rng):
            await follow_up(run, task_id, context_id, rng, followers)


async def asks_for_input(run: Run, task_id: str, sender: StreamRecord, rng: random.Random) -> bool:
    """Whether the task waits for its answer, as a client tells it.

    From the sender's last frame; if a fault cut the sender before its task asked or
    ended, from GetTask through a live instance, until the task asks or ends. (A waiting
    task outlives its owner, so a client that saw no question yet must look: once the
    owner is lost it waits, released, for an answer that would otherwise never come.)
    """
    last = state_of(sender.frames[-1]) if sender.frames else None
    if last in taskops.INTERRUPTED:
        return True
    if last in FINAL:
        return False
    for _ in range(60):
        member = run.live(rng)
        if member is not None and member.stub is not None:
            try:
                task = await member.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1, timeout=3)
            except grpc.aio.AioRpcError:
                task = None
            except asyncio.CancelledError:  # (its channel closed: see ``follow_up``)
                if _cancelling():
                    raise
                task = None
            state = task.status.state if task is not None else None
            if state in taskops.INTERRUPTED:
                return True
            if state in FINAL:
                return False
        await asyncio.sleep(0.3)  # sync-ok: polling the task, as a client without a stream
    return False


async def cancel(run: Run, task_id: str, rng: random.Random) -> None:
    member = run.live(rng)
    if member is None or member.stub is None:
        return
    try:
        task = await member.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1, timeout=3)
    except grpc.aio.AioRpcError:
        return  # refused (ended, owner out of reach): the checker needs no more
    except asyncio.CancelledError:
        if _cancelling():
            raise
        # Its instance went down meanwhile: the suite closed its channel, which cancels the
        # call here (grpc.aio raises CancelledError for that). Not known to have canceled.
        return
    if task.status.state == S.TASK_STATE_CANCELED:
        run.canceled.add(task_id)


async def follow_up(
    run: Run, task_id: str, context_id: str, rng: random.Random, followers: list[asyncio.Task[None]]
) -> None:
    """Answer the agent's question through a random instance, retrying while refused.

    As long as ``follow`` resumes a stream (40 s, as a supervisor restarts an instance,
    and then some): a task waits for its answer for good, and so do its subscribers, so
    a client that gave up sooner (seed 546954: both instances down for 10 s) would leave
    them open however well the cluster kept its promise.
    """
    deadline = asyncio.get_running_loop().time() + 40.0
    for _ in range(200):
        if asyncio.get_running_loop().time() > deadline:
            return
        member = run.live(rng)
        if member is None or member.stub is None:
            await asyncio.sleep(0.3)  # sync-ok: waiting for an instance to come back
            continue
        numbered = rng.random() < 0.7
        message = user_message(f"{rng.randint(5, 15)} 0.08", task_id=task_id, context_id=context_id)
        request = SendMessageRequest(message=message, configuration=SendMessageConfiguration())
        call = member.stub.SendStreamingMessage(request, metadata=_metadata(numbered), timeout=60)
        record = StreamRecord(task_id, "follow-up", member.index, numbered)
        try:
            first: StreamResponse = await asyncio.wait_for(anext(aiter(call)), 5)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return  # the task ended meanwhile (a fault ended it)
            await asyncio.sleep(0.3)  # sync-ok: a back-off before the next try
            continue
        except (TimeoutError, StopAsyncIteration):
            call.cancel()
            await asyncio.sleep(0.3)  # sync-ok: a back-off before the next try
            continue
        except asyncio.CancelledError:
            if _cancelling():
                raise
            # Its instance went down meanwhile: the suite closed its channel, which cancels
            # the call here (grpc.aio raises CancelledError for that). Another try.
            await asyncio.sleep(0.3)  # sync-ok: a back-off before the next try
            continue
        record.frames.append(first)
        if numbered:
            record.seqs.append(_seq(first))
        run.streams.append(record)
        followers.append(asyncio.ensure_future(follow(run, record, call, rng)))
        return


# --- the faults ------------------------------------------------------------------------


async def inject(run: Run, fault: Fault, nodes: Sequence[natsserver.Node]) -> None:
    await asyncio.sleep(fault.at)  # sync-ok: the schedule says when
    run.injected.append(str(fault))
    if fault.kind.startswith("nats-"):
        node = nodes[fault.target]
        began = time.time()
        if fault.kind == "nats-pause":
            node.pause()
            await asyncio.sleep(fault.length)  # sync-ok: the outage's length
            node.resume()
        else:
            node.kill()
            await asyncio.sleep(fault.length)  # sync-ok: the outage's length
            await asyncio.to_thread(node.start)
        run.nats_down.append((began, time.time()))
        return
    member = run.members[fault.target]
    if fault.kind == "partition":
        assert member.partition is not None
        member.partition.open.clear()
        await asyncio.sleep(fault.length)  # sync-ok: the partition's length
        member.partition.open.set()
        return
    if fault.kind == "pause":
        member.paused = True
        member.signal(signal.SIGSTOP)
        await asyncio.sleep(fault.length)  # sync-ok: the pause's length
        member.signal(signal.SIGCONT)
        member.paused = False
        return
    member.paused = True  # (no new calls to it while it goes)
    member.signal(signal.SIGTERM if fault.kind == "term" else signal.SIGKILL)
    if fault.kind == "crash":
        member.crashed = True
    await member.stopped()
    if fault.kind == "crash":
        return  # for good
    await asyncio.sleep(fault.length)  # sync-ok: the downtime's length
    await member.start()
    member.paused = False


# --- the run and the checker -------------------------------------------------------------


async def run_schedule(
    plan: Schedule, *, tasks: int = 6, settle: float = 60.0, task_log: bool = True
) -> Run:
    """Run ``plan`` on a fresh cluster; return what was recorded, violations included.

    ``task_log``: the instances create tasks in the task log (the default) once they have
    heard each other (the first ones, and those while they have not, go to the snapshot
    bucket); else in the bucket (``--no-nats-task-log``).
    """
    rng = random.Random(plan.seed * 7919 + 1)
    with natsserver.running(plan.nats_nodes) as cluster:
        args: tuple[str, ...] = ("--agent", AGENT, "--lease", str(plan.lease))
        if not task_log:
            args += ("--no-nats-task-log",)
        if plan.nats_nodes > 1:  # (a proxy would be bypassed: clients learn every node)
            args += ("--nats", ",".join(cluster.urls), "--nats-replicas", str(plan.nats_nodes))
        tag = uuid.uuid4().hex[:4]
        members = [Member(i, f"m{i}-{plan.seed}-{tag}", args) for i in range(2)]
        run = Run(plan, members)
        try:
            for member in members:
                if plan.nats_nodes == 1:
                    member.partition = Partition(cluster.nodes[0].port)
                    await member.partition.start()
                try:
                    await member.start()
                except NotReadyError as exc:  # (not the workload's 60 s: it never began)
                    run.violations.append(f"instance {member.index} did not start: {exc}")
                    return run
            followers: list[asyncio.Task[None]] = []
            workload = [
                asyncio.ensure_future(one_task(run, n, rng, followers)) for n in range(tasks)
            ]
            faults = [asyncio.ensure_future(inject(run, f, cluster.nodes)) for f in plan.faults]
            async with asyncio.timeout(settle):
                await asyncio.gather(*faults)
                await asyncio.gather(*workload)
                while any(not f.done() for f in followers):
                    await asyncio.gather(*followers)
            await settle_and_read(run, cluster.urls, deadline=20.0)
        except TimeoutError:
            hung = [s for s in run.streams if not s.done]
            run.violations.append(
                f"the workload did not end within {settle:.0f} s ({len(run.injected)} fault(s) "
                f"injected, {len(run.tasks)} task(s) started): {len(hung)} stream(s) still open: "
                + "; ".join(f"{s.kind} of {s.task_id} via {s.via}" for s in hung[:5])
            )
        finally:
            for member in members:
                member.signal(signal.SIGCONT)
                member.signal(signal.SIGTERM)
            for member in members:
                code: int | None = -1
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(15):
                        code = await member.stopped()
                if code not in (0, None):  # (None: it was not running, a failed restart)
                    run.violations.append(f"instance {member.index} did not stop cleanly: {code}")
                member.signal(signal.SIGKILL)
                await member.stopped()
                if member.partition is not None:
                    await member.partition.close()
    if not run.violations:
        check(run)
    return run


async def settle_and_read(run: Run, urls: Sequence[str], deadline: float) -> None:
    """Wait until every task is final on every instance, then read what each holds.

    A task not final everywhere within ``deadline`` is a violation ("no task is
    left non-final"), named with what each instance answered.
    """
    pending = set(run.tasks)
    seen: dict[str, str] = {}
    try:
        async with asyncio.timeout(deadline):
            while pending:
                for task_id in list(pending):
                    answers = await _stored_everywhere(run, task_id, seen)
                    if answers and all(t.status.state in FINAL for t in answers):
                        run.stored[task_id] = answers
                        pending.discard(task_id)
                if pending:
                    await asyncio.sleep(0.2)  # sync-ok: polling the record for the end
    except TimeoutError:
        for task_id in sorted(pending):
            run.violations.append(
                f"{task_id} ({run.tasks[task_id]}) not final on every instance within "
                f"{deadline:.0f} s: {seen.get(task_id, 'no answer')}"
            )
        return
    for member in run.members:
        if member.stub is not None and not member.crashed:
            listed, readings = await _listed_caught_up(run, member.stub)
            run.listed[member.index], run.list_readings[member.index] = listed, readings
    nc = await nats.connect(servers=list(urls))
    try:
        js = nc.jetstream()
        for task_id in run.tasks:
            run.record[task_id] = await _entries(js, task_id)
    finally:
        await nc.close()


async def _listed_caught_up(run: Run, stub: a2a_pb2_grpc.A2AServiceStub) -> tuple[list[Task], int]:
    """ListTasks through ``stub``, read again until it lists every task in the final
    state GetTask answers, or ``LIST_CATCH_UP`` passes: the last reading, and how many
    it took (``check`` names what the last one lacks). On one NATS node, one reading:
    no replica can lag there, so a listing short of a task is a violation at once."""
    ended = {task_id: answers[0].status.state for task_id, answers in run.stored.items()}
    loop = asyncio.get_running_loop()
    give_up = loop.time() + LIST_CATCH_UP
    readings = 0
    while True:
        listed = await _listed(stub)
        readings += 1
        states = {t.id: t.status.state for t in listed}
        caught_up = all(states.get(i) == state for i, state in ended.items())
        if caught_up or run.schedule.nats_nodes == 1 or loop.time() > give_up:
            return listed, readings  # (one node has no replica to lag: one reading)
        await asyncio.sleep(0.25)  # sync-ok: polling a replica that catches up


async def _listed(stub: a2a_pb2_grpc.A2AServiceStub) -> list[Task]:
    """Every task ListTasks lists, page by page (small pages: tokens are exercised)."""
    found: list[Task] = []
    token = ""
    for _ in range(LIST_PAGES):
        page = await _retrying(
            functools.partial(
                stub.ListTasks,
                ListTasksRequest(page_size=LIST_PAGE, page_token=token),
                metadata=V1,
                timeout=10,
            ),
            errors=(grpc.aio.AioRpcError,),
        )
        found.extend(page.tasks)
        token = page.next_page_token
        if not token:
            return found
    raise AssertionError(f"ListTasks gave more than {LIST_PAGES} pages")


async def _stored_everywhere(run: Run, task_id: str, seen: dict[str, str]) -> list[Task]:
    """What every instance still up answers for the task ([] if one does not answer yet);
    ``seen`` keeps the latest answers, for a violation's message."""
    answers, said = [], []
    for member in run.members:
        if member.crashed:
            continue  # (down for good: the others answer)
        if member.stub is None:
            said.append(f"instance {member.index}: down")
            seen[task_id] = ", ".join(said)
            return []
        try:
            task = await member.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1, timeout=5)
        except grpc.aio.AioRpcError as err:
            said.append(f"instance {member.index}: {err.code().name} {err.details()!r}")
            seen[task_id] = ", ".join(said)
            return []
        said.append(f"instance {member.index}: {S.Name(task.status.state)}")
        answers.append(task)
    seen[task_id] = ", ".join(said)
    return answers


async def _entries(js: Any, task_id: str) -> list[Entry]:
    found: list[Entry] = []
    seq = 0
    while True:
        try:
            msg = await _retrying(functools.partial(_next_entry, js, task_id, seq))
        except nats.js.errors.NotFoundError:
            return found
        seq = int(msg.seq)
        found.extend(Entry.unpack(msg, seq))


async def _next_entry(js: Any, task_id: str, after: int) -> Any:
    return await js.get_msg(EVENTS_STREAM, seq=after + 1, subject=subject(task_id), next=True)


async def _retrying(
    read: Callable[[], Awaitable[Any]],
    within: float = 20.0,
    errors: tuple[type[BaseException], ...] = (),
) -> Any:
    """``read()``, retried while JetStream is not ready (a node just restarted catches up),
    or while it raises one of ``errors``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    retried: tuple[type[BaseException], ...] = (
        nats.js.errors.ServiceUnavailableError,
        nats.errors.TimeoutError,
        nats.errors.NoRespondersError,
        *errors,
    )
    while True:
        try:
            return await read()
        except retried:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.25)  # sync-ok: a back-off while JetStream recovers


def check(run: Run) -> None:
    """Assert the invariants over what ``run`` recorded; append what breaks."""
    bad = run.violations.append
    lease = run.schedule.lease
    disturbed = _disturbed(run, lease)
    gone = {f.target for f in run.schedule.faults if f.kind in ("kill", "term", "crash")}
    """Instances whose process went away: streams through them may be cut."""
    for task_id, answers in run.stored.items():
        states = {(t.status.state, _text(t)) for t in answers}
        if len(states) != 1:
            bad(f"{task_id}: the instances answer different final states {sorted(states)}")
        final = answers[0]
        entries = run.record.get(task_id, [])
        numbers = [e.seq for e in entries]
        if numbers != list(range(1, len(numbers) + 1)):
            bad(f"{task_id}: the record's changes are not numbered 1, 2, 3 …: {numbers}")
        finals = [i for i, e in enumerate(entries) if e.final]
        if finals and finals[0] != len(entries) - 1:
            bad(f"{task_id}: {len(entries) - 1 - finals[0]} change(s) follow its final change")
        if not finals:
            bad(
                f"{task_id}: the record has no final change, "
                f"GetTask says {S.Name(final.status.state)}"
            )
        if task_id in run.canceled and final.status.state != S.TASK_STATE_CANCELED:
            bad(
                f"{task_id}: CancelTask answered CANCELED, "
                f"the task ended {S.Name(final.status.state)}"
            )
        match = LOST.search(_text(final))
        if final.status.state == S.TASK_STATE_FAILED and match:
            owner = match.group(1) or match.group(2)
            if owner not in disturbed:
                bad(f"{task_id}: reaped from {owner}, which kept heartbeating ({_text(final)!r})")
        for stream in (s for s in run.streams if s.task_id == task_id):
            _check_stream(stream, final, entries, bad, gone)
    for index, listed in run.listed.items():
        ids = [t.id for t in listed]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            bad(f"instance {index}: ListTasks lists {twice} more than once")
        listed_as = {t.id: t.status.state for t in listed}
        for task_id, answers in run.stored.items():
            if task_id not in listed_as:
                bad(f"instance {index}: ListTasks does not list {task_id}")
            elif listed_as[task_id] != answers[0].status.state:
                bad(
                    f"instance {index}: ListTasks lists {task_id} {S.Name(listed_as[task_id])}, "
                    f"GetTask says {S.Name(answers[0].status.state)}"
                )


def _check_stream(
    stream: StreamRecord,
    final: Task,
    entries: list[Entry],
    bad: Callable[[str], None],
    gone: set[int],
) -> None:
    name = f"{stream.kind} of {stream.task_id} via instance {stream.via} (ends {stream.ends})"
    last = state_of(stream.frames[-1]) if stream.frames else None
    cut = stream.ends[-1] if stream.ends else "none"
    # (An interrupted end counts when the stream got a status after its snapshot.)
    interrupted = (
        stream.kind != "subscribe" and last in taskops.INTERRUPTED and len(stream.frames) > 1
    )
    for (via, reason), end in zip(stream.legs, stream.ends, strict=True):
        handed_over = reason in ("RELAY_LOST", "TASK_HANDED_OVER")
        if end in ("UNAVAILABLE", "CANCELLED") and not handed_over and via not in gone:
            bad(f"{name}: cut ({end} {reason!r}) on instance {via}, which never went away")
            return
    # (A stream cut before its first frame has no cursor to resume from: never started.)
    resumable_cut = stream.numbered and cut in ("UNAVAILABLE", "CANCELLED") and stream.seqs
    if resumable_cut and last not in FINAL and not interrupted:
        bad(f"{name}: cut, and never resumed to its end")
        return
    if cut == "OK":
        if last not in FINAL and not interrupted:
            bad(f"{name}: ended OK without a final frame (last: {last and S.Name(last)})")
            return
    elif cut == "FAILED_PRECONDITION" and not stream.frames and stream.kind == "subscribe":
        return  # refused: the task had ended when the subscription was served (GetTask tells)
    elif cut not in ("UNAVAILABLE", "OUT_OF_RANGE", "CANCELLED"):
        bad(f"{name}: ended with {cut}, not a final frame nor a documented status")
        return
    if last in FINAL:
        update = stream.frames[-1]
        text = (
            _text(update.status_update) if update.HasField("status_update") else _text(update.task)
        )
        if (last, text) != (final.status.state, _text(final)):
            bad(
                f"{name}: final frame {S.Name(last)} {text!r}, "
                f"stored {S.Name(final.status.state)} {_text(final)!r}"
            )
    if stream.numbered and stream.seqs:
        start = stream.seqs[0]
        expected = [e.seq for e in entries if e.frame and e.seq > start]
        got = stream.seqs[1:]
        if got != expected[: len(got)]:
            bad(f"{name}: numbers {got[:20]}… are not the record's {expected[:20]}…")
        elif last in FINAL and len(got) != len(expected):
            bad(f"{name}: got {len(got)} numbered frames, the record has {len(expected)}")


def _text(obj: Any) -> str:
    status = obj.status
    return status.message.parts[0].text if status.message.parts else ""


def _disturbed(run: Run, lease: float) -> set[str]:
    """Instances that may rightly have been taken for lost: killed, stopped, or silent for
    about a lease (their own log says how far apart their heartbeats were). With one
    NATS node, a silence during its outage does not count: every instance saw that one,
    and an outage every instance saw is no death."""
    found = {
        run.members[f.target].instance_id
        for f in run.schedule.faults
        if not f.kind.startswith("nats-")
        and (f.kind in ("kill", "term", "crash") or f.length >= 0.9 * lease)
    }
    for member in run.members:
        for line in member.logs:
            if not (m := GAP.search(line)) or float(m.group(3)) < 0.9 * lease:
                continue
            end = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            begin = end - float(m.group(3))
            seen_by_all = run.schedule.nats_nodes == 1 and any(
                begin < down_end + 1.0 and end > down_begin - 1.0
                for down_begin, down_end in run.nats_down
            )
            if not seen_by_all:
                found.add(m.group(2))
    return found


async def _replay(seed: int, nodes: int, task_log: bool) -> int:
    run = await run_schedule(schedule(seed, nats_nodes=nodes), task_log=task_log)
    print(f"{run.schedule}: {len(run.tasks)} tasks, {len(run.streams)} streams")
    for index, readings in sorted(run.list_readings.items()):
        if readings > 1:
            print(f"  instance {index}: ListTasks listed every task after {readings} readings")
    for violation in run.violations:
        print(f"  VIOLATION {violation}")
    return 1 if run.violations else 0


if __name__ == "__main__":
    import sys

    args = [a for a in sys.argv[1:] if a != "--bucket"]
    raise SystemExit(
        asyncio.run(
            _replay(int(args[0]), int(args[1]) if len(args) > 1 else 1, "--bucket" not in sys.argv)
        )
    )

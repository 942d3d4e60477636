"""PushDispatcher: every webhook is one more reader of its task's log, with its own cursor.

For each (task, config) one coroutine (a *delivery*) reads the task's log
from the config's cursor and POSTs each frame in order (``WebhookSender``),
one request at a time, then moves the cursor. So a webhook gets what a
stream gets, in the same order, the final frame last, whatever ended the
task: the final frame is in the log for every ending (completion, each
cancel flavour, failure, shutdown).

Retries: a frame worth retrying is retried with exponential backoff and
jitter (longer if ``Retry-After`` says so, never shorter) for
``push_retry_for`` seconds; then the config counts as failing, the frame is
given up, and the delivery jumps to the task as it is now, sent as one
``Task`` frame, and goes on from there.
A delivery whose next frame left the log (the receiver was slower than the
task's log keeps) does the same. Either way the outcome is never lost: the
last frame attempted is the final one or a Task in its final state.

Bounds: one request in flight per delivery, at most ``push_max_in_flight``
across the instance and ``quota_push_in_flight`` for one named principal's
tasks (the rest wait their turn, holding no connection: webhooks that hang
delay their own principal's pushes first); a
delivery holds frames only through its log reader, within the log's budget;
a slow receiver slows only its own delivery.

Who runs what: deliveries are asyncio tasks named ``a2a-grpc-server:push:…``
owned by the dispatcher; ``follow`` starts one, ``stop`` (a config deleted
or replaced) cancels one, ``close`` (shutdown) gives them until a deadline
to deliver what they have, final frames included, then cancels the rest.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from a2a.types.a2a_pb2 import StreamResponse, Task, TaskPushNotificationConfig
from google.protobuf import json_format

from ..errors import FrameNotKeptError, RelayLostError
from ..journal import StoreError
from ..log.tasklog import LogReader
from ..model import taskops
from ..model.names import TASK_PREFIX
from ..model.scope import principal_of
from ..obs.metrics import Metrics
from .configs import PushConfigStore
from .sender import Outcome, WebhookSender

if TYPE_CHECKING:
    from ..execution.live import LiveTask

logger = logging.getLogger(__name__.replace("._internal", ""))

FIRST_RETRY = 0.5
"""Seconds before the first retry of a frame (then doubling, with jitter)."""
MAX_RETRY_PAUSE = 60.0
"""Most seconds between two attempts (unless the receiver's Retry-After says more)."""


class PushDispatcher:
    """Runs the deliveries of one instance (see the module docstring).

    Args:
        store: Where configs and cursors are kept.
        sender: How a frame is POSTed.
        metrics: Where deliveries are counted.
        retry_for: Seconds one frame is retried before it is given up.
        max_in_flight: Most requests in flight across every delivery.
        max_in_flight_per_caller: Most requests in flight for the tasks of one
            principal (0: no bound but ``max_in_flight``).
    """

    def __init__(
        self,
        store: PushConfigStore,
        sender: WebhookSender,
        metrics: Metrics,
        *,
        retry_for: float,
        max_in_flight: int,
        max_in_flight_per_caller: int = 0,
    ) -> None:
        self.store = store
        self._sender = sender
        self._metrics = metrics
        self._retry_for = retry_for
        self._gate = asyncio.Semaphore(max_in_flight)
        self._per_caller = max_in_flight_per_caller
        self._callers: dict[str, _CallerGate] = {}
        """Each principal's gate, while one of its deliveries runs."""
        self._deliveries: dict[str, dict[str, asyncio.Task[None]]] = {}
        """Running deliveries by task id, then config id."""
        self._sources: dict[str, Source] = {}
        """What each task with deliveries follows."""
        self._running = 0
        self._closing = False
        self.on_task_done: Callable[[str], None] | None = None
        """Called with a task's id when its last delivery has ended."""

    @property
    def count(self) -> int:
        """Deliveries running (a stopped one until its coroutine has ended)."""
        return self._running

    def following(self, task_id: str) -> int:
        """Deliveries following the task (not counting stopped ones)."""
        return len(self._deliveries.get(task_id, ()))

    def follow(self, live: LiveTask, config: TaskPushNotificationConfig, after: int) -> None:
        """Deliver the frames of a task live here after ``after`` to ``config``'s webhook.

        Replaces a delivery already running for the same config. The log must
        keep frame ``after + 1`` or be past it (a delivery that is behind jumps
        to the task as it is).
        """
        source = LiveSource(live)
        self.deliver(source, config, source.reader(after))

    def deliver(
        self, source: Source, config: TaskPushNotificationConfig, reader: LogReader | None
    ) -> None:
        """Deliver what ``reader`` reads of ``source``'s task to ``config``'s webhook.

        Without a reader (the frames are gone), the task as it is now, then what follows.
        """
        task_id, config_id = source.task_id, config.id
        self.stop(task_id, config_id)
        if self._closing:
            if reader is not None:
                reader.close()
            return
        task = asyncio.create_task(
            self._deliver(source, config, reader),
            name=f"{TASK_PREFIX}:push:{task_id}:{config_id}",
        )
        self._deliveries.setdefault(task_id, {})[config_id] = task
        self._sources[task_id] = source
        self._running += 1
        self._metrics.push_deliveries_running = self._running

        def done(finished: asyncio.Task[None]) -> None:
            if reader is not None:
                reader.close()  # (a delivery cancelled before its first step never did)
            self._running -= 1
            self._metrics.push_deliveries_running = self._running
            self._metrics.push_failing.discard((task_id, config_id))
            of_task = self._deliveries.get(task_id)
            if of_task is not None and of_task.get(config_id) is finished:
                del of_task[config_id]
                if not of_task:
                    del self._deliveries[task_id]
                    self._sources.pop(task_id, None)
                    if self.on_task_done is not None:
                        self.on_task_done(task_id)
            if not finished.cancelled() and finished.exception() is not None:
                logger.error(
                    "push delivery of task %s to config %s crashed",
                    task_id,
                    config_id,
                    exc_info=finished.exception(),
                )

        task.add_done_callback(done)

    def stop(self, task_id: str, config_id: str) -> None:
        """Stop the config's delivery, if one runs (the config was deleted or replaced)."""
        of_task = self._deliveries.get(task_id)
        task = of_task.pop(config_id, None) if of_task else None
        if of_task is not None and not of_task:
            del self._deliveries[task_id]
            self._sources.pop(task_id, None)
        if task is not None:
            task.cancel()

    def stop_task(self, task_id: str) -> None:
        """Stop every delivery of a task (it left memory; cursors are kept)."""
        self._sources.pop(task_id, None)
        for task in (self._deliveries.pop(task_id, None) or {}).values():
            task.cancel()

    async def wait_ended(self) -> None:
        """Wait until every delivery of an ended task has delivered (or given up) its frames."""
        while ending := [
            task
            for task_id, of_task in self._deliveries.items()
            if self._sources[task_id].ended
            for task in of_task.values()
        ]:
            await asyncio.wait(ending)

    async def close(self, deadline: float | None) -> None:
        """Let deliveries finish until ``deadline`` (loop time), then cancel the rest."""
        self._closing = True
        running = [task for of_task in self._deliveries.values() for task in of_task.values()]
        if running:
            loop = asyncio.get_running_loop()
            wait = None if deadline is None else max(0.0, deadline - loop.time())
            _, late = await asyncio.wait(running, timeout=wait)
            for task in late:
                task.cancel()
            if late:
                logger.warning(
                    "shutting down with %d push deliveries unfinished (their webhooks did not "
                    "answer in time)",
                    len(late),
                )
                await asyncio.wait(late)
        await self._sender.close()

    async def _deliver(
        self, source: Source, config: TaskPushNotificationConfig, reader: LogReader | None
    ) -> None:
        task_id = source.task_id
        gate = self._caller_gate(principal_of(source.scope))
        try:
            while True:
                if reader is not None:
                    try:
                        async for seq, frame, _ in reader:
                            if not await self._send(config, task_id, gate, seq, frame):
                                break  # given up: jump to the task as it is now
                        else:
                            return  # the final frame is delivered (or given up)
                    except (FrameNotKeptError, RelayLostError, StoreError) as exc:
                        self._metrics.push_frames_skipped += 1
                        logger.warning(
                            "push to config %s of task %s: its next frame cannot be read (%s); "
                            "sending the task as it is now",
                            config.id,
                            task_id,
                            type(exc).__name__,
                        )
                    reader.close()
                current = await source.current()
                if current is None:
                    return  # no task: the executor answered with a message alone
                task, seq = current
                ended = source.ended  # then ``task`` is final
                # Made before the send: every frame after ``seq`` is kept for it.
                reader = None if ended else source.reader(seq)
                frame = StreamResponse(task=task).SerializeToString()
                await self._send(config, task_id, gate, seq, frame)
                if ended:
                    return
        except _ConfigGone:
            logger.info("push config %s of task %s was deleted: delivery stops", config.id, task_id)
        finally:
            gate.leave()
            if reader is not None:
                reader.close()

    def _caller_gate(self, principal: str) -> _CallerGate | _NoGate:
        """The slots of ``principal``'s tasks, for one delivery (which ``leave``s it at its end).

        The anonymous principal (no authenticator: every caller) is not held to
        a per-caller bound: it is the whole instance, as for the other quotas.
        Neither is anyone when there is no per-caller bound.
        """
        if not self._per_caller or not principal:
            return _NO_GATE
        gate = self._callers.get(principal)
        if gate is None:
            gate = _CallerGate(self._per_caller, principal, self._callers)
            self._callers[principal] = gate
        gate.users += 1
        return gate

    async def _gone(self, task_id: str, config_id: str) -> bool:
        """Whether the config was deleted (a store that cannot tell says no)."""
        try:
            return await self.store.cursor(task_id, config_id) is None
        except StoreError:
            return False

    async def _send(
        self,
        config: TaskPushNotificationConfig,
        task_id: str,
        gate: _CallerGate | _NoGate,
        seq: int,
        frame: bytes,
    ) -> bool:
        """POST one frame until it is delivered, refused, or its retry budget is spent.

        Each attempt holds a slot of the task's principal (``gate``), then one of
        the instance's.

        Returns:
            Whether the webhook took it.
        """
        body = json_format.MessageToJson(StreamResponse.FromString(frame), indent=None).encode()
        metrics = self._metrics
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self._retry_for
        pause = FIRST_RETRY
        started = time.monotonic()
        while True:
            async with gate, self._gate:
                metrics.push_in_flight += 1
                try:
                    attempt = await self._sender.post(config, task_id, seq, body)
                finally:
                    metrics.push_in_flight -= 1
            if attempt.outcome is Outcome.DELIVERED:
                metrics.push_deliveries[Outcome.DELIVERED.value] += 1
                metrics.push_lag_seconds.observe(time.monotonic() - started)
                metrics.push_failing.discard((task_id, config.id))
                try:
                    still = await self.store.confirm(task_id, config.id, seq)
                except StoreError as exc:  # the next confirmation carries it forward
                    logger.warning("push cursor of task %s not stored: %s", task_id, exc)
                    still = True
                if not still:
                    raise _ConfigGone
                return True
            if await self._gone(task_id, config.id):
                raise _ConfigGone  # deleted (on another instance) while it failed
            left = give_up_at - loop.time()
            if attempt.outcome is Outcome.REFUSED or left <= 0:
                metrics.push_deliveries["given_up"] += 1
                failing = (task_id, config.id) in metrics.push_failing
                metrics.push_failing.add((task_id, config.id))
                # Once per webhook while it fails (each later frame: DEBUG), not per frame.
                (logger.debug if failing else logger.warning)(
                    "push to config %s of task %s: frame %d given up (%s)%s",
                    config.id,
                    task_id,
                    seq,
                    attempt.detail,
                    "" if attempt.outcome is Outcome.REFUSED else f" after {self._retry_for:g} s",
                )
                return False
            metrics.push_retries += 1
            wait = pause * random.uniform(0.5, 1.5)  # jitter: receivers recovering
            pause = min(pause * 2, MAX_RETRY_PAUSE)
            if attempt.retry_after is not None:
                # A receiver's Retry-After lengthens the backoff, never shortens it:
                # "Retry-After: 0" (or a date past) must not make a retry loop.
                wait = max(wait, attempt.retry_after)
            logger.info(
                "push to config %s of task %s: frame %d not delivered (%s); retrying in %.1f s",
                config.id,
                task_id,
                seq,
                attempt.detail,
                wait,
            )
            await asyncio.sleep(min(wait, left))


class _CallerGate:
    """The slots of one principal's tasks: ``async with`` holds one for an attempt.

    Taken before the instance's gate, so a principal's deliveries beyond its
    slots wait here, not in the instance's queue ahead of other principals'.
    It is kept (in ``kept``) only while one of the principal's deliveries
    runs: nothing is kept per principal after that.
    """

    __slots__ = ("_kept", "_principal", "_slots", "users")

    def __init__(self, size: int, principal: str, kept: dict[str, _CallerGate]) -> None:
        self._slots = asyncio.Semaphore(size)
        self._principal, self._kept = principal, kept
        self.users = 0
        """Deliveries that use it."""

    async def __aenter__(self) -> None:
        await self._slots.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._slots.release()

    def leave(self) -> None:
        """A delivery that used it has ended."""
        self.users -= 1
        if not self.users and self._kept.get(self._principal) is self:
            del self._kept[self._principal]


class _NoGate:
    """What a delivery not held to a per-caller bound holds: nothing."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None

    def leave(self) -> None:
        """Nothing is counted or kept."""


_NO_GATE = _NoGate()


class _ConfigGone(Exception):
    """The config was deleted (on another instance) while its delivery ran."""


class Source(Protocol):
    """The task a delivery follows."""

    @property
    def task_id(self) -> str:
        """The task."""
        ...

    @property
    def scope(self) -> str:
        """Whose task it is (``model.scope``)."""
        ...

    @property
    def ended(self) -> bool:
        """Whether the task has ended (``current`` is then its final state)."""
        ...

    async def current(self) -> tuple[Task, int] | None:
        """The task as it is now and the number of the last frame it includes.

        Returns with no frame appended since, so a reader made at once misses none;
        None when there is no task (the executor answered with a message alone).
        """
        ...

    def reader(self, after: int) -> LogReader:
        """A passive reader of the frames after ``after`` (only while not ``ended``)."""
        ...


class LiveSource:
    """A task live on this instance: its log, and its snapshot."""

    __slots__ = ("live",)

    def __init__(self, live: LiveTask) -> None:
        self.live = live

    @property
    def task_id(self) -> str:
        """The task."""
        return self.live.task_id

    @property
    def scope(self) -> str:
        """Whose task it is."""
        return self.live.scope

    @property
    def ended(self) -> bool:
        """Whether the task's log is closed."""
        return self.live.log.closed

    async def current(self) -> tuple[Task, int] | None:
        """See ``Source.current``."""
        live = self.live
        if not live.log.closed:
            task, seq = await live.snapshot()
            if task is not None:
                return task, seq
        snapshot = live.log.snapshot
        return None if snapshot is None else (taskops.copy(snapshot), live.log.last_seq)

    def reader(self, after: int) -> LogReader:
        """A passive reader of the log from frame ``after + 1``."""
        return self.live.log.reader(after + 1, passive=True)


class EndedSource:
    """A task that ended elsewhere (a survivor delivers what its lost owner had not)."""

    __slots__ = ("_final", "_scope", "_seq")

    def __init__(self, final: Task, seq: int, scope: str) -> None:
        self._final, self._seq, self._scope = final, seq, scope

    @property
    def scope(self) -> str:
        """Whose task it is."""
        return self._scope

    @property
    def task_id(self) -> str:
        """The task."""
        return self._final.id

    @property
    def ended(self) -> bool:
        """Always: the task has ended."""
        return True

    async def current(self) -> tuple[Task, int] | None:
        """The final task and its last frame's number."""
        return taskops.copy(self._final), self._seq

    def reader(self, after: int) -> LogReader:
        """Never called: the task has ended."""
        raise AssertionError("an ended task needs no new reader")

"""PushService: the push-config operations, and when deliveries start and stop.

Who calls what: the gRPC servicer calls ``create``, ``get``, ``list`` and
``delete`` (requests already validated); the task engine calls ``register``
(a config sent inline with a message, before its run starts) and, at
shutdown, ``close``; the engine's registry of live tasks, which this service
listens to (``engine.ports.TaskListener``), calls ``revived`` (a parked task
came back into memory: its deliveries continue from their cursors),
``evicted`` (a parked task left memory) and ``forgotten`` (nothing of the
task is recorded any more). Deliveries run in the ``PushDispatcher``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from a2a.types.a2a_pb2 import TaskPushNotificationConfig

from ..config import ServerConfig
from ..errors import FrameNotKeptError, OwnerTimeoutError, OwnerUnavailableError
from ..journal import RecordedTask, StoreError
from ..log.tasklog import LogReader
from ..model import taskops
from ..model.caller import Caller
from ..model.names import TASK_PREFIX
from ..model.scope import principal_of
from ..obs.metrics import Metrics
from .configs import ConfigPage, MemoryPushConfigs, PushConfigNotFoundError, PushConfigStore, new_id
from .delivery import EndedSource, PushDispatcher
from .screen import Screen
from .sender import WebhookSender

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..engine.ports import TaskDirectory
    from ..execution.live import LiveTask

logger = logging.getLogger(__name__.replace("._internal", ""))

ALL_CONFIGS = 1_000
"""Page size used to read every config of a task (far above ``push_max_configs``)."""


def redacted(config: TaskPushNotificationConfig) -> TaskPushNotificationConfig:
    """``config`` as Get and List answer it: without its ``token`` and ``credentials``.

    Secrets are write-only (A2A #1681, #1988): whoever may read a task's
    configs must not harvest the credentials its webhooks are called with.
    The scheme stays, so a reader sees how the webhook is authenticated; to
    change a config, create it again with its secrets.
    """
    if not config.token and not config.authentication.credentials:
        return config
    shown = TaskPushNotificationConfig()
    shown.CopyFrom(config)
    shown.ClearField("token")
    if shown.HasField("authentication"):
        shown.authentication.ClearField("credentials")
    return shown


def screen_of(config: ServerConfig) -> Screen:
    """The push target policy ``config`` asks for."""
    return Screen(config.push_allow_private, config.push_allow_hosts)


class PushService:
    """Push notifications for one instance (see the module docstring).

    Args:
        tasks: Where the instance's tasks are looked up (``engine.registry.LiveTasks``).
        config: The server's settings (``push_*``).
        metrics: Where deliveries are counted.
        store: Where configs and cursors are kept (in memory if None).
    """

    def __init__(
        self,
        tasks: TaskDirectory,
        config: ServerConfig,
        metrics: Metrics,
        store: PushConfigStore | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        self._tasks = tasks
        self._cluster = cluster
        self._metrics = metrics
        self._most = config.push_max_configs
        self._quota = config.quota_push_configs
        self.screen = screen_of(config)
        self.store: PushConfigStore = store if store is not None else MemoryPushConfigs()
        self.dispatcher = PushDispatcher(
            self.store,
            WebhookSender(
                self.screen, config.push_timeout, config.push_max_in_flight, config.push_ca_file
            ),
            metrics,
            retry_for=config.push_retry_for,
            max_in_flight=config.push_max_in_flight,
            max_in_flight_per_caller=config.quota_push_in_flight,
        )
        self._resuming: set[asyncio.Task[None]] = set()
        self._forget_later: set[str] = set()
        """Tasks the journal dropped whose deliveries still run."""
        self.dispatcher.on_task_done = self._task_done

    async def create(
        self, config: TaskPushNotificationConfig, scope: str
    ) -> TaskPushNotificationConfig:
        """Keep a config for an existing task; its webhook gets every frame from now on.

        Args:
            config: The config (an id is assigned when it has none).
            scope: The caller's scope (see ``scope``).

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
            PushConfigLimitError: The task has ``push_max_configs`` other configs.
        """
        tasks = self._tasks
        recorded = await tasks.recorded(config.task_id, scope)
        if not config.id:
            config.id = new_id()
        live = tasks.live_task(config.task_id)
        if live is not None and not live.log.closed:
            await self.register(live, config)
            return config
        # Ended, parked out of memory (its deliveries resume with it), or run by
        # another instance, which is asked to deliver it.
        caller = (principal_of(recorded.scope), self._quota)
        await self.store.put(config, self._most, recorded.seq, recorded.owner, caller)
        if tasks.owned_elsewhere(recorded) and not taskops.is_final(recorded.task):
            assert self._cluster is not None
            try:
                await self._cluster.push(recorded, config.id, Caller((), None))
            except (OwnerUnavailableError, OwnerTimeoutError) as exc:
                # Kept: if the owner is gone, the survivor that ends the task delivers it.
                logger.warning(
                    "push config %s of task %s: its owner was not told (%s)",
                    config.id,
                    config.task_id,
                    exc,
                )
        return config

    async def follow_stored(self, task_id: str, config_id: str) -> None:
        """Deliver a config another instance stored for a task of this one, from its cursor.

        The task may have ended since the config was stored: then what its
        webhook had not got is read back from the journal, the final frame last.
        """
        config = await self.store.get(task_id, config_id)
        cursor = await self.store.cursor(task_id, config_id)
        if config is None or cursor is None:
            return
        live = self._tasks.live_task(task_id)  # (read after the awaits above)
        if live is not None:
            self.dispatcher.follow(live, config, cursor)
            return
        recorded = await self._tasks.recorded(task_id)
        if taskops.is_final(recorded.task):
            await self.deliver_ended(recorded, config, cursor)
        # else: parked out of memory; its deliveries resume when it comes back

    async def deliver_ended(
        self, final: RecordedTask, config: TaskPushNotificationConfig, cursor: int
    ) -> None:
        """Deliver an ended task's frames after ``cursor`` (then the final one) to ``config``."""
        if cursor >= final.seq:
            return
        reader: LogReader | None = None
        cluster = self._cluster
        if cluster is not None:
            try:
                reader = await cluster.replay(final, cursor)
            except (FrameNotKeptError, StoreError):
                reader = None  # the event log no longer has them: the final task instead
        self.dispatcher.deliver(EndedSource(final.task, final.seq, final.scope), config, reader)

    async def register(self, live: LiveTask, config: TaskPushNotificationConfig) -> None:
        """Keep ``config`` and start delivering the task's frames after the current one.

        Raises:
            PushConfigLimitError: As for ``create``.
        """
        if not config.id:
            config.id = new_id()
        config.task_id = live.task_id
        after = live.log.last_seq
        cluster = self._cluster
        deliverer = cluster.instance_id if cluster else ""
        caller = (principal_of(live.scope), self._quota)
        await self.store.put(config, self._most, after, deliverer, caller)
        self.dispatcher.follow(live, config, after)

    async def get(self, task_id: str, config_id: str, scope: str) -> TaskPushNotificationConfig:
        """One config of an existing task of ``scope``, its secrets left out (``redacted``).

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
            PushConfigNotFoundError: The task has no such config.
        """
        await self._tasks.recorded(task_id, scope)
        config = await self.store.get(task_id, config_id)
        if config is None:
            raise PushConfigNotFoundError(task_id, config_id)
        return redacted(config)

    async def list(self, task_id: str, page_size: int, page_token: str, scope: str) -> ConfigPage:
        """One page of the configs of an existing task of ``scope``, oldest first, redacted.

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
            InvalidFieldError: A page token this server did not issue.
        """
        await self._tasks.recorded(task_id, scope)
        page = await self.store.list(task_id, page_size, page_token)
        return ConfigPage([redacted(c) for c in page.configs], page.next_token)

    async def delete(self, task_id: str, config_id: str, scope: str) -> None:
        """Forget a config of a task of ``scope`` and stop its delivery (none: no error).

        Raises:
            TaskNotFoundError: No such task (or it is another scope's).
        """
        await self._tasks.recorded(task_id, scope)
        self.dispatcher.stop(task_id, config_id)
        self._metrics.push_failing.discard((task_id, config_id))
        await self.store.delete(task_id, config_id)

    def revived(self, live: LiveTask) -> None:
        """A parked task is back in memory: continue its deliveries from their cursors."""
        task = asyncio.create_task(self._resume(live), name=f"{TASK_PREFIX}:push-resume")
        self._resuming.add(task)
        task.add_done_callback(self._resuming.discard)

    async def _resume(self, live: LiveTask) -> None:
        try:
            page = await self.store.list(live.task_id, ALL_CONFIGS, "")
            for config in page.configs:
                cursor = await self.store.cursor(live.task_id, config.id)
                evicted = not live.log.closed and self._tasks.live_task(live.task_id) is not live
                if evicted:
                    return  # it left memory again meanwhile: a later revival resumes these
                if cursor is not None:
                    self.dispatcher.follow(live, config, cursor)
        except Exception:
            logger.exception("task %s: its push deliveries could not resume", live.task_id)

    def evicted(self, task_id: str) -> None:
        """A parked task left memory: stop its deliveries (their cursors are kept)."""
        self.dispatcher.stop_task(task_id)

    def forgotten(self, task_id: str) -> None:
        """The task is gone (the journal dropped it, or it was never recorded): its configs go too.

        Once its deliveries have ended: one still retrying the final frame goes
        on (it holds what it needs) and ends with it.
        """
        if self.dispatcher.following(task_id):
            self._forget_later.add(task_id)
        else:
            self.store.forget(task_id)

    def _task_done(self, task_id: str) -> None:
        if task_id in self._forget_later:
            self._forget_later.discard(task_id)
            self.store.forget(task_id)
        failing = self._metrics.push_failing
        if failing:
            for key in [key for key in failing if key[0] == task_id]:
                failing.discard(key)

    async def wait_ended(self) -> None:
        """Wait until every delivery that was asked to end has ended."""
        await self.dispatcher.wait_ended()

    async def close(self, deadline: float | None) -> None:
        """Give deliveries until ``deadline`` (loop time) to deliver what they have."""
        for task in list(self._resuming):
            task.cancel()
        await self.dispatcher.close(deadline)

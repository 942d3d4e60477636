"""Quotas per principal: what one caller may hold on this instance at once.

Each quota is a ``ServerConfig`` setting (0 turns it off) and is counted
per instance (in cluster mode, each instance counts what it serves):

* live tasks (``quota_live_tasks``) and tasks waiting for input
  (``quota_parked_tasks``) of one principal: checked before a new task is
  made; a follow-up to a task the principal already holds is never refused;
* open streams of one principal (``quota_streams``): checked before a stream
  call does anything;
* SubscribeToTask streams of one task (``quota_subscribers``).

A refused call answers RESOURCE_EXHAUSTED with an ErrorInfo whose reason
names the quota; it changes nothing, and no other principal notices. Without
an authenticator every caller is the one anonymous principal, so the quotas
act as limits of the whole instance.

Who runs what: everything here runs on the event loop, synchronously.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from ..config import ServerConfig
from ..errors import (  # re-exported: the error tree lives in errors
    QuotaExceededError as QuotaExceededError,
)


class Quotas:
    """Counts what each principal holds and refuses what would exceed a quota.

    Args:
        config: The quotas (``quota_*``).
    """

    def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self.live: Counter[str] = Counter()
        """Live tasks per principal (kept by the engine's ``LiveTasks``)."""
        self._streams: Counter[str] = Counter()

    def check_new_task(self, principal: str, parked: int) -> None:
        """Before a new task of ``principal``, who has ``parked`` tasks waiting for input.

        Raises:
            QuotaExceededError: LIVE_TASKS_QUOTA or PARKED_TASKS_QUOTA.
        """
        config = self._config
        most = config.quota_live_tasks
        if most and self.live[principal] >= most:
            raise QuotaExceededError(
                "LIVE_TASKS_QUOTA", "quota_live_tasks", most, "live tasks of one caller"
            )
        most = config.quota_parked_tasks
        if most and parked >= most:
            raise QuotaExceededError(
                "PARKED_TASKS_QUOTA",
                "quota_parked_tasks",
                most,
                "tasks of one caller waiting for input",
            )

    def check_subscribers(self, subscribers: int) -> None:
        """Before another SubscribeToTask of a task that has ``subscribers``.

        Raises:
            QuotaExceededError: SUBSCRIBERS_QUOTA.
        """
        most = self._config.quota_subscribers
        if most and subscribers >= most:
            raise QuotaExceededError(
                "SUBSCRIBERS_QUOTA", "quota_subscribers", most, "subscribers of one task"
            )

    @contextlib.contextmanager
    def stream(self, principal: str) -> Iterator[None]:
        """Count a stream of ``principal`` while the block runs.

        Raises:
            QuotaExceededError: STREAMS_QUOTA (the block does not run).
        """
        most = self._config.quota_streams
        if most and self._streams[principal] >= most:
            raise QuotaExceededError(
                "STREAMS_QUOTA", "quota_streams", most, "open streams of one caller"
            )
        self._streams[principal] += 1
        try:
            yield
        finally:
            self._streams[principal] -= 1
            if not self._streams[principal]:
                del self._streams[principal]

    def task_added(self, principal: str) -> None:
        """A task of ``principal`` became live here."""
        self.live[principal] += 1

    def task_removed(self, principal: str) -> None:
        """A task of ``principal`` stopped being live here (ended, or left memory)."""
        self.live[principal] -= 1
        if self.live[principal] <= 0:
            del self.live[principal]

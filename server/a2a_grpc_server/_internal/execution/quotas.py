"""Quotas per principal, and limits of the instance shared fairly among principals.

Each quota is a ``ServerConfig`` setting (0 turns it off) and is counted
per instance (in cluster mode, each instance counts what it serves):

* live tasks (``quota_live_tasks``) and tasks waiting for input
  (``quota_parked_tasks``) of one principal: checked before a new task is
  made; a follow-up to a task the principal already holds is never refused;
  with the in-memory journal the parked-task bounds are checked again when
  a task asks for input (``check_waiting``: past one, it ends FAILED);
* open streams of one principal (``quota_streams``): checked before a stream
  call does anything; a waiting long-poll (GetTask with v1.1's
  ``current_generation``) is one of them while it waits;
* SubscribeToTask streams of one task (``quota_subscribers``), and, apart
  from them, as many waiting long-polls of one task: a poll never takes a
  subscriber's place, and one past its task's slots is answered at once (a
  plain GetTask), holding nothing.

Beside them, limits of the whole instance: live tasks (``max_live_tasks``),
open streams (``max_streams``, long-polls included) and tasks waiting for input
(``max_parked_tasks``, see ``parking``). One principal, or a few, within
their quotas could still take all of one; so once half of a limit is taken
(*contended*), a named principal gets no more than its *fair share*: the
other half split evenly among the principals holding some (itself
included), ``limit // (2 * holders)``. Past it, its new task or stream is
refused (``*_FAIR_SHARE``) while a principal below its share (a newcomer
holds none) still gets in, up to the limit itself (``*_LIMIT``). Nothing
held is taken back. The anonymous principal (no authenticator: every
caller) is not held to a share: it is the whole instance.

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
from typing import TYPE_CHECKING

from ..config import ServerConfig
from ..errors import ParkedTasksLimitError
from ..errors import (  # re-exported: the error tree lives in errors
    QuotaExceededError as QuotaExceededError,
)

if TYPE_CHECKING:
    from .parking import ParkingLot


class Quotas:
    """Counts what each principal holds and refuses what would exceed a quota.

    Args:
        config: The quotas (``quota_*``).
    """

    def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self.live: Counter[str] = Counter()
        """Live tasks per principal (kept by the engine's ``LiveTasks``)."""
        self.live_total = 0
        """Live tasks on this instance."""
        self._streams: Counter[str] = Counter()
        self.streams_total = 0
        """Open streams on this instance (waiting long-polls included)."""
        self._polls: Counter[str] = Counter()
        self.polls_total = 0
        """Long-polls waiting on this instance (each is one of ``streams_total`` too)."""

    def check_new_task(self, principal: str, parking: ParkingLot) -> None:
        """Before a new task of ``principal`` (``parking``: the tasks waiting for input).

        Raises:
            QuotaExceededError: LIVE_TASKS_QUOTA, PARKED_TASKS_QUOTA, or the
                instance's LIVE_TASKS_LIMIT or a fair share of a limit.
        """
        config = self._config
        most = config.quota_live_tasks
        if most and self.live[principal] >= most:
            raise QuotaExceededError(
                "LIVE_TASKS_QUOTA", "quota_live_tasks", most, "live tasks of one caller"
            )
        parked = parking.count_of(principal)
        _check_parked_quota(config.quota_parked_tasks, parked)
        self.check_live_limit(principal)  # (the instance's limit and fair share alike)
        if not parking.durable:  # (durable: a parked task leaves memory instead, see parking)
            _check_parked_share(principal, parked, parking)

    def check_waiting(self, principal: str, parking: ParkingLot) -> None:
        """Before a task of ``principal`` starts waiting for input (it is not counted yet).

        The same bounds as for a new task, checked again when a task asks
        for input (tasks that park later would otherwise overshoot them):
        the caller's quota, the instance's ``max_parked_tasks`` and the
        fair share of it. Only for the in-memory journal (``parking.durable``
        is False): in cluster mode a waiting task leaves memory instead.

        Raises:
            QuotaExceededError: PARKED_TASKS_QUOTA or PARKED_TASKS_FAIR_SHARE.
            ParkedTasksLimitError: The instance holds ``max_parked_tasks``.
        """
        parked = parking.count_of(principal)
        _check_parked_quota(self._config.quota_parked_tasks, parked)
        if parking.most and parking.count >= parking.most:
            raise ParkedTasksLimitError(parking.most)
        _check_parked_share(principal, parked, parking)

    def check_live_limit(self, principal: str) -> None:
        """Before a new task of ``principal``, or a follow-up that brings one back into memory.

        The caller's own quota never refuses a follow-up, but the instance's
        limit and its fair share do (tasks that left memory count nowhere: a
        caller could otherwise park thousands and bring them all back at once).

        Raises:
            QuotaExceededError: LIVE_TASKS_LIMIT or LIVE_TASKS_FAIR_SHARE.
        """
        limit = self._config.max_live_tasks
        if limit and self.live_total >= limit:
            raise QuotaExceededError(
                "LIVE_TASKS_LIMIT", "max_live_tasks", limit, "live tasks on this instance"
            )
        share = _share(principal, self.live[principal], self.live_total, limit, len(self.live))
        if share is not None:
            raise QuotaExceededError(
                "LIVE_TASKS_FAIR_SHARE",
                "max_live_tasks",
                share,
                "live tasks of one caller while this instance is busy (a fair share)",
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
            QuotaExceededError: STREAMS_QUOTA, STREAMS_LIMIT or STREAMS_FAIR_SHARE
                (the block does not run).
        """
        self._check_stream(principal)
        self._count_stream(principal, 1)
        try:
            yield
        finally:
            self._count_stream(principal, -1)

    @contextlib.contextmanager
    def long_poll(self, principal: str, task_id: str) -> Iterator[bool]:
        """Count a long-poll of ``principal`` on ``task_id`` while the block runs.

        The block gets whether the poll has a slot of the task's
        (``quota_subscribers`` of them, apart from its subscribers'). With
        one, the poll counts as a stream of ``principal`` (checked as
        ``stream`` is); without, it counts nowhere and is to answer at once.
        Checked and counted in one step, with no wait between: however many
        arrive together, no bound is overshot.

        Raises:
            QuotaExceededError: As ``stream`` (the block does not run).
        """
        most = self._config.quota_subscribers
        if most and self._polls[task_id] >= most:
            yield False
            return
        self._check_stream(principal)
        self._count_stream(principal, 1)
        self._polls[task_id] += 1
        self.polls_total += 1
        try:
            yield True
        finally:
            self.polls_total -= 1
            self._polls[task_id] -= 1
            if not self._polls[task_id]:
                del self._polls[task_id]
            self._count_stream(principal, -1)

    def _check_stream(self, principal: str) -> None:
        config = self._config
        held = self._streams[principal]
        most = config.quota_streams
        if most and held >= most:
            raise QuotaExceededError(
                "STREAMS_QUOTA",
                "quota_streams",
                most,
                "open streams and long-polls of one caller",
            )
        limit = config.max_streams
        if limit and self.streams_total >= limit:
            raise QuotaExceededError(
                "STREAMS_LIMIT",
                "max_streams",
                limit,
                "open streams and long-polls on this instance",
            )
        share = _share(principal, held, self.streams_total, limit, len(self._streams))
        if share is not None:
            raise QuotaExceededError(
                "STREAMS_FAIR_SHARE",
                "max_streams",
                share,
                "open streams and long-polls of one caller while this instance is busy "
                "(a fair share)",
            )

    def _count_stream(self, principal: str, change: int) -> None:
        self._streams[principal] += change
        self.streams_total += change
        if not self._streams[principal]:
            del self._streams[principal]

    def task_added(self, principal: str) -> None:
        """A task of ``principal`` became live here."""
        self.live[principal] += 1
        self.live_total += 1

    def task_removed(self, principal: str) -> None:
        """A task of ``principal`` stopped being live here (ended, or left memory)."""
        self.live[principal] -= 1
        self.live_total -= 1
        if self.live[principal] <= 0:
            del self.live[principal]


def _check_parked_quota(most: int, parked: int) -> None:
    if most and parked >= most:
        raise QuotaExceededError(
            "PARKED_TASKS_QUOTA",
            "quota_parked_tasks",
            most,
            "tasks of one caller waiting for input",
        )


def _check_parked_share(principal: str, parked: int, parking: ParkingLot) -> None:
    share = _share(principal, parked, parking.count, parking.most, parking.holders)
    if share is not None:
        raise QuotaExceededError(
            "PARKED_TASKS_FAIR_SHARE",
            "max_parked_tasks",
            share,
            "tasks of one caller waiting for input while this instance is busy (a fair share)",
        )


def _share(principal: str, held: int, total: int, limit: int, holders: int) -> int | None:
    """``principal``'s fair share of ``limit`` if it holds that much already, else None.

    Only while the limit is contended (half of it taken), and never for the
    anonymous principal (see the module docstring). ``holders`` counts the
    principals holding some (``principal`` is counted if it holds none yet).
    """
    if not limit or not principal or total < limit // 2:
        return None
    share = max(1, limit // (2 * (holders + (0 if held else 1))))
    return share if held >= share else None

"""Mailbox: the bounded FIFO between a task's event sources and its consumer.

``asyncio.Queue`` allocates three deques up front (over 2 KB); a parked task
keeps its run's queue for as long as it waits, empty. A mailbox allocates its
buffer on the first put and drops it when it drains, and makes a waiter
future only when a putter has to wait.

Who runs what: any number of putters (the executor's ``execute()`` and
``cancel()``, and the run's end markers); one reader (the run's consumer),
which never waits on the mailbox: it is started when something is put and
ends when it has drained it (``supervisor.Run``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """A bounded FIFO with one reader.

    Args:
        maxsize: Items held before ``put`` waits.
    """

    __slots__ = ("_items", "_maxsize", "_putters")

    def __init__(self, maxsize: int) -> None:
        self._maxsize = maxsize
        self._items: deque[T] | None = None
        self._putters: deque[asyncio.Future[None]] | None = None

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else 0

    def empty(self) -> bool:
        """Whether nothing is waiting to be read."""
        return not self._items

    async def put(self, item: T) -> None:
        """Append ``item``, first waiting while the mailbox is full (FIFO among putters)."""
        while len(self) >= self._maxsize:
            waiter = asyncio.get_running_loop().create_future()
            if self._putters is None:
                self._putters = deque()
            self._putters.append(waiter)
            try:
                await waiter
            except BaseException:
                if not waiter.done() or waiter.cancelled():
                    self._discard_putter(waiter)
                elif len(self) < self._maxsize:
                    self._wake_putter()  # it was woken for a slot it will not use
                raise
        if self._items is None:
            self._items = deque()
        self._items.append(item)

    def peek(self) -> T:
        """The oldest item, left in place.

        Raises:
            IndexError: The mailbox is empty.
        """
        if not self._items:
            raise IndexError("peek into an empty mailbox")
        return self._items[0]

    def get_nowait(self) -> T:
        """Remove and return the oldest item.

        Raises:
            IndexError: The mailbox is empty.
        """
        if not self._items:
            raise IndexError("get_nowait from an empty mailbox")
        item = self._items.popleft()
        if not self._items:
            self._items = None  # a drained mailbox holds no buffer
        self._wake_putter()
        return item

    def _wake_putter(self) -> None:
        while self._putters:
            waiter = self._putters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break
        if not self._putters:
            self._putters = None

    def _discard_putter(self, waiter: asyncio.Future[None]) -> None:
        if self._putters is not None and waiter in self._putters:
            self._putters.remove(waiter)
            if not self._putters:
                self._putters = None

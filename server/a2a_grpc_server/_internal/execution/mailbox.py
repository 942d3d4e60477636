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
    """A FIFO with one reader, bounded by items and by bytes.

    Args:
        maxsize: Items held before ``put`` waits.
        max_bytes: Bytes held (as each ``put`` declares them) before ``put``
            waits; one item larger than this still goes through alone.
    """

    __slots__ = ("_bytes", "_items", "_max_bytes", "_maxsize", "_putters", "_sizes")

    def __init__(self, maxsize: int, max_bytes: int = 1 << 62) -> None:
        self._maxsize = maxsize
        self._max_bytes = max_bytes
        self._bytes = 0
        self._items: deque[T] | None = None
        self._sizes: deque[int] | None = None
        self._putters: deque[asyncio.Future[None]] | None = None

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else 0

    def empty(self) -> bool:
        """Whether nothing is waiting to be read."""
        return not self._items

    @property
    def bytes(self) -> int:
        """Bytes held (the sizes the held items were put with)."""
        return self._bytes

    def _full(self, size: int) -> bool:
        held = len(self)
        return held >= self._maxsize or (held > 0 and self._bytes + size > self._max_bytes)

    async def put(self, item: T, size: int = 0) -> None:
        """Append ``item`` of ``size`` bytes, first waiting while it does not fit (FIFO)."""
        while self._full(size):
            waiter = asyncio.get_running_loop().create_future()
            if self._putters is None:
                self._putters = deque()
            self._putters.append(waiter)
            try:
                await waiter
            except BaseException:
                if not waiter.done() or waiter.cancelled():
                    self._discard_putter(waiter)
                elif not self._full(0):
                    self._wake_putter()  # it was woken for a slot it will not use
                raise
        if self._items is None:
            self._items, self._sizes = deque(), deque()
        assert self._sizes is not None
        self._items.append(item)
        self._sizes.append(size)
        self._bytes += size

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
        assert self._sizes is not None
        self._bytes -= self._sizes.popleft()
        if not self._items:
            self._items = self._sizes = None  # a drained mailbox holds no buffer
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

"""Ordered indexes for listing tasks newest update first, in time that follows the page.

``RevList`` holds the revisions of the tasks under one index key (a scope,
or a scope with a context, a state, or both), ascending. A write gives its
task the journal's next revision, which is greater than every revision
held, so it is appended; the task's old revision is removed from wherever
it was. Walking down from a page token's revision costs a bisection and
then one step per task returned, however many tasks the journal holds.

``Walk`` turns such a walk into a ``TaskPage``: it stops once the page is
full and one more match shows there is a next page, so a page costs what it
returns. A filter on the status timestamp ends the walk at the first task
whose "written" time is before it: a journal keeps that time, per write, at
least the write's clock and every status timestamp written up to then, so
no task written earlier can match. Such a page, and its count, cost what was
written since that time (all of it, once an executor has stamped a status
in the future).

Not thread-safe; the journals use these from one event loop, with no
``await`` between a walk's steps.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from . import PageTokens, TaskQuery

BLOCK = 512
"""Most revisions in one block of a ``RevList``."""

T = TypeVar("T")


class RevList:
    """Ascending integers kept in blocks: append the greatest, remove any, walk down."""

    __slots__ = ("_blocks", "_len", "_tops")

    def __init__(self) -> None:
        self._blocks: list[list[int]] = []
        self._tops: list[int] = []
        """The greatest revision of each block (what a bisection reads)."""
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, rev: int) -> None:
        """Append ``rev``, which is greater than every revision held."""
        if self._tops and rev <= self._tops[-1]:
            raise ValueError(f"revision {rev} is not above {self._tops[-1]}")
        if not self._blocks or len(self._blocks[-1]) >= BLOCK:
            self._blocks.append([rev])
            self._tops.append(rev)
        else:
            self._blocks[-1].append(rev)
            self._tops[-1] = rev
        self._len += 1

    def remove(self, rev: int) -> None:
        """Remove ``rev``.

        Raises:
            KeyError: ``rev`` is not held.
        """
        i = bisect_left(self._tops, rev)
        block = self._blocks[i] if i < len(self._blocks) else []
        j = bisect_left(block, rev)
        if j == len(block) or block[j] != rev:
            raise KeyError(rev)
        del block[j]
        if not block:
            del self._blocks[i]
            del self._tops[i]
        elif j == len(block):
            self._tops[i] = block[-1]
        self._len -= 1

    def below(self, before: int | None = None) -> Iterator[int]:
        """The revisions under ``before`` (all if None), greatest first."""
        if not self._blocks:
            return
        i = len(self._blocks) - 1 if before is None else bisect_left(self._tops, before)
        if i == len(self._blocks):
            i -= 1
        block = self._blocks[i]
        j = len(block) if before is None else bisect_left(block, before)
        while True:
            for k in range(j - 1, -1, -1):
                yield block[k]
            i -= 1
            if i < 0:
                return
            block = self._blocks[i]
            j = len(block)


class Walk(Generic[T]):
    """One page of a walk down an index, and how many tasks match in all.

    Args:
        query: The filters and the page wanted.
        mark: The journal kind page tokens are tagged with.
        tokens: The journal's page tokens.
    """

    def __init__(self, query: TaskQuery, mark: str, tokens: PageTokens) -> None:
        self.query, self._mark, self._tokens = query, mark, tokens
        token = query.page_token
        self.before = tokens.decode(token, mark, query.scope) if token else None
        """The revision the page starts under (None: the first page)."""

    def page(
        self,
        walk: Iterable[tuple[int, T]],
        written_ns: Callable[[T], int],
        status_ns: Callable[[T], int],
    ) -> tuple[list[tuple[int, T]], str, list[str]]:
        """Take one page from ``walk`` (``(revision, item)``, greatest first, under ``before``).

        Args:
            walk: The index's items under ``before``.
            written_ns: When an item was last written (ns since the epoch).
            status_ns: Its status timestamp.

        Returns:
            The page's items, the next page's token ("" for none), and the token
            after each item.
        """
        after = self.query.status_after_ns
        found: list[tuple[int, T]] = []
        more = False
        for rev, item in walk:
            if after and written_ns(item) < after:
                break
            if after and status_ns(item) < after:
                continue
            if len(found) == self.query.page_size:
                more = True
                break
            found.append((rev, item))
        scope = self.query.scope
        tokens = [self._tokens.encode(rev, self._mark, scope) for rev, _ in found]
        return found, tokens[-1] if more and tokens else "", tokens

    def count(
        self, walk: Iterable[T], written_ns: Callable[[T], int], status_ns: Callable[[T], int]
    ) -> int:
        """How many items of ``walk`` (greatest first, from the top) pass the status filter."""
        after = self.query.status_after_ns
        n = 0
        for item in walk:
            if written_ns(item) < after:
                break
            n += status_ns(item) >= after
        return n

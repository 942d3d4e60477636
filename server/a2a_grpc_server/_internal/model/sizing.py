"""TaskSize: a live task's serialized size, bounded by ``max_task_bytes``, and when to rebuild it.

A task grows in place (events are applied to the one ``Task`` message the
task keeps; a copy per event would make a long stream quadratic). Two things
follow, both tracked here at O(1) per event:

* **The bound.** Whatever the server accepts it must be able to store, send
  and replay: an event that could take the task past ``max_task_bytes`` is
  refused. ``bound`` is an upper bound of the task's size (the last exact
  size plus every event admitted since, each at its serialized size, which
  is at least what it adds); the exact size is computed only when the bound
  alone would refuse.
* **Rebuilding.** protobuf (upb) keeps a message and everything ever copied
  into it in one arena that only grows: a task whose artifact is replaced a
  thousand times keeps a thousand artifacts' worth of memory. When what was
  admitted since the last exact size exceeds that size (plus
  ``REBUILD_SLACK``), the exact size is taken again; if less than half of
  what was admitted stayed in the task, the task is copied into a fresh
  message (``should_rebuild``) and the old arena is freed. Each of these
  costs one pass over the task, and happens only after at least as many
  bytes were admitted: amortized O(1) per byte.
"""

from __future__ import annotations

from a2a.types.a2a_pb2 import Task
from a2a.utils.errors import InvalidAgentResponseError

REBUILD_SLACK = 64 * 1024
"""Bytes admitted beyond the task's size before its size is taken again."""


class TaskTooLargeError(InvalidAgentResponseError):
    """An event or a follow-up message would take the task past ``max_task_bytes``.

    Args:
        task_id: The task.
        size: The task's size now.
        adding: The size of what would be added.
        limit: ``max_task_bytes``.
        what: What would be added, e.g. "a TaskArtifactUpdateEvent".
    """

    def __init__(self, task_id: str, size: int, adding: int, limit: int, what: str) -> None:
        self.size, self.adding, self.limit = size, adding, limit
        super().__init__(
            f"{what} of {adding} bytes would take task {task_id} ({size} bytes) past "
            f"{limit} bytes, the most this server keeps per task (max_task_bytes)"
        )


class TaskSize:
    """Size bookkeeping of one live task (see the module docstring).

    Args:
        limit: ``max_task_bytes``.
        task: The task as it starts (None: not created yet).
    """

    __slots__ = ("bound", "exact", "limit")

    def __init__(self, limit: int, task: Task | None = None) -> None:
        self.limit = limit
        self.exact = task.ByteSize() if task is not None else 0
        """The task's size when last measured."""
        self.bound = self.exact
        """An upper bound of the task's size now."""

    def admit(self, task: Task, task_id: str, adding: int, what: str) -> None:
        """Count ``adding`` bytes about to be applied to ``task``, or refuse them.

        Raises:
            TaskTooLargeError: The task could pass the limit with them.
        """
        if self.bound + adding > self.limit:
            self.measure(task)
            if self.exact + adding > self.limit:
                raise TaskTooLargeError(task_id, self.exact, adding, self.limit, what)
        self.bound += adding

    def measure(self, task: Task) -> None:
        """Take the task's exact size (the bound becomes exact)."""
        self.exact = self.bound = task.ByteSize()

    def should_rebuild(self, task: Task) -> bool:
        """Whether ``task`` holds more dead bytes than live ones (after an admitted batch)."""
        if self.bound - self.exact <= self.exact + REBUILD_SLACK:
            return False
        admitted = self.bound - self.exact
        before = self.exact
        self.measure(task)
        return self.exact - before < admitted // 2

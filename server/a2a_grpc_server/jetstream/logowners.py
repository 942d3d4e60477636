"""Who runs a task of the task log (format 3): sweeps of a lost owner's tasks, releases, claims.

Step 2 of docs/decisions/0001-cluster-store-layout.md (issue 41), its second half;
``ownership`` does the same for the snapshot bucket's tasks.

A task's owner is the writer of its newest ``s`` (its ``A2a-Owner``; the empty
id: nobody). A release and a claim are each an ``s`` without changes, written at
the task's version (a compare-and-set like every write): released to nobody by
a survivor or by its owner at shutdown, claimed by whoever takes its next message.

The owners (``a2a.log.o.<owner token>``): an instance registers once before it
creates its first task in the log, and again every half ``task_ttl`` while it
creates more (the log keeps a registration as long as a task). Sweeps start
from them: nothing in the log names an instance's tasks more cheaply, and the
index nats-server keeps has no owner in its subjects (a claim must land on the
task's one entry). A lost owner's tasks are found from its own subjects
(stream info, ``a2a.log.t.*.<owner>.>``: what it wrote in the retention), then
each task's last message (``multi_last``, in chunks): those it still owns and
that have not ended. A sweep that finds none deletes the registrations it read
(by their positions: one written since stays).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence

from nats.aio.msg import Msg

from ..journal import (
    RecordedTask,
    Released,
    StoreError,
    VersionConflictError,
)
from ..model import taskops
from .conn import LOG_STREAM, LOG_SUBJECT
from .records import STREAM_SEQ
from .requests import JetStreamRequests
from .retry import Retry
from .tasklog import (
    FINAL,
    Logged,
    LogRead,
    TaskLog,
    Where,
    decode,
    fold,
    task_filter,
    token,
)

OWNERS = f"{LOG_SUBJECT}.o"
MULTI_LAST_TASKS = 100
"""Tasks whose last messages one ``multi_last`` asks for (it answers 1,024 at most)."""
SUBJECTS_PAGE = 100_000
"""Subjects one stream info answers at most (nats-server pages them)."""
RELEASE_ATTEMPTS = 2


class LogOwners:
    """Sweeps, releases and claims of the log's tasks, and this instance's registration.

    Args:
        requests: Lean requests on the connection.
        log: The task log.
        owner: This instance's id.
        retry: How long an operation retries through a NATS outage.
        task_ttl: How long the log keeps a message (a registration is renewed at half).
        stream: The log's stream.
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        log: TaskLog,
        owner: str,
        retry: Retry | None = None,
        task_ttl: float = 86_400.0,
        stream: str = LOG_STREAM,
    ) -> None:
        self._requests = requests
        self._log = log
        self._owner = owner
        self._retry = retry or Retry()
        self._renew_after = task_ttl / 2
        self._stream = stream
        self._registered = -float("inf")
        self._registering = asyncio.Lock()

    async def register(self) -> None:
        """Register this instance as an owner, unless it did within half ``task_ttl``.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if time.monotonic() - self._registered < self._renew_after:
            return
        async with self._registering:
            if time.monotonic() - self._registered < self._renew_after:
                return
            subject = f"{OWNERS}.{token(self._owner)}"
            await self._retry(
                lambda: self._requests.publish(
                    subject, self._owner.encode(), {}, self._retry.timeout
                ),
                "register as an owner of the task log",
            )
            self._registered = time.monotonic()

    async def owners(self) -> dict[str, builtins.list[int]]:
        """Every registered owner, with the positions of its registrations.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        found: dict[str, builtins.list[int]] = {}
        for subject in await self._subjects(f"{OWNERS}.*"):
            msgs = await self._get({"last_by_subj": subject})
            if msgs:
                found.setdefault(msgs[0].data.decode(), []).append(_pos(msgs[0]))
        return found

    async def unfinished_batches(
        self, lost: Callable[[str], bool], size: int
    ) -> AsyncGenerator[builtins.list[tuple[str, str]]]:
        """The unfinished tasks of the owners ``lost`` picks: (owner, task id), ``size`` at once.

        Each batch is read when the one before was taken (a sweep ends its tasks
        first). An owner found with none left is deregistered.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        for owner, registrations in (await self.owners()).items():
            if not lost(owner):
                continue
            left = 0
            candidates = await self._candidates(owner)
            for at in range(0, len(candidates), MULTI_LAST_TASKS):
                found = await self._still_owned(owner, candidates[at : at + MULTI_LAST_TASKS])
                left += len(found)
                for cut in range(0, len(found), size):
                    yield [(owner, task_id) for task_id in found[cut : cut + size]]
            if not left and lost(owner):
                await self._deregister(owner, registrations)

    async def _candidates(self, owner: str) -> builtins.list[str]:
        """The tasks ``owner`` wrote and did not end itself (its subjects, no ``f`` among them)."""
        kinds: dict[str, set[str]] = {}
        for subject in await self._subjects(f"{LOG_SUBJECT}.t.*.{token(owner)}.>"):
            tokens = subject.split(".")
            kinds.setdefault(tokens[3], set()).add(tokens[-1])
        return sorted(task for task, found in kinds.items() if FINAL not in found)

    async def _still_owned(self, owner: str, tasks: Sequence[str]) -> builtins.list[str]:
        """Those of ``tasks`` whose last message ``owner`` wrote, not a final one."""
        request = {"multi_last": [task_filter(t) for t in tasks], "batch": 4 * len(tasks) + 16}
        last: dict[str, Logged] = {}
        for msg in await self._get(request):
            logged = decode(msg)
            known = last.get(logged.task_id)
            if known is None or known.pos < logged.pos:
                last[logged.task_id] = logged
        mine = token(owner)
        return [
            t
            for t in tasks
            if (m := last.get(t)) is not None and m.owner_token == mine and m.kind != FINAL
        ]

    async def _deregister(self, owner: str, registrations: Sequence[int]) -> None:
        """Delete ``owner``'s registrations read (a newer one, written since, stays)."""
        for seq in registrations:
            try:
                await self._retry(
                    lambda seq=seq: self._requests.api(  # type: ignore[misc]
                        f"$JS.API.STREAM.MSG.DELETE.{self._stream}",
                        json.dumps({"seq": seq, "no_erase": True}).encode(),
                        self._retry.timeout,
                    ),
                    f"deregister owner {owner}",
                )
            except StoreError:
                return  # (gone already, or NATS refused: the next sweep reads it again)

    async def release(self, task_id: str, owner: str) -> Released:
        """Record a waiting task of ``owner``'s as owned by nobody (see ``Ownership.release``).

        Returns:
            ``RELEASED``; ``MOVED_ON`` if it is not ``owner``'s any more (owned by
            another instance or nobody, ended, or written meanwhile twice);
            ``KEPT`` if it does not wait for input, or is not in the log.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        for _ in range(RELEASE_ATTEMPTS):
            read = await self._log.read(task_id)
            if read is None:
                return Released.KEPT
            if read.snapshot.owner != owner or read.final:
                return Released.MOVED_ON
            recorded = fold(read)
            if recorded.task.status.state not in taskops.INTERRUPTED:
                return Released.KEPT
            try:
                await self._write_owner(read, recorded, "")
            except VersionConflictError:
                continue  # written meanwhile (its owner's last frames, say): read it again
            return Released.RELEASED
        return Released.MOVED_ON

    async def claim(self, task_id: str) -> RecordedTask | None:
        """Take over a waiting task nobody owns (see ``Ownership.claim``).

        Returns:
            The task, now owned by this instance, at its new version; None if it is
            not a waiting task owned by nobody, or someone wrote it meanwhile.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        read = await self._log.read(task_id)
        if read is None or read.snapshot.owner or read.final:
            return None
        recorded = fold(read)
        if recorded.task.status.state not in taskops.INTERRUPTED:
            return None
        try:
            version = await self._write_owner(read, recorded, self._owner)
        except VersionConflictError:
            return None
        return RecordedTask(recorded.task, version, self._owner, recorded.seq, recorded.scope)

    async def _write_owner(self, read: LogRead, recorded: RecordedTask, owner: str) -> int:
        """An ``s`` without changes naming ``owner``, at the task's version."""
        task = recorded.task
        where = Where(task.id, owner, recorded.scope, task.context_id)
        return await self._log.append(where, [], task, read.version, seq=recorded.seq + 1)

    async def _subjects(self, subject: str) -> builtins.list[str]:
        """The log's subjects matching ``subject`` (stream info, paged)."""
        found: builtins.list[str] = []
        while True:
            body = json.dumps({"subjects_filter": subject, "offset": len(found)}).encode()
            info = await self._retry(
                lambda body=body: self._requests.api(  # type: ignore[misc]
                    f"$JS.API.STREAM.INFO.{self._stream}", body, self._retry.timeout
                ),
                "read the task log's subjects",
            )
            state = info.get("state")
            page = state.get("subjects") if isinstance(state, dict) else None
            if not isinstance(page, dict) or not page:
                return found
            found.extend(page)
            total = info.get("total")
            if not isinstance(total, int) or len(found) >= total:
                return found

    async def _get(self, request: dict[str, object]) -> builtins.list[Msg]:
        return await self._retry(
            lambda: self._requests.direct_get(self._stream, request, self._retry.timeout),
            "read the task log",
        )


def _pos(msg: Msg) -> int:
    return int((msg.headers or {})[STREAM_SEQ])

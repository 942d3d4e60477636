"""Who runs a task of the task log (format 3): sweeps of a lost owner's tasks, releases, claims.

Step 2 of docs/decisions/0001-cluster-store-layout.md (issue 41), its second half;
``ownership`` does the same for the snapshot bucket's tasks.

A task's owner is the writer of its newest ``s`` (its ``A2a-Owner``; the empty
id: nobody). A release and a claim are each an ``s`` without changes, written at
the task's version (a compare-and-set like every write): released to nobody by
a survivor or by its owner at shutdown, claimed by whoever takes its next message.

The owners (``a2a.log.o.<owner token>``): an instance registers once before it
creates its first task in the log (``Nats-TTL: never``: kept past the log's age
limit, until a sweep deregisters it), and again after its heartbeats stopped for
longer than a lease (``renew``: others may have swept and deregistered it).
Sweeps start from them: nothing in the log names an instance's tasks more
cheaply, and the index nats-server keeps has no owner in its subjects (a claim
must land on the task's one entry). A lost owner's tasks are found from its own
subjects (stream info of its ``s`` and ``f`` subjects: a sweep costs what the owner
snapshotted in the retention, not only what it left unfinished, and holds
those subjects in memory), less those it ended itself, then each remaining
task's last message: those it still owns and that have not ended. A sweep
that finds none purges the registrations up to the newest it read (one written
since stays).
"""

from __future__ import annotations

import asyncio
import builtins
import json
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
from .requests import JetStreamRequests
from .requests import position as _pos
from .retry import Retry
from .tasklog import (
    FINAL,
    Logged,
    LogRead,
    TaskLog,
    Where,
    fold,
    token,
)

OWNERS = f"{LOG_SUBJECT}.o"
LAST_CONCURRENCY = 16
"""Tasks whose last message a sweep reads at once."""
RELEASE_ATTEMPTS = 2
TTL = "Nats-TTL"


class LogOwners:
    """Sweeps, releases and claims of the log's tasks, and this instance's registration.

    Args:
        requests: Lean requests on the connection.
        log: The task log.
        owner: This instance's id.
        retry: How long an operation retries through a NATS outage.
        stream: The log's stream.
    """

    def __init__(
        self,
        requests: JetStreamRequests,
        log: TaskLog,
        owner: str,
        retry: Retry | None = None,
        stream: str = LOG_STREAM,
    ) -> None:
        self._requests = requests
        self._log = log
        self._owner = owner
        self._retry = retry or Retry()
        self._stream = stream
        self._registered = False
        self._registering = asyncio.Lock()

    async def register(self) -> None:
        """Register this instance as an owner, once per process (see the module docstring).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if self._registered or not self._owner:
            return  # (nobody, a filler's empty id, is never lost: nothing to sweep)
        async with self._registering:
            if not self._registered:
                await self._publish_registration()
                self._registered = True

    async def renew(self) -> None:
        """Register again if this process did (after a gap in its heartbeats).

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        if self._registered:
            async with self._registering:
                await self._publish_registration()

    async def _publish_registration(self) -> None:
        subject = f"{OWNERS}.{token(self._owner)}"
        await self._retry(
            lambda: self._requests.publish(
                subject, self._owner.encode(), {TTL: "never"}, self._retry.timeout
            ),
            "register as an owner of the task log",
        )

    async def owners(self) -> dict[str, builtins.list[int]]:
        """Every registered owner, with the position of its newest registration.

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
        first). An owner found with none left is deregistered. Nobody (the empty
        id) is never lost: its tasks were released and wait for a claim.

        Raises:
            StoreUnavailableError: NATS did not answer.
        """
        for owner, registrations in (await self.owners()).items():
            if not owner or not lost(owner):
                continue  # (nobody's tasks wait for a claim: never lost)
            left = 0
            candidates = await self._candidates(owner)
            for at in range(0, len(candidates), size):
                found = await self._still_owned(owner, candidates[at : at + size])
                left += len(found)
                if found:
                    yield [(owner, task_id) for task_id in found]
            if not left and lost(owner):
                await self._deregister(owner, max(registrations))

    async def _candidates(self, owner: str) -> builtins.list[str]:
        """The tasks ``owner`` snapshotted and did not end itself (its ``s`` and ``f`` subjects)."""
        mine = token(owner)
        began, ended = await asyncio.gather(
            self._subjects(f"{LOG_SUBJECT}.t.*.{mine}.*.*.s"),
            self._subjects(f"{LOG_SUBJECT}.t.*.{mine}.*.*.f"),
        )
        done = {subject.split(".")[3] for subject in ended}
        return sorted({subject.split(".")[3] for subject in began} - done)

    async def _still_owned(self, owner: str, tasks: Sequence[str]) -> builtins.list[str]:
        """Those of ``tasks`` whose last message ``owner`` wrote, not a final one.

        Each task's last message, ``LAST_CONCURRENCY`` at once (one request each: a
        ``multi_last`` answers at most what it is asked for, and a task has a
        subject per writer and kind, so a batch of them could be cut short unseen).
        """
        gate = asyncio.Semaphore(LAST_CONCURRENCY)

        async def last(task_id: str) -> Logged | None:
            async with gate:
                return await self._log.last(task_id)

        mine = token(owner)
        found = await asyncio.gather(*(last(t) for t in tasks))
        return [
            t
            for t, m in zip(tasks, found, strict=True)
            if m is not None and m.owner_token == mine and m.kind != FINAL
        ]

    async def _deregister(self, owner: str, newest: int) -> None:
        """Delete ``owner``'s registrations up to position ``newest`` (a later one stays)."""
        body = {"filter": f"{OWNERS}.{token(owner)}", "seq": newest + 1}
        try:
            await self._retry(
                lambda: self._requests.api(
                    f"$JS.API.STREAM.PURGE.{self._stream}",
                    json.dumps(body).encode(),
                    self._retry.timeout,
                ),
                f"deregister owner {owner}",
            )
        except StoreError:
            return  # (NATS refused: the next sweep reads it again)

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

"""Task journal: the durable record of every task and of each change to it.

``TaskJournal`` is the contract every backend implements; the contract tests
in ``tests/journal`` run against each implementation. The in-memory backend
is ``journal.memory.MemoryJournal``; on NATS JetStream it is
``jetstream.journal.JetStreamJournal``, where the task's event stream is the
record and a key-value bucket holds snapshots.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from a2a.types.a2a_pb2 import Message, Task, TaskState
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import (  # re-exported: the error tree lives in errors
    StoreError as StoreError,
)
from ..errors import (
    StoreRefusedError as StoreRefusedError,
)
from ..errors import (
    StoreUnavailableError as StoreUnavailableError,
)
from ..errors import quote


class TaskExistsError(StoreError):
    """``create`` was called for a task id the journal already holds."""


class VersionConflictError(StoreError):
    """``update`` was given a version that is not the stored one."""


class FinalTaskError(StoreError):
    """``update`` tried to change a task that is already final."""


class UnknownTaskError(StoreError):
    """``update`` named a task the journal does not hold."""


class PartialWriteError(StoreError):
    """A write of several changes recorded the first ``recorded`` of them, then failed.

    Args:
        recorded: How many changes, from the first, are recorded.
        version: The task's version after them.
    """

    def __init__(self, recorded: int, version: int) -> None:
        super().__init__(f"{recorded} change(s) recorded, then the write failed")
        self.recorded, self.version = recorded, version


class Released(enum.Enum):
    """What a release of a waiting task did (``JetStreamJournal.release``); true only if done."""

    RELEASED = "released"
    """Recorded as owned by nobody: the next message, through any instance, continues it."""
    MOVED_ON = "moved on"
    """Not this owner's any more: another instance owns it, nobody does, it ended, or it was
    written meanwhile. A copy of it in this owner's memory is out of date."""
    KEPT = "kept"
    """Left as it is, this owner's: its record does not show it waiting, or an instance of a
    version that cannot continue a task owned by nobody is in the cluster."""

    def __bool__(self) -> bool:
        return self is Released.RELEASED


@dataclass(frozen=True, slots=True)
class RecordedTask:
    """A task as the journal holds it.

    Attributes:
        task: The task.
        version: What the next ``update`` must name as its expected version.
        owner: The id of the instance that runs the task (single-instance
            journals leave it empty).
        seq: The number, in the task's log, of the last change it includes.
        scope: Whose task it is (see ``scope``): the key given to ``create``.
    """

    task: Task
    version: int
    owner: str = ""
    seq: int = 0
    scope: str = ""


class Change(NamedTuple):
    """What a write records beside the task itself: its place in the task's log.

    Attributes:
        seq: The change's number in the task's log (1 for a new task; no gap).
        frame: The serialized ``StreamResponse`` readers get for it; empty for
            a change without a frame (a follow-up user message).
        state: The ``TaskState`` the frame carries (0 for a frame without one).
        message: The follow-up user message a change without a frame records.
    """

    seq: int
    frame: bytes = b""
    state: int = 0
    message: Message | None = None


@dataclass(frozen=True, slots=True)
class TaskQuery:
    """Filters and paging of ``TaskJournal.list``.

    Attributes:
        context_id: Only tasks of this context ("" for any).
        state: Only tasks in this state (UNSPECIFIED for any).
        status_after_ns: Only tasks whose status timestamp is at or after this
            many nanoseconds since the epoch (0 for any).
        page_size: Most tasks to return.
        page_token: The ``next_page_token`` of the previous page ("" for the first).
        scope: Only tasks of this scope (see ``scope``; "" is the anonymous scope,
            not "any").
    """

    context_id: str = ""
    state: TaskState = TaskState.TASK_STATE_UNSPECIFIED
    status_after_ns: int = 0
    page_size: int = 50
    page_token: str = ""
    scope: str = ""

    def matches(self, context_id: str, state: TaskState, status_ns: int, scope: str) -> bool:
        """Whether a task with these fields passes the filters."""
        return (
            scope == self.scope
            and (not self.context_id or context_id == self.context_id)
            and self.state in (TaskState.TASK_STATE_UNSPECIFIED, state)
            and status_ns >= self.status_after_ns
        )


@dataclass(slots=True)
class TaskPage:
    """One page of ``TaskJournal.list``, newest update first."""

    tasks: list[Task] = field(default_factory=list)
    next_page_token: str = ""
    total_size: int = 0
    after: list[str] = field(default_factory=list)
    """For each task, the page token that continues right after it (a caller that
    answers only the first tasks of the page hands out the token after the last)."""


class InvalidPageTokenError(StoreError):
    """The page token was not issued by this journal."""


T = TypeVar("T")


def status_ns(task: Task) -> int:
    """The task's status timestamp in nanoseconds since the epoch."""
    ts = task.status.timestamp
    return int(ts.seconds) * 1_000_000_000 + int(ts.nanos)


class PageTokens:
    """Opaque page tokens, each good for the scope it was issued to only.

    A token holds the revision the next page starts before, a server-wide
    write counter that would tell a caller how much others wrote between two
    of its pages; so it is sealed with AES-256-GCM (``cryptography``), bound
    (as associated data) to its header, the journal kind and the caller's
    scope: another caller's token, or a changed one, is refused as a token
    this server never issued. Layout (base64url, 52 characters): version
    (``VERSION``), key id (1 byte), nonce (12, random), the revision sealed
    (8, and the 16-byte tag). A reader refuses a version it does not know.

    The key id is derived from the key, so every instance holding a key names
    it alike. A key is rotated by sealing with the new one while the old one
    is still given in ``previous`` (it opens what it sealed), then letting the
    old go: its tokens are then refused, as of a key this server no longer
    holds. Nonces are random: a key seals some 2**32 tokens (the NIST bound for
    random GCM nonces) before a repeated nonce is more likely than 1 in 2**32.

    Args:
        key: The 32-byte key tokens are sealed with (the same on every instance
            that serves one journal: in cluster mode, derived from the cluster
            key); a random one by default (one process).
        previous: Older keys whose tokens still open (none are sealed with them).

    Raises:
        ValueError: A key is not 32 bytes.
    """

    VERSION = 2
    """The format written and read (1, before AES-GCM, is refused)."""
    _HEADER = 2
    _NONCE = 12
    _LENGTH = _HEADER + _NONCE + 8 + 16
    _TEXT = re.compile(r"[A-Za-z0-9_-]{51}=")
    """A token's text (``_LENGTH`` bytes in base64url)."""

    def __init__(self, key: bytes | None = None, previous: Sequence[bytes] = ()) -> None:
        key = key if key is not None else secrets.token_bytes(32)
        for each in (key, *previous):
            if len(each) != 32:
                raise ValueError(f"a page token key is 32 bytes, not {len(each)}")
        self._sealer = AESGCM(key)
        self._header = bytes([self.VERSION, self.key_id(key)])
        self._openers: dict[int, list[AESGCM]] = {}
        for each in (key, *previous):
            self._openers.setdefault(self.key_id(each), []).append(AESGCM(each))

    @staticmethod
    def key_id(key: bytes) -> int:
        """The id tokens sealed with ``key`` carry (every instance derives it alike)."""
        return hashlib.sha256(b"a2a-grpc-server page token key id\0" + key).digest()[0]

    @staticmethod
    def bound(header: bytes, mark: str, scope: str) -> bytes:
        """The associated data a token with ``header`` is sealed with for ``mark`` and ``scope``."""
        marked, scoped = mark.encode(), scope.encode()
        return b"".join(
            (header, len(marked).to_bytes(4, "big"), marked, len(scoped).to_bytes(4, "big"), scoped)
        )

    def encode(self, rev: int, mark: str, scope: str) -> str:
        """The token of ``rev`` for ``scope``."""
        nonce = secrets.token_bytes(self._NONCE)
        sealed = self._sealer.encrypt(
            nonce, rev.to_bytes(8, "big"), self.bound(self._header, mark, scope)
        )
        return base64.urlsafe_b64encode(self._header + nonce + sealed).decode()

    def decode(self, token: str, mark: str, scope: str) -> int:
        """The revision ``token`` holds.

        Raises:
            InvalidPageTokenError: Not issued by this journal to ``scope``, of a
                version this one does not read, or sealed with a key it no
                longer holds.
        """
        data = base64.urlsafe_b64decode(token) if self._TEXT.fullmatch(token) else b""
        if len(data) != self._LENGTH or data[0] != self.VERSION:
            raise _not_issued(token)
        header, nonce, sealed = data[: self._HEADER], data[self._HEADER : 14], data[14:]
        openers = self._openers.get(header[1])
        if openers is None:
            raise InvalidPageTokenError(
                f"page_token {quote(token)} was sealed with a key this server no longer "
                f"holds; list again from the first page (omit page_token)"
            )
        for opener in openers:  # (two keys whose ids collide: each is tried)
            try:
                opened = opener.decrypt(nonce, sealed, self.bound(header, mark, scope))
            except InvalidTag:
                continue
            return int.from_bytes(opened, "big")
        raise _not_issued(token)


def _not_issued(token: str) -> InvalidPageTokenError:
    return InvalidPageTokenError(
        f"page_token {quote(token)} was not issued by this server to this caller; "
        f"list again from the first page (omit page_token)"
    )


_PROCESS_TOKENS = PageTokens()
"""For a journal that brings no ``PageTokens`` of its own (this process's key)."""


def paginate(
    matches: list[tuple[int, T]],
    query: TaskQuery,
    mark: str,
    to_task: Callable[[T], Task],
    tokens: PageTokens | None = None,
) -> TaskPage:
    """One page of ``(revision, item)`` matches, newest revision first.

    Page tokens hold the last revision of the previous page (``PageTokens``:
    opaque, good for ``query.scope`` only), tagged with ``mark`` so a token of
    one journal kind is refused by another.

    Raises:
        InvalidPageTokenError: ``query.page_token`` was not issued with ``mark``
            to ``query.scope``.
    """
    scope = query.scope
    tokens = tokens or _PROCESS_TOKENS
    before = tokens.decode(query.page_token, mark, scope) if query.page_token else None
    matches.sort(key=lambda m: m[0], reverse=True)
    page = [m for m in matches if before is None or m[0] < before][: query.page_size]
    remaining = page and any(rev < page[-1][0] for rev, _ in matches)
    return TaskPage(
        tasks=[to_task(item) for _, item in page],
        next_page_token=tokens.encode(page[-1][0], mark, scope) if remaining else "",
        total_size=len(matches),
        after=[tokens.encode(rev, mark, scope) for rev, _ in page],
    )


class TaskJournal(Protocol):
    """Where tasks live, change by change. Every write is a compare-and-set on the version.

    Each write records one or more consecutive changes: the task as it is
    after them, and each ``Change`` (its number in the task's log and its
    frame); a write that fails after recording some of them raises
    ``PartialWriteError``. Versions are non-negative integers; each write returns a
    greater one than the last (not necessarily the next integer: a shared
    journal may number writes across tasks).

    Implementations MUST keep the scope a task was created with through every
    write (whoever writes), MUST return copies (a caller mutating a returned task does
    not change the journal), MUST keep a final task unchanged once written,
    MUST return with ``get`` the ``seq`` of the last change written, and MUST
    be safe to call from concurrent coroutines of one event loop.

    Ownership: ``create`` and ``update`` take the task they are given. A
    journal MAY keep that object instead of copying it (the in-memory one
    does, so a write costs the same however large the task); the caller
    changes it afterwards only to build its next version and passes it to
    ``update`` with no ``await`` in between.
    """

    def scope_of(self, task_id: str) -> str | None:
        """The task's scope if the journal knows it without reading the task (else None).

        Lets a caller of another scope be answered NOT_FOUND before the task's
        body is read, in the time a missing task takes.
        """
        ...

    async def get(self, task_id: str) -> RecordedTask | None:
        """Return the task as last written, or None if the journal has no such task.

        Raises:
            StoreUnavailableError: The backend did not answer.
        """
        ...

    async def create(
        self, task: Task, changes: Sequence[Change], *, keep_frames: bool = True, scope: str = ""
    ) -> int:
        """Record a new task and return its version.

        ``scope`` is whose task it is: recorded with it, never changed, returned
        by ``get`` and filtered on by ``list``.

        ``changes`` start with the task itself (seq 1, its ``Task`` frame); any
        that follow were made before the first write; ``task`` is the task
        after all of them. With ``keep_frames`` False the task has ended in
        this write and no client can ask for its frames (none followed it, none
        holds a resume cursor): a journal MAY then record the task alone.

        Raises:
            TaskExistsError: A task with this id is already recorded.
            StoreUnavailableError: The backend did not answer.
        """
        ...

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        """Record ``changes`` if the task is still at ``expected_version``; return the new version.

        ``task`` is the task after them.

        Raises:
            UnknownTaskError: No task with this id is recorded.
            FinalTaskError: The recorded task is final; it is never changed.
            VersionConflictError: The recorded version is not ``expected_version``.
            PartialWriteError: The first changes were recorded, a later one was not
                (its ``__cause__`` says why).
            StoreUnavailableError: The backend did not answer.
        """
        ...

    async def list(self, query: TaskQuery) -> TaskPage:
        """Return one page of tasks matching ``query``, most recently updated first.

        Raises:
            InvalidPageTokenError: ``query.page_token`` is not one this journal issued.
            StoreUnavailableError: The backend did not answer.
        """
        ...

"""Push notification configs: their checks, and where they are kept beside their task.

A config is a client's webhook for one task (``TaskPushNotificationConfig``):
URL, optional token and authentication. ``check_config`` refuses a malformed
one before anything is stored; ``PushConfigStore`` keeps them, with each
config's *cursor* (the last frame its webhook confirmed), until the task's
retention ends or the client deletes them. ``MemoryPushConfigs`` is the
in-memory store (one instance); the JetStream store keeps them in the KV
bucket so that any instance can continue a delivery.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from a2a.types.a2a_pb2 import TaskPushNotificationConfig

from ..errors import InvalidFieldError, QuotaExceededError, quote
from ..errors import (  # re-exported: the error tree lives in errors
    PushConfigLimitError as PushConfigLimitError,
)
from ..errors import (
    PushConfigNotFoundError as PushConfigNotFoundError,
)
from ..model.names import MAX_ID_CHARS, MAX_TOKEN_CHARS
from .screen import RefusedTargetError, Screen

MAX_SECRET_CHARS = 4096
"""Longest token or credentials accepted (each travels as an HTTP header value)."""
HEADER_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An HTTP token (RFC 9110 §5.6.2): what an authentication scheme must be."""
UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
"""Characters a header value may not carry (CR and LF above all: header injection)."""


def check_config(config: TaskPushNotificationConfig, screen: Screen, prefix: str = "") -> None:
    """Refuse a malformed config (each error names its field).

    Args:
        config: The config as the client sent it (``task_id`` already set).
        screen: The push target policy.
        prefix: The field path of the config in its request (for inline configs).

    Raises:
        InvalidFieldError: A field is missing or malformed.
    """
    if len(config.id) > MAX_ID_CHARS:
        raise InvalidFieldError(f"{prefix}id", f"is longer than {MAX_ID_CHARS} characters")
    if not config.id.isprintable():
        raise InvalidFieldError(
            f"{prefix}id", "contains a control character (newline, NUL, ...); ids are printable"
        )
    if len(config.tenant) > MAX_ID_CHARS:
        raise InvalidFieldError(f"{prefix}tenant", f"is longer than {MAX_ID_CHARS} characters")
    if not config.url:
        raise InvalidFieldError(f"{prefix}url", "is required (the webhook's https URL)")
    try:
        screen.checked(config.url)
    except RefusedTargetError as exc:
        raise InvalidFieldError(f"{prefix}url", str(exc)) from None
    _check_header_value(f"{prefix}token", config.token)
    if config.HasField("authentication"):
        auth = config.authentication
        if not HEADER_TOKEN.fullmatch(auth.scheme):
            raise InvalidFieldError(
                f"{prefix}authentication.scheme",
                f"{quote(auth.scheme)} is not an HTTP authentication scheme (e.g. Bearer)",
            )
        if len(auth.scheme) > MAX_ID_CHARS:
            raise InvalidFieldError(f"{prefix}authentication.scheme", "is too long")
        _check_header_value(f"{prefix}authentication.credentials", auth.credentials)


def _check_header_value(field_name: str, value: str) -> None:
    if len(value) > MAX_SECRET_CHARS:
        raise InvalidFieldError(
            field_name, f"is {len(value)} characters; at most {MAX_SECRET_CHARS}"
        )
    if UNSAFE.search(value):
        raise InvalidFieldError(
            field_name, "contains a control character (CR, LF, ...); it is sent as a header"
        )
    if not value.isascii():
        raise InvalidFieldError(field_name, "must be ASCII; it is sent as an HTTP header")


def new_id() -> str:
    """A server-assigned config id."""
    return str(uuid.uuid4())


@dataclass(frozen=True, slots=True)
class ConfigPage:
    """One page of a task's configs.

    Attributes:
        configs: The configs, oldest first.
        next_token: The token of the next page ("" on the last).
    """

    configs: list[TaskPushNotificationConfig]
    next_token: str


class PushConfigStore(Protocol):
    """Where push configs and their cursors are kept (see the module docstring).

    A config is keyed by (task id, config id); ``put`` of an existing key
    replaces it and resets its cursor. Implementations return copies.
    """

    async def put(
        self,
        config: TaskPushNotificationConfig,
        most: int,
        seq: int,
        deliverer: str = "",
        caller: tuple[str, int] = ("", 0),
    ) -> None:
        """Keep ``config``; its webhook gets the frames after ``seq``.

        Args:
            config: The config.
            most: Most configs its task may have.
            seq: The last frame its webhook does not get.
            deliverer: The instance that delivers it (cluster mode: the task's owner).
            caller: The principal creating it, and the most configs one principal
                may keep (``quota_push_configs``; 0: no quota). The config counts
                against the principal until it is deleted or forgotten; replacing
                one (the same id) is not a new one.

        Raises:
            PushConfigLimitError: The task has ``most`` other configs already.
            QuotaExceededError: PUSH_CONFIGS_QUOTA.
        """
        ...

    async def get(self, task_id: str, config_id: str) -> TaskPushNotificationConfig | None:
        """The config, or None."""
        ...

    async def list(self, task_id: str, page_size: int, page_token: str) -> ConfigPage:
        """One page of the task's configs, oldest first.

        Raises:
            InvalidFieldError: ``page_token`` is not one this store issued.
        """
        ...

    async def delete(self, task_id: str, config_id: str) -> bool:
        """Forget a config and its cursor; whether it existed."""
        ...

    async def cursor(self, task_id: str, config_id: str) -> int | None:
        """The last frame the config's webhook confirmed (None: no such config)."""
        ...

    async def confirm(self, task_id: str, config_id: str, seq: int) -> bool:
        """Record that the webhook confirmed every frame up to ``seq``.

        Returns:
            Whether the config still exists (False: it was deleted; stop).
        """
        ...

    def forget(self, task_id: str) -> None:
        """Drop every config of a task the journal no longer keeps."""
        ...


@dataclass(slots=True)
class _Kept:
    config: TaskPushNotificationConfig
    number: int
    cursor: int


@dataclass(slots=True)
class _TaskConfigs:
    by_id: dict[str, _Kept] = field(default_factory=dict)
    made: int = 0


class MemoryPushConfigs:
    """A ``PushConfigStore`` in this process's memory (the in-memory journal's companion).

    Counts each principal's configs (``caller`` of ``put``): one caller's
    configs are bounded whatever the number of its tasks.
    """

    def __init__(self) -> None:
        self._tasks: dict[str, _TaskConfigs] = {}
        self._principal_of: dict[str, str] = {}
        """The principal whose configs a task's are (as ``put`` was told)."""
        self._per_principal: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(len(t.by_id) for t in self._tasks.values())

    async def put(
        self,
        config: TaskPushNotificationConfig,
        most: int,
        seq: int,
        deliverer: str = "",
        caller: tuple[str, int] = ("", 0),
    ) -> None:
        """Keep ``config`` (a copy); see ``PushConfigStore.put`` (one instance: no deliverer)."""
        kept = self._tasks.get(config.task_id)
        new = kept is None or config.id not in kept.by_id
        if new and kept is not None and len(kept.by_id) >= most:
            raise PushConfigLimitError(config.task_id, most)
        principal, quota = caller
        principal = self._principal_of.get(config.task_id, principal)
        if new and quota and self._per_principal[principal] >= quota:
            raise QuotaExceededError(
                "PUSH_CONFIGS_QUOTA", "quota_push_configs", quota, "push configs of one caller"
            )
        if kept is None:
            kept = self._tasks[config.task_id] = _TaskConfigs()
            self._principal_of[config.task_id] = principal
        if new:
            self._per_principal[principal] += 1
        copy = TaskPushNotificationConfig()
        copy.CopyFrom(config)
        old = kept.by_id.pop(config.id, None)
        kept.made += 1
        kept.by_id[config.id] = _Kept(copy, old.number if old else kept.made, seq)
        if old is not None:  # keep its place in the listing
            kept.by_id = dict(sorted(kept.by_id.items(), key=lambda item: item[1].number))

    async def get(self, task_id: str, config_id: str) -> TaskPushNotificationConfig | None:
        """The config, or None."""
        kept = self._tasks.get(task_id)
        entry = kept.by_id.get(config_id) if kept else None
        if entry is None:
            return None
        copy = TaskPushNotificationConfig()
        copy.CopyFrom(entry.config)
        return copy

    async def list(self, task_id: str, page_size: int, page_token: str) -> ConfigPage:
        """One page, oldest first; the token is the number of the last config listed."""
        after = decode_page_token(page_token)
        kept = self._tasks.get(task_id)
        entries = [e for e in (kept.by_id.values() if kept else ()) if e.number > after]
        page = entries[:page_size]
        configs = []
        for entry in page:
            copy = TaskPushNotificationConfig()
            copy.CopyFrom(entry.config)
            configs.append(copy)
        more = len(entries) > page_size
        return ConfigPage(configs, f"c{page[-1].number}" if more and page else "")

    async def delete(self, task_id: str, config_id: str) -> bool:
        """Forget a config; whether it existed."""
        kept = self._tasks.get(task_id)
        if kept is None or kept.by_id.pop(config_id, None) is None:
            return False
        self._count_out(task_id, 1)
        if not kept.by_id:
            del self._tasks[task_id]
            del self._principal_of[task_id]
        return True

    async def cursor(self, task_id: str, config_id: str) -> int | None:
        """The last frame confirmed, or None."""
        kept = self._tasks.get(task_id)
        entry = kept.by_id.get(config_id) if kept else None
        return entry.cursor if entry else None

    async def confirm(self, task_id: str, config_id: str, seq: int) -> bool:
        """Move the cursor forward (never back); whether the config still exists."""
        kept = self._tasks.get(task_id)
        entry = kept.by_id.get(config_id) if kept else None
        if entry is None:
            return False
        entry.cursor = max(entry.cursor, seq)
        return True

    def forget(self, task_id: str) -> None:
        """Drop the task's configs."""
        kept = self._tasks.pop(task_id, None)
        if kept is not None:
            self._count_out(task_id, len(kept.by_id))
            del self._principal_of[task_id]

    def _count_out(self, task_id: str, configs: int) -> None:
        principal = self._principal_of[task_id]
        self._per_principal[principal] -= configs
        if self._per_principal[principal] <= 0:
            del self._per_principal[principal]


def decode_page_token(token: str) -> int:
    """The creation number a page token of ours names (0 for none).

    Raises:
        InvalidFieldError: Not a token this server issued.
    """
    if not token:
        return 0
    if len(token) > MAX_TOKEN_CHARS or not token.startswith("c") or not token[1:].isdigit():
        raise InvalidFieldError(
            "page_token", f"{quote(token)} is not a token this server issued; omit it"
        )
    return int(token[1:])

"""WebhookSender: one POST of one frame to one webhook, and what came of it.

The request (documented in docs/how-to/push.md):

* body: the frame, a ``StreamResponse`` in ProtoJSON;
* ``Content-Type: application/a2a+json``, ``A2A-Version: 1.0``;
* ``Authorization: <scheme> <credentials>`` from the config's
  ``authentication``; the config's ``token`` in ``X-A2A-Notification-Token``;
* ``X-A2A-Task-Id`` and ``X-A2A-Sequence`` (the frame's number in the task's
  log, the same a resume-aware stream sees): a receiver drops a frame whose
  sequence number it already has, since delivery is at least once.

The connection goes to the address ``Screen.resolve`` checked (see
``screen``), over the pool of ``http1``; redirects are not followed; at most
64 KiB of the answer's body is read, and dropped (a longer, chunked or
close-delimited body closes the connection unread).
Outcomes: 2xx delivered; 408, 425, 429 and 5xx, timeouts and connection errors
are worth retrying (``Retry-After`` honoured); anything else is refused for
good (the frame is given up).
"""

from __future__ import annotations

import asyncio
import email.utils
import enum
import importlib.metadata
import ssl
import time
from dataclasses import dataclass

from a2a.types.a2a_pb2 import TaskPushNotificationConfig

from .http1 import MAX_BODY, Http1Pool, ProtocolError
from .screen import RefusedTargetError, Screen

CONTENT_TYPE = "application/a2a+json"
TASK_HEADER = "X-A2A-Task-Id"
SEQ_HEADER = "X-A2A-Sequence"
TOKEN_HEADER = "X-A2A-Notification-Token"
RETRIED_STATUSES = frozenset({408, 425, 429})
"""4xx answers worth retrying (besides every 5xx)."""
MAX_ANSWER_BYTES = MAX_BODY
"""Most bytes of a receiver's answer body read (and dropped); past it the connection closes."""
MAX_RETRY_AFTER = 3600.0
"""Longest ``Retry-After`` honoured, in seconds (a longer one waits this long)."""


class Outcome(enum.Enum):
    """What one attempt came to."""

    DELIVERED = "delivered"
    RETRY = "retry"
    """Worth trying again (timeout, connection error, 408/425/429, 5xx)."""
    REFUSED = "refused"
    """Not worth trying again (a 4xx answer, a redirect, a refused address)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """The result of one POST.

    Attributes:
        outcome: Delivered, retry, refused.
        detail: What happened, for logs ("HTTP 503", "no answer within 10 s", ...).
        retry_after: Seconds the receiver asked to wait (None: it did not say).
    """

    outcome: Outcome
    detail: str
    retry_after: float | None = None


class WebhookSender:
    """Sends frames to webhooks over one pool of kept HTTP/1.1 connections (``http1``).

    The pool's own client costs this process about 60 % of the CPU per POST
    aiohttp's client did (``python -m bench.posts``;
    docs/decisions/0003-own-http1-webhook-client.md).

    Args:
        screen: Which addresses may be reached.
        timeout: Seconds one request may take, connecting included.
        max_connections: Most connections open at once (all webhooks together,
            busy and idle).
        ca_file: The CAs webhook certificates are verified against ("" for
            certifi's public ones, or the system's without certifi).
    """

    def __init__(
        self, screen: Screen, timeout: float, max_connections: int, ca_file: str = ""
    ) -> None:
        self._screen = screen
        self._timeout = timeout
        tls = ssl.create_default_context(cafile=ca_file or _public_cas())
        self._pool = Http1Pool(tls, max_connections, f"a2a-grpc-server/{_version()}")

    @property
    def pool(self) -> Http1Pool:
        """The connections (for metrics and tests)."""
        return self._pool

    async def post(
        self, config: TaskPushNotificationConfig, task_id: str, seq: int, body: bytes
    ) -> Attempt:
        """POST one frame (``body``, ProtoJSON) to the config's webhook.

        The whole attempt, resolving the host included, takes at most the
        timeout (a receiver trickling its answer holds a request slot no
        longer). Never raises: anything unexpected is a refusal, with what
        happened.
        """
        try:
            async with asyncio.timeout(self._timeout):
                return await self._post(config, task_id, seq, body)
        except TimeoutError:
            return Attempt(Outcome.RETRY, f"no answer within {self._timeout:g} s")
        except Exception as exc:  # a URL or a header the request cannot carry: not worth retrying
            return Attempt(Outcome.REFUSED, f"{type(exc).__name__}: {exc}")

    async def _post(
        self, config: TaskPushNotificationConfig, task_id: str, seq: int, body: bytes
    ) -> Attempt:
        try:
            target = await self._screen.resolve(config.url)
        except RefusedTargetError as exc:
            return Attempt(Outcome.REFUSED, f"address refused: {exc}")
        except OSError as exc:
            return Attempt(Outcome.RETRY, f"cannot resolve the host: {exc}")
        headers = {
            "Content-Type": CONTENT_TYPE,
            "A2A-Version": "1.0",
            TASK_HEADER: task_id,
            SEQ_HEADER: str(seq),
        }
        if config.token:
            headers[TOKEN_HEADER] = config.token
        if config.HasField("authentication"):
            auth = config.authentication
            headers["Authorization"] = f"{auth.scheme} {auth.credentials}".rstrip()
        key = (target.address, target.port, target.server_name)
        try:
            answer = await self._pool.post(key, target.host, target.path, headers, body)
        except (OSError, ProtocolError) as exc:  # refused, reset, TLS, closed mid-answer, not HTTP
            return Attempt(Outcome.RETRY, f"{type(exc).__name__}: {exc}")
        status = answer.status
        if 200 <= status < 300:
            return Attempt(Outcome.DELIVERED, f"HTTP {status}")
        if status >= 500 or status in RETRIED_STATUSES:
            return Attempt(Outcome.RETRY, f"HTTP {status}", retry_after(answer.retry_after))
        return Attempt(Outcome.REFUSED, f"HTTP {status}")

    async def close(self) -> None:
        """Close every idle connection (busy ones close as their requests end)."""
        self._pool.close()


def _version() -> str:
    """This package's version ("unknown" when it is not installed as a distribution)."""
    try:
        return importlib.metadata.version("a2a-grpc-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _public_cas() -> str | None:
    """The public CA bundle certifi ships (as httpx used), else None: the system's."""
    try:
        import certifi
    except ImportError:  # pragma: no cover - certifi comes with a2a-sdk's httpx
        return None
    return str(certifi.where())


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delay-seconds or an HTTP date).

    Returns:
        The wait, at most ``MAX_RETRY_AFTER``; None if absent or unreadable.
    """
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return min(float(value), MAX_RETRY_AFTER)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    wait = when.timestamp() - (time.time() if now is None else now)
    return min(max(wait, 0.0), MAX_RETRY_AFTER)

"""Retrying NATS operations through an outage or a JetStream failover, within a budget."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from ..journal import StoreRefusedError, StoreUnavailableError

logger = logging.getLogger(__name__.replace("._internal", ""))

T = TypeVar("T")
RETRY_FOR = 30.0
"""Seconds an operation keeps retrying through a NATS outage (a JetStream leader
election after a node loss takes several seconds) before it fails."""
REQUEST_TIMEOUT = 5.0
"""Seconds one attempt waits for JetStream's answer."""
TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
)
"""What NATS raises while it fails over or is briefly unreachable: worth another try.
(Not ``ConnectionClosedError``: this instance closed its connection, for good.)"""
IN_FLIGHT = 10158
"""JetStream's error code for a publish whose ``Nats-Msg-Id`` it is still proposing
("duplicate message id is in process"): an earlier attempt of the same write, sent before
a timeout, whose outcome is not known yet. Worth another try: once the first attempt is
stored, the same publish is answered as a duplicate with its position; if it is dropped,
the publish is stored anew. (Taken for a refusal, it ended a task FAILED "could not
record" while its change landed after all: fault seed 401577 on 3 nodes.)"""


class Retry:
    """How long NATS operations keep retrying: ``budget`` seconds after the first failure.

    Args:
        budget: Seconds of retrying (``NatsConfig.retry_for``).
    """

    __slots__ = ("budget", "timeout")

    def __init__(self, budget: float = RETRY_FOR) -> None:
        self.budget = budget
        self.timeout = min(REQUEST_TIMEOUT, budget)
        """Seconds one attempt waits for an answer."""

    async def __call__(self, attempt: Callable[[], Awaitable[T]], what: str) -> T:
        """Run ``attempt`` until it succeeds, retrying transient NATS failures.

        Pauses grow from 50 ms to 1 s, with jitter, so instances retrying
        together spread out. Whatever else NATS raises is the journal's error
        at once: every backend error leaves here as a ``StoreError``.

        Raises:
            StoreUnavailableError: NATS kept failing for the whole budget, or
                the connection is closed.
            StoreRefusedError: NATS refused the operation (no retry would help).
        """
        try:
            return await _once(attempt, what)  # the usual case: no retry, no bookkeeping
        except _Retry as retry:
            logger.warning("%s: %s; retrying", what, type(retry.error).__name__)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget
        pause = 0.05
        while True:
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))  # NATS is failing over
            pause = min(pause * 2, 1.0)
            try:
                return await _once(attempt, what)
            except _Retry as retry:
                if loop.time() + pause > deadline:
                    raise StoreUnavailableError(
                        f"NATS did not answer ({type(retry.error).__name__}) for "
                        f"{self.budget:g} s: {what}"
                    ) from retry.error
                logger.warning("%s: %s; retrying", what, type(retry.error).__name__)


class _Retry(Exception):
    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _once(attempt: Callable[[], Awaitable[T]], what: str) -> T:
    """One attempt; a transient failure becomes ``_Retry``, any other NATS error a StoreError."""
    try:
        return await attempt()
    except TRANSIENT as exc:
        raise _Retry(exc) from exc
    except nats.errors.ConnectionClosedError as exc:
        raise StoreUnavailableError(f"the NATS connection is closed: {what}") from exc
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        if isinstance(exc, nats.js.errors.APIError) and exc.err_code == IN_FLIGHT:
            raise _Retry(exc) from exc
        raise StoreRefusedError(f"NATS refused to {what}: {type(exc).__name__}: {exc}") from exc

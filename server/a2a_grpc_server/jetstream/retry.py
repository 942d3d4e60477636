"""Retrying NATS operations through an outage or a JetStream failover, within a budget."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from ..journal import StoreUnavailableError

logger = logging.getLogger(__name__)

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
    nats.errors.ConnectionClosedError,
    asyncio.TimeoutError,
)


async def retrying(attempt: Callable[[], Awaitable[T]], what: str) -> T:
    """Run ``attempt`` until it succeeds, retrying transient NATS failures.

    Retries go on for ``RETRY_FOR`` s after the first failure; pauses grow from
    50 ms to 1 s, with jitter, so instances retrying together spread out.

    Raises:
        StoreUnavailableError: NATS kept failing for the whole budget.
    """
    try:
        return await attempt()  # the usual case: no retry, no bookkeeping
    except TRANSIENT as exc:
        logger.warning("%s: %s; retrying", what, type(exc).__name__)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETRY_FOR
    pause = 0.05
    while True:
        await asyncio.sleep(pause * random.uniform(0.5, 1.0))  # NATS is failing over
        pause = min(pause * 2, 1.0)
        try:
            return await attempt()
        except TRANSIENT as exc:
            if loop.time() + pause > deadline:
                raise StoreUnavailableError(
                    f"NATS did not answer ({type(exc).__name__}) for {RETRY_FOR:.0f} s: {what}"
                ) from exc
            logger.warning("%s: %s; retrying", what, type(exc).__name__)

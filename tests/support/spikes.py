"""What the JetStream spikes of issue 41 share (tests/cluster/test_jetstream_batches.py and
test_jetstream_layout.py): a cluster per module, a client of it, and a stream made while a
new cluster elects its JetStream leader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import StreamConfig, StreamInfo

from tests.support import natsserver

ELECTING = (10005, 10008, 10023)
"""JetStream's error codes while a new cluster elects its leader (retried)."""


@pytest.fixture(scope="module", params=[1, 3], ids=["one-node", "three-nodes-R3"])
def cluster(request: pytest.FixtureRequest) -> Iterator[natsserver.Cluster]:
    """One node, then a 3-node cluster (streams at R3), shared by the tests of the module."""
    with natsserver.running(request.param) as nodes:
        yield nodes


@pytest.fixture
async def nc(cluster: natsserver.Cluster) -> AsyncIterator[NATS]:
    """A client on the first node (on R3 the stream's leader may be another node)."""
    client = await nats.connect(cluster.urls[0])
    try:
        yield client
    finally:
        await client.close()


async def add_stream(
    js: JetStreamContext,
    config: StreamConfig,
    ready: Callable[[], Awaitable[Any]] | None = None,
    pause: float = 0.1,
) -> StreamInfo:
    """Add the stream (then wait until ``ready`` answers), retrying while JetStream cannot.

    Retries a timeout, no responders and the leader election's errors, every
    ``pause`` seconds; bounded by the caller's timeout.
    """
    while True:
        try:
            info = await js.add_stream(config)
            if ready is not None:
                await ready()
            return info
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            pass
        except nats.js.errors.APIError as exc:
            if exc.code != 503 and exc.err_code not in ELECTING:
                raise
        await asyncio.sleep(pause)  # sync-ok: paces polling while JetStream elects its leader

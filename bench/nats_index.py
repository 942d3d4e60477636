"""What the task log's listing index costs nats-server per request, with and without its limit.

    .venv/bin/python -m bench.nats_index [--tasks 100000] [--calls 200]

Issue 41 (docs/decisions/0001, "The default, and what listing costs"): on a nats-server
of its own (one node, file storage) it fills the task log with ``--tasks`` tasks through
``LogJournal`` (``bench.population``: four scopes, one entry per task), then makes two
more indexes beside ``A2A_CURRENT``, the same sources and transforms, one with
``max_msgs_per_subject: 1`` (as built) and one without. Once both hold every entry and
a cache expiry (12 s) has passed, it times the requests a listing of one scope (a
quarter of the tasks) makes on each: counts (``Nats-Num-Pending``) from the start and
from near the end, a page's window, and the count of distinct subjects (stream info
with ``subjects_filter``, paged past its end: the number of tasks without the limit).
Prints p50 wall ms and nats-server CPU µs per request (``/proc``, 10 ms ticks, over
``--calls`` calls or 4 s). Loopback only; every loop bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable

from nats.js import JetStreamContext

from a2a_grpc_server._internal.jetstream.conn import current_config
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.tasklog import CURRENT_SUBJECT, token
from tests.support import natsserver

from . import population
from .load import cpu_seconds
from .scale import nats_journal

CACHE_EXPIRY = 12.0
"""Seconds waited after the fill (nats-server drops a block's cache after 10 s)."""
BUDGET = 4.0
"""Seconds one row's calls take at most."""


async def timed(pid: int, call: Callable[[], Awaitable[object]], calls: int) -> tuple[float, float]:
    """p50 wall ms and nats-server CPU µs per call, over ``calls`` calls or ``BUDGET`` s."""
    began, cpu = time.perf_counter(), cpu_seconds(pid)
    walls: list[float] = []
    while len(walls) < calls and time.perf_counter() - began < BUDGET:
        start = time.perf_counter()
        await call()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls) * 1e3, (cpu_seconds(pid) - cpu) / len(walls) * 1e6


def probes(scope: str, last: int) -> dict[str, dict[str, object]]:
    """The requests timed: direct gets, and (``info``) a stream info request's body."""
    return {
        "count from the start (a total)": {"seq": 1, "next_by_subj": scope, "batch": 1},
        "count from 200 before the end": {
            "seq": max(last - 200, 1),
            "next_by_subj": scope,
            "batch": 1,
        },
        "count from 3,200 before the end": {
            "seq": max(last - 3200, 1),
            "next_by_subj": scope,
            "batch": 1,
        },
        "a window of 51 from 204 before the end": {
            "seq": max(last - 204, 1),
            "next_by_subj": scope,
            "batch": 51,
        },
        "distinct subjects (stream info)": {"info": {"subjects_filter": scope, "offset": 1 << 30}},
    }


def asking(
    requests: JetStreamRequests, stream: str, request: dict[str, object]
) -> Callable[[], Awaitable[object]]:
    """One probe's call on ``stream``."""
    info = request.get("info")
    if info is not None:
        body = json.dumps(info).encode()
        return lambda: requests.api(f"$JS.API.STREAM.INFO.{stream}", body, 30.0)
    return lambda: requests.direct_get(stream, request, 30.0)


async def copied(js: JetStreamContext, stream: str, count: int) -> None:
    """Return once ``stream`` holds ``count`` messages (nats-server copies them meanwhile)."""
    while (await js.stream_info(stream)).state.messages < count:  # noqa: ASYNC110 (no event)
        await asyncio.sleep(0.5)


async def run(tasks: int, calls: int) -> None:
    """Fill, make the two indexes, print one table."""
    with natsserver.running(1) as cluster:
        node = cluster.nodes[0]
        assert node.proc is not None
        pid = node.proc.pid
        async with nats_journal(cluster.urls[0], "bench-index", "", True) as (conn, journal, _):
            await population.fill(journal, 0, tasks, population.FILL_CONCURRENCY)
            indexes = {"limit 1 (as built)": "BENCH_LIMIT", "no limit": "BENCH_FLAT"}
            for name, limit in zip(indexes.values(), (1, -1), strict=True):
                config = current_config()
                config.name, config.max_msgs_per_subject = name, limit
                await conn.js.add_stream(config)
            async with asyncio.timeout(600):
                for name in indexes.values():
                    await copied(conn.js, name, tasks)
            await asyncio.sleep(CACHE_EXPIRY)  # (a wait for nats-server's clock, not an event)
            requests = JetStreamRequests(conn.nc)
            await requests.start()
            scope = f"{CURRENT_SUBJECT}.{token(population.scope(0))}.>"
            rows: dict[str, dict[str, tuple[float, float]]] = {}
            for label, name in indexes.items():
                last = (await conn.js.stream_info(name)).state.last_seq
                for probe, request in probes(scope, last).items():
                    call = asking(requests, name, request)
                    rows.setdefault(probe, {})[label] = await timed(pid, call, calls)
            await requests.close()
    print(f"\n{tasks:,} tasks, one scope of {tasks // population.SCOPES:,}: p50 ms (nats CPU µs)")
    print("| request | " + " | ".join(indexes) + " |")
    print("|---|" + "---|" * len(indexes))
    for probe, by in rows.items():
        cells = [f"{by[label][0]:.2f} ({by[label][1]:,.0f})" for label in indexes]
        print(f"| {probe} | " + " | ".join(cells) + " |")


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(run(args.tasks, args.calls))


if __name__ == "__main__":
    main()

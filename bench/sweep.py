"""Sweep: what ending a lost owner's tasks costs the survivor, as the owner held more.

    .venv/bin/python -m bench.sweep [--lost 1000,10000,100000] [--bucket] [--json PATH]

For each M in ``--lost``, on one nats-server: an instance ``lost-M`` records M
running tasks (through the ``TaskJournal`` API, ``FILL_CONCURRENCY`` writes at
a time; it never heartbeats, so it is lost from the start), then a survivor in
this process (its own NATS connection, a journal, and the ``Lease`` with a 2 s
lease) starts, and its first sweep, a lease later, ends them FAILED. Measured
over that sweep: its wall time, the tasks ended per second, this process's
CPU per task (the survivor: nothing else runs in it meanwhile but a ticker),
nats-server's CPU per task, and the longest the survivor's event loop was
held (a ticker wakes every ``TICK_MS`` ms; its longest lateness). Then the
exponent k of a least-squares fit of the sweep's time over M (log-log):
about 1 is in proportion to the lost owner's tasks. Every task is checked
ended by that sweep (the row ``tasks ended``: fewer is a finding, printed). The lost
owner's tasks are in the task log (the default), or with ``--bucket`` in the snapshot
bucket (format 2, ``--no-nats-task-log``).

Every loop is bounded in count and time. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import time
from pathlib import Path

from a2a_grpc_server._internal.jetstream.conn import NatsConfig, connect
from a2a_grpc_server._internal.jetstream.formats import Formats
from a2a_grpc_server._internal.jetstream.journal import JetStreamJournal
from a2a_grpc_server._internal.jetstream.lease import Lease
from a2a_grpc_server._internal.jetstream.logjournal import LogJournal
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.store import ClusterJournal
from a2a_grpc_server._internal.journal import PageTokens
from a2a_grpc_server._internal.obs.metrics import Metrics
from tests.support import ROOT, natsserver

from . import population
from .load import cpu_seconds
from .scale import exponent, nats_journal, running

LEASE = 2.0
"""The survivor's lease (seconds): its first sweep runs a lease after it starts."""
TICK_MS = 5
SWEEP_LIMIT = 1800.0
"""Seconds one sweep may take at most."""
SCOPE = '["sweep",""]'


async def fill(url: str, owner: str, count: int, task_log: bool = True) -> float:
    """Record ``count`` running tasks owned by ``owner``; seconds it took."""
    began = time.perf_counter()
    async with nats_journal(url, owner, owner, task_log) as (_, journal, _):
        todo = iter(range(count))

        async def worker() -> None:
            for k in todo:  # (shared: each task is written by one worker)
                task = running(f"{owner}-{k}", "sweep")
                await journal.create(task, population.first_change(task), scope=SCOPE)

        async with asyncio.TaskGroup() as group:
            for _ in range(population.FILL_CONCURRENCY):
                group.create_task(worker())
        await journal.close()
    return time.perf_counter() - began


async def sweep(url: str, lost: str, count: int, nats_pid: int) -> dict[str, float]:
    """Start a survivor, time its first sweep (it ends ``lost``'s ``count`` tasks)."""
    ident = f"survivor-{count}"
    conn = await connect(NatsConfig(servers=[url], instance_id=ident, lease=LEASE))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    formats = Formats()
    formats.settle()
    tokens = PageTokens()
    legacy = JetStreamJournal(requests, conn.js, ident, formats=formats, page_tokens=tokens)
    log = LogJournal(requests, conn.js, ident, page_tokens=tokens)
    journal = ClusterJournal(legacy, log, formats, tokens)
    metrics = Metrics()
    lease = Lease(conn, journal, metrics, formats=formats)
    figures: dict[str, float] = {}
    done = asyncio.Event()
    timed_sweep = lease.sweep

    async def measured() -> int:
        if done.is_set():
            return await timed_sweep()
        held = 0.0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal held
            loop = asyncio.get_running_loop()
            while not stop.is_set():
                before = loop.time()
                await asyncio.sleep(TICK_MS / 1000)  # sync-ok: the ticker measures lateness
                held = max(held, loop.time() - before - TICK_MS / 1000)

        tick = asyncio.create_task(ticker())
        cpu0, ncpu0, t0 = time.process_time(), cpu_seconds(nats_pid), time.perf_counter()
        try:
            won = await timed_sweep()
        finally:
            wall = time.perf_counter() - t0
            cpu, ncpu = time.process_time() - cpu0, cpu_seconds(nats_pid) - ncpu0
            stop.set()
            await tick
        figures.update(
            {
                "sweep time (s)": wall,
                "tasks ended per s": won / wall if wall else 0.0,
                "survivor CPU per task (µs)": cpu / max(won, 1) * 1e6,
                "nats-server CPU per task (µs)": ncpu / max(won, 1) * 1e6,
                "survivor's loop held at most (ms)": held * 1000,
                "tasks ended": float(won),
            }
        )
        done.set()
        return won

    lease.sweep = measured  # type: ignore[method-assign]
    try:
        await journal.listing.keep_index({ident})  # (the index is trusted: the sweep reads it)
        async with asyncio.timeout(SWEEP_LIMIT):
            await lease.start()
            await done.wait()
        if metrics.tasks_reaped != count:  # (a finding, printed: the table shows how many)
            print(f"  its first sweep ended {metrics.tasks_reaped:,} of {count:,}", flush=True)
    finally:
        await lease.stop(release=True)
        await journal.close()
        await requests.close()
        await conn.close()
    return figures


async def main(sizes: list[int], task_log: bool = True) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with natsserver.running(1) as cluster:
        url = cluster.urls[0]
        proc = cluster.nodes[0].proc
        assert proc is not None
        for size in sizes:
            lost = f"lost-{size}"
            took = await fill(url, lost, size, task_log)
            print(f"M={size:,}: {lost} recorded {size:,} running tasks in {took:.1f} s", flush=True)
            rows[size] = await sweep(url, lost, size, proc.pid)
            print(f"  swept in {rows[size]['sweep time (s)']:.2f} s", flush=True)
    return rows


def table(rows: dict[int, dict[str, float]]) -> str:
    sizes = sorted(rows)
    names = list(rows[sizes[0]])
    head = "| | " + " | ".join(f"M={n:,}" for n in sizes) + " | k |"
    lines = [head, "|---" * (len(sizes) + 2) + "|"]
    for name in names:
        points = {n: rows[n][name] for n in sizes}
        k = exponent(points) if name == "sweep time (s)" else None
        cells = " | ".join(
            f"{points[n]:,.2f}" if points[n] < 100 else f"{points[n]:,.0f}" for n in sizes
        )
        lines.append(f"| {name} | {cells} | {'' if k is None else f'{k:.2f}'} |")
    return "\n".join(lines)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lost", default="1000,10000,100000", help="M values, comma-separated")
    parser.add_argument(
        "--bucket", action="store_true", help="the lost owner's tasks in the snapshot bucket"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "sweep.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    sizes = [int(n) for n in args.lost.split(",")]
    rows = asyncio.run(main(sizes, not args.bucket))
    layout = "snapshot bucket" if args.bucket else "task log"
    print(f"python {platform.python_version()}, lease {LEASE} s, ticker {TICK_MS} ms, {layout}")
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({str(n): r for n, r in rows.items()}, indent=2) + "\n")


if __name__ == "__main__":
    cli()

"""Scale: what ListTasks, GetTask, startup and the lease sweep cost as the store grows.

    .venv/bin/python -m bench.scale [--sizes 1000,10000,100000] [--backend memory|nats|both]
                                    [--nats-sizes ...] [--quick] [--bucket] [--json PATH]

For each backend and each N in ``--sizes`` it stores N tasks (``bench.population``:
four scopes, ten contexts per scope, final and waiting tasks), then measures
through a real server on 127.0.0.1, with generated gRPC stubs, calling as the
anonymous scope (a quarter of the tasks):

* ListTasks, first page of 50: unfiltered; by context (a tenth of the scope);
  by state (INPUT_REQUIRED, a fifth); by status timestamp (the scope's newest
  ``STATUS_WINDOW`` tasks, a fixed window as "the last hour" is at a steady
  rate); and page 5 (the token after page 4, fetched once and reused);
* GetTask of a random task of the scope;
* NATS only: the time a new ``serve --nats`` process takes from spawn to its
  ready line against the filled store (the least of ``STARTS``), and the
  server CPU it spent by then; a restarted instance's ``Lease.start()``,
  which ends the ``RESTART_TASKS`` tasks its predecessor left (the claim path
  a sweep takes), and a lease sweep pass (``Lease.sweep()``, nothing lost:
  the least of ``SWEEPS``), both run in this process on a NATS connection of
  their own (the server has no way to start a sweep from outside).

Per call: the median latency, and the server's CPU per call: the server is its
own process (the load generator's work is not in it), and its user + system
CPU is read from ``/proc/<pid>/stat`` before and after a run of calls, then
divided by their count (10 ms ticks: each run lasts at least ``BUDGET`` seconds
or ``MAX_CALLS`` calls). On NATS, nats-server's CPU per call the same way.
Then, per row, the exponent k of a least-squares fit cost ~ N^k (log-log):
about 0 is independent of the store's size, about 1 linear.

Each N is a fresh in-memory server (filled in its own process before it
serves); on NATS one nats-server for the run, filled up to each N in turn, and a
fresh server instance for each N, with the defaults; its calls are measured once
it logs that it reads the listing index (a lease after start, once it has heard
every instance: until then it reads every snapshot, as it must while an older
version may be in the cluster).
Every loop is bounded in count and time. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import GetTaskRequest, ListTasksRequest, Task, TaskState

from a2a_grpc_server._internal.jetstream.conn import NatsConfig, NatsConnection, connect
from a2a_grpc_server._internal.jetstream.formats import Formats
from a2a_grpc_server._internal.jetstream.journal import JetStreamJournal
from a2a_grpc_server._internal.jetstream.lease import Lease
from a2a_grpc_server._internal.jetstream.logjournal import LogJournal
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.store import ClusterJournal
from a2a_grpc_server._internal.journal import PageTokens
from a2a_grpc_server._internal.obs.metrics import Metrics
from tests.support import ROOT, cluster_key_file, natsserver

from . import population
from .load import cpu_seconds
from .population import SCOPES

V1 = (("a2a-version", "1.0"),)
PAGE = 50
DEEP_PAGE = 5
STATUS_WINDOW = 200
"""Tasks of the scope the status-timestamp filter matches (the newest ones)."""
RESTART_TASKS = 100
"""Running tasks a restarted instance finds it owned (ended FAILED by ``Lease.start``)."""
BUDGET = 3.0
"""Seconds a run of one call lasts at least (unless ``MAX_CALLS`` come first)."""
MIN_CALLS, MAX_CALLS = 3, 2000
CALL_LIMIT = 180.0
"""Seconds one run of calls may take at most, whatever ``MIN_CALLS`` says."""
CALL_TIMEOUT = 120.0
"""gRPC deadline of one call."""
STARTS = 3
"""Server starts per N on NATS (the least time is reported; the last one is measured)."""
SWEEPS = 3
"""Sweep passes per N (the least of each figure is reported)."""
START_LIMIT = 300.0
"""Seconds a server may take to get ready."""
READY = re.compile(r"ready: grpc (\S+) \(plaintext\)")
INDEXED = "listing index"
"""What an instance logs once it reads the index (it built it, or found it built)."""
MAX_LINES = 10_000
"""Lines of a server's output kept."""


@dataclass
class Server:
    """A server process under test and a stub to it."""

    proc: asyncio.subprocess.Process
    channel: grpc.aio.Channel
    stub: a2a_pb2_grpc.A2AServiceStub
    ready_s: float
    """Wall seconds from spawn to its ready line."""
    ready_cpu_s: float
    """Its CPU seconds by then."""
    lines: list[str]
    """What it printed before its ready line (and after it, as it comes)."""
    printed: asyncio.Event
    """Set at each line printed after the ready line."""

    async def logged(self, text: str, within: float) -> None:
        """Wait until a line holding ``text`` is printed (bounded)."""
        async with asyncio.timeout(within):
            while not any(text in line for line in self.lines):
                self.printed.clear()
                await self.printed.wait()


@contextlib.asynccontextmanager
async def spawned(
    args: list[str], ready: re.Pattern[str], *, on_stdout: bool, host: str = ""
) -> AsyncIterator[Server]:
    """A server process started with ``args``, once its ready line matched ``ready``.

    ``ready``'s first group is the address (after ``host``); the line is read on
    stdout (``on_stdout``) or stderr. Terminated (killed after 10 s) on exit.
    """
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE if on_stdout else asyncio.subprocess.DEVNULL,
        stderr=None if on_stdout else asyncio.subprocess.PIPE,
    )
    stream = proc.stdout if on_stdout else proc.stderr
    assert stream is not None
    lines: list[str] = []
    drain: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(START_LIMIT):
            while not (match := ready.search(line := (await stream.readline()).decode())):
                if not line:
                    raise RuntimeError("server exited before it was ready:\n" + "".join(lines))
                lines.append(line)
        ready_s, ready_cpu_s = time.perf_counter() - began, cpu_seconds(proc.pid)
        printed = asyncio.Event()
        drain = asyncio.get_running_loop().create_task(_drain(stream, lines, printed))
        channel = grpc.aio.insecure_channel(host + match.group(1))
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        try:
            yield Server(proc, channel, stub, ready_s, ready_cpu_s, lines, printed)
        finally:
            await channel.close()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if drain is not None:
            drain.cancel()


async def _drain(stream: asyncio.StreamReader, lines: list[str], printed: asyncio.Event) -> None:
    while line := (await stream.readline()).decode():
        if len(lines) < MAX_LINES:
            lines.append(line)
        printed.set()


@dataclass
class Measured:
    """One run of one call."""

    calls: int
    p50_ms: float
    server_us: float
    """Server CPU per call (microseconds)."""
    nats_us: float | None = None
    """nats-server CPU per call (microseconds), on NATS."""


Call = Callable[[], Awaitable[object]]


async def measure(call: Call, pid: int, nats_pid: int | None, quick: bool) -> Measured:
    """Run ``call`` one at a time (bounded in count and time); latency and CPU per call."""
    budget, most = (0.3, 200) if quick else (BUDGET, MAX_CALLS)
    await call()  # warm-up (connection, caches)
    samples: list[float] = []
    cpu0 = cpu_seconds(pid)
    ncpu0 = cpu_seconds(nats_pid) if nats_pid else 0.0
    began = time.perf_counter()
    while len(samples) < most:
        elapsed = time.perf_counter() - began
        if (len(samples) >= MIN_CALLS and elapsed >= budget) or elapsed >= CALL_LIMIT:
            break
        t0 = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - t0) * 1000)
    cpu = cpu_seconds(pid) - cpu0
    ncpu = cpu_seconds(nats_pid) - ncpu0 if nats_pid else None
    n = len(samples)
    nats_us = None if ncpu is None else ncpu / n * 1e6
    return Measured(n, statistics.median(samples), cpu / n * 1e6, nats_us)


async def plan(stub: a2a_pb2_grpc.A2AServiceStub, size: int) -> dict[str, Call]:
    """The measured calls against a store of ``size`` tasks (see the module docstring)."""
    rng = random.Random(size)
    mine = range(0, size, SCOPES)  # the anonymous scope's tasks
    # The oldest of the scope's newest STATUS_WINDOW tasks: its timestamp bounds the filter.
    anchor = mine[max(0, len(mine) - STATUS_WINDOW)]
    found = await stub.GetTask(
        GetTaskRequest(id=population.task_id(anchor)), metadata=V1, timeout=CALL_TIMEOUT
    )

    def listing(request: ListTasksRequest) -> Call:
        request.page_size = PAGE
        return lambda: stub.ListTasks(request, metadata=V1, timeout=CALL_TIMEOUT)

    async def get() -> object:
        request = GetTaskRequest(id=population.task_id(rng.choice(mine)))
        return await stub.GetTask(request, metadata=V1, timeout=CALL_TIMEOUT)

    return {
        # (first: the listings' scans leave nats-server work behind, consumers to delete)
        "GetTask (random)": get,
        "ListTasks first page": listing(ListTasksRequest()),
        "ListTasks by context": listing(ListTasksRequest(context_id=population.context_id(0))),
        "ListTasks by state": listing(ListTasksRequest(status=population.WAITING)),
        "ListTasks by status time": listing(
            ListTasksRequest(status_timestamp_after=found.status.timestamp)
        ),
        f"ListTasks page {DEEP_PAGE} (token)": listing(
            ListTasksRequest(page_token=await deep_token(stub))
        ),
    }


async def deep_token(stub: a2a_pb2_grpc.A2AServiceStub) -> str:
    """The page token after page ``DEEP_PAGE - 1`` (or after the last page there is)."""
    token = ""
    for _ in range(DEEP_PAGE - 1):
        page = await stub.ListTasks(
            ListTasksRequest(page_size=PAGE, page_token=token), metadata=V1, timeout=CALL_TIMEOUT
        )
        if not page.next_page_token:
            break
        token = page.next_page_token
    return token


Rows = dict[str, dict[int, float]]
"""Per row (``call | metric``), the value at each N."""


async def measure_calls(
    rows: Rows, server: Server, size: int, nats_pid: int | None, quick: bool
) -> None:
    """Every measured call against ``server`` holding ``size`` tasks, filed in ``rows``."""
    assert server.proc.pid is not None
    for name, call in (await plan(server.stub, size)).items():
        m = await measure(call, server.proc.pid, nats_pid, quick)
        extra = f", nats-server {m.nats_us:,.0f} us" if m.nats_us is not None else ""
        print(
            f"    {name:28} {m.calls:5} calls  p50 {m.p50_ms:9.2f} ms  "
            f"server {m.server_us:11,.0f} us/call{extra}",
            flush=True,
        )
        rows.setdefault(f"{name} | p50 ms", {})[size] = m.p50_ms
        rows.setdefault(f"{name} | server us/call", {})[size] = m.server_us
        if m.nats_us is not None:
            rows.setdefault(f"{name} | nats-server us/call", {})[size] = m.nats_us


async def run_memory(sizes: list[int], quick: bool) -> tuple[Rows, dict[int, float]]:
    """A fresh in-memory server per N: filled in its own process, then measured."""
    rows: Rows = {}
    fills: dict[int, float] = {}
    for size in sizes:
        print(f"memory N={size:,}", flush=True)
        args = ["-m", "bench.population", "--size", str(size)]
        ready = re.compile(r"^ready (\d+)")
        async with spawned(args, ready, on_stdout=True, host="127.0.0.1:") as server:
            fill = next(m for line in server.lines if (m := re.match(r"filled \d+ (\S+)", line)))
            fills[size] = float(fill.group(1))
            print(f"  filled in {fills[size]:.1f} s (in the server process)", flush=True)
            await measure_calls(rows, server, size, None, quick)
    return rows, fills


@contextlib.asynccontextmanager
async def nats_journal(
    url: str, instance_id: str, owner: str, task_log: bool = True
) -> AsyncIterator[tuple[NatsConnection, ClusterJournal, Formats]]:
    """A connection of this process to NATS and a journal on it writing as ``owner``.

    It writes as every instance of a settled cluster of this version does: format 2,
    new tasks in the task log (format 3); without ``task_log``, in the snapshot bucket
    (``--no-nats-task-log``).
    """
    conn = await connect(NatsConfig(servers=[url], instance_id=instance_id))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    formats = Formats()
    formats.log_wanted = task_log
    formats.settle()  # (no other instance heard: format 2, or the log)
    try:
        tokens = PageTokens()
        legacy = JetStreamJournal(requests, conn.js, owner, formats=formats, page_tokens=tokens)
        log = LogJournal(requests, conn.js, owner, page_tokens=tokens)
        yield conn, ClusterJournal(legacy, log, formats, tokens), formats
    finally:
        await requests.close()
        await conn.close()


def serve_args(url: str, task_log: bool = True) -> list[str]:
    """``a2a-grpc-server serve`` in cluster mode on free ports (see the module docstring)."""
    return [
        *("-m", "a2a_grpc_server.cli", "serve", "--port", "0", "--http-port", "0"),
        *("--agent", "bench.agents:Workload", "--nats", url),
        *("--nats-key-file", str(cluster_key_file())),
        *(() if task_log else ("--no-nats-task-log",)),
    ]


async def restart_and_sweep(
    url: str, size: int, nats_pid: int, quick: bool, task_log: bool = True
) -> dict[str, float]:
    """Time a restarted instance's ``Lease.start()`` (it ends its predecessor's tasks), then
    one ``Lease.sweep()`` with nothing lost; wall ms, this process's CPU, nats-server's."""
    ident = f"scale-restart-{size}"
    count = 10 if quick else RESTART_TASKS
    out: dict[str, float] = {}
    async with nats_journal(url, ident, ident, task_log) as (conn, journal, formats):
        left = [running(f"restart-{size}-{k}") for k in range(count)]
        for task in left:
            await journal.create(task, population.first_change(task), scope=RESTART_SCOPE)
        lease = Lease(conn, journal, Metrics(), formats=formats)
        async with asyncio.timeout(CALL_LIMIT):
            out |= await _timed(f"restart, ends {count} tasks", lease.start, nats_pid)
            for _ in range(1 if quick else SWEEPS):
                for key, value in (await _timed("sweep", lease.sweep, nats_pid)).items():
                    out[key] = min(value, out.get(key, value))
            await lease.stop(release=True)
        for task in left:  # the restart did end them
            recorded = await journal.get(task.id)
            assert (
                recorded is not None and recorded.task.status.state == TaskState.TASK_STATE_FAILED
            )
    return out


async def _timed(name: str, step: Call, nats_pid: int) -> dict[str, float]:
    """Run ``step`` once: wall ms, this process's CPU ms, nats-server's CPU ms."""
    cpu0, ncpu0, t0 = time.process_time(), cpu_seconds(nats_pid), time.perf_counter()
    await step()
    return {
        f"{name} | ms": (time.perf_counter() - t0) * 1000,
        f"{name} | sweeper CPU ms": (time.process_time() - cpu0) * 1000,
        f"{name} | nats-server CPU ms": (cpu_seconds(nats_pid) - ncpu0) * 1000,
    }


RESTART_SCOPE = '["restart",""]'
"""The scope of the restarted instance's tasks (a tenant the measured caller is not)."""


def running(task_id: str, context_id: str = "restart") -> Task:
    """A WORKING task, its status timestamp now."""
    task = Task(id=task_id, context_id=context_id)
    task.status.state = TaskState.TASK_STATE_WORKING
    task.status.timestamp.FromNanoseconds(time.time_ns())
    return task


async def run_nats(
    sizes: list[int], quick: bool, task_log: bool = True
) -> tuple[Rows, dict[int, float]]:
    """One nats-server, filled up to each N in turn; a fresh server instance per N.

    ``task_log``: tasks filled into, and new ones created in, the task log (format 3, the
    default); else the snapshot bucket (format 2).
    """
    rows: Rows = {}
    fills: dict[int, float] = {}
    with natsserver.running(1) as cluster:
        url = cluster.urls[0]
        node = cluster.nodes[0]
        assert node.proc is not None
        nats_pid = node.proc.pid
        starts = 1 if quick else STARTS
        baseline = min([await startup(url, task_log) for _ in range(starts)])
        print(f"nats: an instance on the empty store was ready in {baseline:.2f} s", flush=True)
        async with nats_journal(url, "scale-filler", "", task_log) as (_, filler, _):
            done = 0
            for size in sizes:
                print(f"nats N={size:,}", flush=True)
                began = time.perf_counter()
                await population.fill(filler, done, size, population.FILL_CONCURRENCY)
                fills[size] = time.perf_counter() - began
                await filler.listing.keep_index(
                    {"scale-filler"}
                )  # (the cluster's index: its marker)
                print(
                    f"  filled {size - done:,} more in {fills[size]:.1f} s "
                    f"({(size - done) / fills[size]:,.0f} tasks/s)",
                    flush=True,
                )
                done = size
                swept = await restart_and_sweep(url, size, nats_pid, quick, task_log)
                for name, value in swept.items():
                    rows.setdefault(name, {})[size] = value
                times = [await startup(url, task_log) for _ in range(starts - 1)]
                async with spawned(serve_args(url, task_log), READY, on_stdout=False) as server:
                    ready_s = min([*times, server.ready_s])
                    print(f"  instance ready in {ready_s:.2f} s", flush=True)
                    rows.setdefault("startup, spawn to ready | s", {})[size] = ready_s
                    rows.setdefault("startup, over empty store | s", {})[size] = ready_s - baseline
                    rows.setdefault("startup | server CPU s", {})[size] = server.ready_cpu_s
                    # A lease after start it has heard every instance: it reads the index.
                    await server.logged(INDEXED, within=START_LIMIT)
                    await measure_calls(rows, server, size, nats_pid, quick)
    return rows, fills


async def startup(url: str, task_log: bool = True) -> float:
    """Seconds a ``serve --nats`` process takes from spawn to ready (then it is stopped)."""
    async with spawned(serve_args(url, task_log), READY, on_stdout=False) as server:
        return server.ready_s


def exponent(points: dict[int, float]) -> float | None:
    """Least-squares slope of log(value) over log(N) (None: fewer than two positive points)."""
    xy = [(math.log(n), math.log(v)) for n, v in points.items() if v > 0]
    if len(xy) < 2:
        return None
    mx = statistics.fmean(x for x, _ in xy)
    my = statistics.fmean(y for _, y in xy)
    den = sum((x - mx) ** 2 for x, _ in xy)
    return sum((x - mx) * (y - my) for x, y in xy) / den if den else None


def table(results: dict[str, Rows]) -> str:
    """Per backend and row: the value at each N and the fitted exponent k."""
    sizes = sorted({n for rows in results.values() for row in rows.values() for n in row})
    head = f"{'backend':8} {'call':34} {'metric':20}"
    head += "".join(f"{'N=' + format(n, ','):>12}" for n in sizes) + f"{'k':>7}"
    lines = [head]
    for backend, rows in results.items():
        order = {key: i for i, key in enumerate(rows)}
        for key in sorted(rows, key=lambda key: (_group(key), order[key])):
            name, metric = key.split(" | ")
            cells = "".join(
                f"{_num(rows[key][n]):>12}" if n in rows[key] else f"{'-':>12}" for n in sizes
            )
            k = exponent(rows[key])
            kcell = f"{k:7.2f}" if k is not None else f"{'-':>7}"
            lines.append(f"{backend:8} {name:34} {metric:20}{cells}{kcell}")
    return "\n".join(lines)


def _group(key: str) -> int:
    """Calls first (in the order measured), then startup, restart and sweep rows."""
    groups = ("ListTasks", "GetTask", "startup", "restart", "sweep")
    return next((i for i, prefix in enumerate(groups) if key.startswith(prefix)), len(groups))


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def _num(value: float) -> str:
    if value < 0:
        return f"{value:.2f}"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if value >= 1 else f"{value:.3f}"


async def main(args: argparse.Namespace) -> dict[str, object]:
    """Run each backend; return everything measured."""
    sizes = [int(s) for s in args.sizes.split(",")]
    nats_sizes = [int(s) for s in args.nats_sizes.split(",")] if args.nats_sizes else sizes
    results: dict[str, Rows] = {}
    fills: dict[str, dict[int, float]] = {}
    load_before = os.getloadavg()
    if args.backend in ("memory", "both"):
        results["memory"], fills["memory"] = await run_memory(sorted(sizes), args.quick)
    if args.backend in ("nats", "both"):
        results["nats"], fills["nats"] = await run_nats(sorted(nats_sizes), args.quick)
    if args.bucket:
        results["nats-bucket"], fills["nats-bucket"] = await run_nats(
            sorted(nats_sizes), args.quick, task_log=False
        )
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "params": vars(args) | {"json": str(args.json)},
        "fill_seconds": fills,
        "results": results,
    }


def cli() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="", help="task counts (default 1000,10000,100000)")
    parser.add_argument("--nats-sizes", default="", help="task counts on NATS (default: --sizes)")
    parser.add_argument("--backend", choices=("memory", "nats", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small N, short runs")
    parser.add_argument(
        "--bucket",
        action="store_true",
        help="also NATS with tasks in the snapshot bucket (format 2, --no-nats-task-log)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    args = parser.parse_args()
    # (the restart measured here ends its predecessor's tasks on purpose: one warning each)
    logging.getLogger("a2a_grpc_server.jetstream.lease").setLevel(logging.ERROR)
    args.sizes = args.sizes or ("200,1000" if args.quick else "1000,10000,100000")
    report = asyncio.run(main(args))
    results = report["results"]
    assert isinstance(results, dict)
    print()
    print(
        "in memory: ServerConfig(max_final_tasks=max(N, 10000)), else defaults; on NATS: "
        "serve --nats defaults but --lease 600; calls as the anonymous scope (N/4 tasks), "
        f"page_size {PAGE}; fill seconds: {json.dumps(report['fill_seconds'])}"
    )
    machine = report["machine"]
    assert isinstance(machine, dict)
    print(
        f"{machine['cpus']} cpus, Python {machine['python']}; load average (1, 5, 15 min) "
        f"before {_load(machine['loadavg_before'])}, after {_load(machine['loadavg_after'])}"
    )
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    cli()

"""What a change of a task costs on JetStream: acknowledged publishes, or one atomic batch.

    .venv/bin/python -m bench.nats_batches [--changes 2000] [--writers 1,16] [--reps 3]
                                           [--nodes 1] [--storage file] [--seconds 20]
                                           [--json PATH]

Issue 41, step 1 (docs/decisions/0001-cluster-store-layout.md). On a nats-server of
its own (``--nodes 3``: a 3-node cluster, the stream at R3), started afresh for each
repetition, one stream (``--storage``: file or memory) allowing atomic batches,
rollups and TTLs; this process writes ``--changes`` changes of 100 tasks, each as:

* ``3 acked, in turn``: the task's event (compare-and-set on its subject), then its
  snapshot (a rollup of its subject), then its index entry (a rollup), each an
  acknowledged publish awaited before the next (three round trips, as today);
* ``3 acked, at once``: the same three, their acks awaited together (one round trip,
  three acks);
* ``batch of 3, 1 ack``: the same three as one atomic batch, only the commit a request;
* ``batch of 3, 2 acks``: the same, the batch's start a request too (as ADR-50 shows it);
* ``1 acked``: the event alone, one acknowledged publish (what a layout writing one
  message per change costs).

``--writers`` writers share the changes (each its own tasks, so no compare-and-set
fails). Per change: wall time (with one writer, its latency), this process's CPU and
nats-server's (all nodes, ``/proc/<pid>/stat``). Each mode runs in turn, in a rotated
order per repetition; the table shows the median over the repetitions and the spread
[min-max]. Loopback only; every loop bounded by ``--changes`` and ``--seconds``.
Writes JSON with every repetition's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import StorageType, StreamConfig

from tests.support import ROOT, natsserver

from .load import cpu_seconds

TASKS = 100
ROLLUP = {"Nats-Rollup": "sub"}
TIMEOUT = 10.0

Writer = Callable[[NATS, str, int], Awaitable[int]]
"""Write one change of a task at a version; the task's version after it."""


class Failed(RuntimeError):
    """JetStream refused a write the benchmark expected it to take."""


def _check(data: bytes) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(data)
    if "error" in answer:
        raise Failed(str(answer["error"]))
    return answer


def _three(task: str, version: int) -> list[tuple[str, bytes, dict[str, str]]]:
    head = {"Nats-Expected-Last-Subject-Sequence": str(version)}
    return [
        (f"b.task.{task}.ev", b"e" * 200, head),
        (f"b.task.{task}.snap", b"s" * 600, ROLLUP),
        (f"b.idx.scope.{task}", b"i" * 120, ROLLUP),
    ]


async def in_turn(nc: NATS, task: str, version: int) -> int:
    """Three acknowledged publishes, one after another."""
    acks = [
        _check((await nc.request(subject, data, TIMEOUT, headers=headers)).data)
        for subject, data, headers in _three(task, version)
    ]
    return int(acks[0]["seq"])


async def at_once(nc: NATS, task: str, version: int) -> int:
    """Three acknowledged publishes, their acks awaited together."""
    replies = await asyncio.gather(
        *(nc.request(s, d, TIMEOUT, headers=h) for s, d, h in _three(task, version))
    )
    return int(_check(replies[0].data)["seq"])


async def _batch(nc: NATS, task: str, version: int, *, ask_first: bool) -> int:
    batch = nats.nuid.NUID().next().decode()
    messages = _three(task, version)
    for seq, (subject, data, headers) in enumerate(messages, 1):
        marks = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(seq)}
        if seq == len(messages):
            marks["Nats-Batch-Commit"] = "1"
            reply = await nc.request(subject, data, TIMEOUT, headers={**headers, **marks})
            return int(_check(reply.data)["seq"]) - 2  # the event's: the batch's first
        if seq == 1 and ask_first:
            reply = await nc.request(subject, data, TIMEOUT, headers={**headers, **marks})
            if reply.data:
                raise Failed(reply.data.decode())
        else:
            await nc.publish(subject, data, headers={**headers, **marks})
    raise AssertionError("unreachable")


async def batch_one_ack(nc: NATS, task: str, version: int) -> int:
    """One atomic batch of three, only the commit a request."""
    return await _batch(nc, task, version, ask_first=False)


async def batch_two_acks(nc: NATS, task: str, version: int) -> int:
    """One atomic batch of three, its start a request too."""
    return await _batch(nc, task, version, ask_first=True)


async def alone(nc: NATS, task: str, version: int) -> int:
    """The event alone, one acknowledged publish."""
    subject, data, headers = _three(task, version)[0]
    return int(_check((await nc.request(subject, data, TIMEOUT, headers=headers)).data)["seq"])


MODES: dict[str, tuple[Writer, int, int]] = {
    # name: the writer, acks per change, round trips per change
    "3 acked, in turn": (in_turn, 3, 3),
    "3 acked, at once": (at_once, 3, 1),
    "batch of 3, 1 ack": (batch_one_ack, 1, 1),
    "batch of 3, 2 acks": (batch_two_acks, 2, 2),
    "1 acked": (alone, 1, 1),
}


async def _stream(nc: NATS, name: str, replicas: int, storage: str) -> None:
    js = nc.jetstream(timeout=2.0)
    config = StreamConfig(
        name=name,
        subjects=["b.task.*.ev", "b.task.*.snap", "b.idx.>"],
        num_replicas=replicas,
        storage=StorageType(storage),
        allow_atomic=True,
        allow_rollup_hdrs=True,
        allow_msg_ttl=True,
        allow_direct=True,
    )
    async with asyncio.timeout(30):
        while True:
            try:
                await js.delete_stream(name)
            except nats.js.errors.NotFoundError:
                pass
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.js.errors.APIError,
            ):
                await asyncio.sleep(0.1)  # JetStream electing its leader: poll again
                continue
            await js.add_stream(config)
            return


async def measure(
    cluster: natsserver.Cluster, mode: str, args: argparse.Namespace, writers: int
) -> dict[str, float]:
    """Run one mode on a new stream; figures per change."""
    write = MODES[mode][0]
    clients = [await nats.connect(cluster.urls[0]) for _ in range(writers)]
    try:
        await _stream(clients[0], "BENCH", len(cluster.nodes), args.storage)
        todo = iter(range(args.changes))
        deadline = time.monotonic() + args.seconds
        done = 0

        async def writer(k: int) -> None:
            nonlocal done
            nc, versions = clients[k], dict.fromkeys(range(k, TASKS, writers), 0)
            tasks = list(versions)
            for i in todo:
                if time.monotonic() > deadline:
                    return
                task = tasks[i % len(tasks)]
                versions[task] = await write(nc, f"t{task}", versions[task])
                done += 1

        pids = [n.proc.pid for n in cluster.nodes if n.proc is not None]
        server0, client0 = sum(map(cpu_seconds, pids)), time.process_time()
        began = time.perf_counter()
        await asyncio.gather(*(writer(k) for k in range(writers)))
        wall = time.perf_counter() - began
        server, client = sum(map(cpu_seconds, pids)) - server0, time.process_time() - client0
    finally:
        for nc in clients:
            await nc.close()
    return {
        "changes": done,
        "wall_us": wall / done * 1e6,
        "client_cpu_us": client / done * 1e6,
        "server_cpu_us": server / done * 1e6,
        "changes_per_s": done / wall,
    }


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):7.0f} [{min(values):.0f}-{max(values):.0f}]"


def report(results: dict[str, dict[int, list[dict[str, float]]]], args: argparse.Namespace) -> None:
    """Print the table: median [min-max] over the repetitions."""
    print(f"\nnats-server, {args.nodes} node(s), {args.storage} storage, {args.reps} repetitions")
    print("per change, microseconds, median [min-max]")
    head = f"{'mode':20} {'writers':>7} {'acks':>4} {'RTs':>3}  {'wall':>18} "
    print(head + f"{'client CPU':>18} {'server CPU':>18} {'changes/s':>18}")
    for mode, by_writers in results.items():
        _, acks, trips = MODES[mode]
        for writers, reps in by_writers.items():
            row = f"{mode:20} {writers:7} {acks:4} {trips:3}  "
            row += " ".join(
                f"{_cell([r[key] for r in reps]):>18}"
                for key in ("wall_us", "client_cpu_us", "server_cpu_us", "changes_per_s")
            )
            print(row)


async def main(args: argparse.Namespace) -> dict[str, dict[int, list[dict[str, float]]]]:
    """Every mode at every writer count, ``--reps`` times, each repetition on new nodes."""
    results: dict[str, dict[int, list[dict[str, float]]]] = {
        mode: {w: [] for w in args.writers} for mode in MODES
    }
    names = list(MODES)
    for rep in range(args.reps):
        with natsserver.running(args.nodes) as cluster:
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for writers in args.writers:
                for mode in order:
                    figures = await measure(cluster, mode, args, writers)
                    results[mode][writers].append(figures)
                    print(f"rep {rep + 1} {mode:20} x{writers}: {figures['wall_us']:.0f} us")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=2000)
    parser.add_argument("--writers", type=lambda s: [int(w) for w in s.split(",")], default=[1, 16])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nodes", type=int, choices=(1, 3), default=1)
    parser.add_argument("--storage", choices=("file", "memory"), default="file")
    parser.add_argument("--seconds", type=float, default=20.0, help="per mode, at most")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "bench" / "results" / "nats_batches.json"
    )
    arguments = parser.parse_args()
    found = asyncio.run(main(arguments))
    report(found, arguments)
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    arguments.json.write_text(
        json.dumps(
            {
                "args": {**vars(arguments), "json": str(arguments.json)},
                "machine": platform.platform(),
                "results": {m: {str(w): r for w, r in by.items()} for m, by in found.items()},
            },
            indent=1,
        )
    )
    print(f"\nwrote {arguments.json}")

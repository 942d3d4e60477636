"""The tasks a scale run stores, written into a journal; an in-memory server filled with them.

    .venv/bin/python -m bench.population --size N   # in-memory instance holding N tasks

Task ``i`` of a run is a pure function of ``i``, so the load generator knows
every task's id, scope, context and state without asking: ``SCOPES`` scopes
in turn (the anonymous one, which the load generator calls as, then tenants
``tenant-1`` ...), ``CONTEXTS`` contexts per scope, and in each context 60 %
COMPLETED (with an artifact), 10 % FAILED, 10 % CANCELED and 20 % waiting in
INPUT_REQUIRED. Each task's status timestamp is the wall clock when it was
written, so the newest tasks have the newest timestamps (as in service).

Filling goes through the ``TaskJournal`` API, not through SendMessage: a
task is recorded as it stands (one write; a waiting task in JetStream is a
record message and a snapshot, as its first write makes it), which fills
100,000 tasks in seconds instead of running an agent for each. Waiting tasks
on NATS are recorded as owned by nobody (as a released task is), so no
instance's lease sweep takes the filler for a lost owner and ends them while
they are measured.

As a command: builds ``A2AService`` (in memory, retention raised to hold
every task, nothing else changed) on a grpc.aio server made as
``bench.servers`` makes ``ours``, fills its journal, prints ``filled <N>
<seconds>`` and ``ready <port>`` on stdout and serves on 127.0.0.1 until
SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import logging
import signal
import sys
import time
import uuid

import grpc
from a2a.types.a2a_pb2 import (
    Artifact,
    Message,
    Part,
    Role,
    StreamResponse,
    Task,
    TaskState,
)

from a2a_grpc_server import A2AService, ServerConfig, grpc_options
from a2a_grpc_server._internal.app.card import default_card
from a2a_grpc_server._internal.journal import Change, TaskJournal
from a2a_grpc_server._internal.model.scope import scope_key

from .agents import Workload

SCOPES = 4
"""Scopes the tasks are spread over, in turn (scope 0 is the anonymous one)."""
CONTEXTS = 10
"""Contexts per scope."""
STATES = (
    *[TaskState.TASK_STATE_COMPLETED] * 6,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_CANCELED,
    *[TaskState.TASK_STATE_INPUT_REQUIRED] * 2,
)
"""A task's state by ``(i // SCOPES // CONTEXTS) % 10``: independent of its context."""
WAITING = TaskState.TASK_STATE_INPUT_REQUIRED
FILL_CONCURRENCY = 256
"""Writes in flight while filling a journal over the network."""


def task_id(i: int) -> str:
    """The id of task ``i`` (a uuid4 made from ``i``)."""
    digest = hashlib.blake2b(f"scale-{i}".encode(), digest_size=16).digest()
    return str(uuid.UUID(bytes=digest, version=4))


def tenant(i: int) -> str:
    """The ``tenant`` a request names to reach task ``i``'s scope ("" for the anonymous one)."""
    s = i % SCOPES
    return f"tenant-{s}" if s else ""


def scope(i: int) -> str:
    """Task ``i``'s scope key (no authentication: the tenant alone makes it)."""
    return scope_key(tenant(i), "")


def context_id(i: int) -> str:
    """Task ``i``'s context."""
    return f"ctx-{i % SCOPES}-{(i // SCOPES) % CONTEXTS}"


def state(i: int) -> TaskState:
    """Task ``i``'s state."""
    return STATES[(i // SCOPES // CONTEXTS) % len(STATES)]


def make_task(i: int) -> Task:
    """Task ``i`` as stored: a user message, a status (stamped now), an artifact if COMPLETED."""
    task = Task(id=task_id(i), context_id=context_id(i))
    task.history.append(
        Message(
            message_id=f"m-{i}",
            role=Role.ROLE_USER,
            context_id=task.context_id,
            task_id=task.id,
            parts=[Part(text=f"scale task {i}: summarise the quarterly report, briefly")],
        )
    )
    task.status.state = state(i)
    task.status.timestamp.FromNanoseconds(time.time_ns())
    if state(i) == WAITING:
        task.status.message.CopyFrom(
            Message(message_id=f"q-{i}", role=Role.ROLE_AGENT, parts=[Part(text="Which year?")])
        )
    elif state(i) == TaskState.TASK_STATE_COMPLETED:
        task.artifacts.append(
            Artifact(artifact_id=f"a-{i}", name="summary", parts=[Part(text="x" * 160)])
        )
    return task


def first_change(task: Task) -> list[Change]:
    """The change a task's first write records: its ``Task`` frame, seq 1."""
    frame = StreamResponse(task=task).SerializeToString()
    return [Change(1, frame, int(task.status.state))]


async def fill(
    journal: TaskJournal,
    start: int,
    stop: int,
    concurrency: int = 1,
) -> None:
    """Record tasks ``start`` .. ``stop - 1``, ``concurrency`` writes at a time.

    A final task is recorded without frames (``keep_frames=False``: nobody can
    ask for them, as for a unary task); a waiting one with its first frame.

    Raises:
        StoreError: A write failed.
    """

    async def one(i: int) -> None:
        task = make_task(i)
        keep = state(i) == WAITING
        await journal.create(task, first_change(task), keep_frames=keep, scope=scope(i))

    if concurrency <= 1:
        for i in range(start, stop):
            await one(i)
        return
    queue = iter(range(start, stop))

    async def worker() -> None:
        for i in queue:  # (shared: each index is taken by one worker)
            await one(i)

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())


async def serve(size: int) -> None:
    """Fill an in-memory instance with ``size`` tasks, then serve until SIGTERM."""
    # Retention raised to keep every task (the default keeps 10,000 results).
    config = ServerConfig(max_final_tasks=max(size, 10_000))
    service = A2AService(Workload(), default_card(), config=config)
    began = time.perf_counter()
    await fill(service.journal, 0, size)
    print(f"filled {size} {time.perf_counter() - began:.3f}", flush=True)
    await service.start()
    server = grpc.aio.server(
        options=[*grpc_options(service.config), ("grpc.so_reuseport", 0)],
        interceptors=service.interceptors(),
    )
    service.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    gc.collect()
    gc.freeze()  # as `a2a-grpc-server serve` does
    print(f"ready {port}", flush=True)
    await stop.wait()
    await service.shutdown(0)
    await server.stop(None)


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, required=True, help="tasks to store")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(args.size))
    sys.exit(0)


if __name__ == "__main__":
    main()

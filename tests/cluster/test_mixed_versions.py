"""Two versions side by side in one cluster (issue 21): the previous one (0.1.0, before
formats were versioned: tests/fixtures/previous) and this one, as in a rolling update.

While the old instance runs, the new one writes format 1 (what the old one reads); tasks
started through either are read and continued through the other. Once the old instance is
replaced, the new ones write format 2 (a lease later). See ``jetstream.formats``.

Then the task log (format 3, issue 41), on by default: beside the last version of format 2
(tests/fixtures/format-2) this one keeps to the bucket; beside a version that reads the log
but does not create tasks there (tests/fixtures/log-reader, 93131b4, as the release before
this one) it creates them in the log, and the old one reads, streams and, after a rollback,
continues them.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import nats
import nats.js.errors
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    ListTasksRequest,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)

from a2a_grpc_server._internal.jetstream import formats
from a2a_grpc_server._internal.jetstream.conn import LOG_STREAM, LOG_SUBJECT, TASKS_BUCKET
from a2a_grpc_server._internal.jetstream.index import HEADER as INDEX_HEADER
from a2a_grpc_server._internal.model import taskops
from tests.support import ROOT, cluster_key_file
from tests.support.harness import V1, send_request, user_message
from tests.support.serveproc import Process, logged, start

S = TaskState
WHEEL = ROOT / "tests" / "fixtures" / "previous" / "a2a_grpc_server-0.1.0-py3-none-any.whl"
AGENT = ("--agent", "tests.support.agents:InputAgent")


def unpacked(wheel: Path, into: Path) -> dict[str, str]:
    """The environment that runs a wheel's code (unpacked into ``into``) instead of this one's."""
    with zipfile.ZipFile(wheel) as opened:
        opened.extractall(into)
    return {"PYTHONPATH": f"{into}:{ROOT}"}


class Cluster:
    """``serve`` processes of several versions, each started with ``common``; ``running``
    closes their clients and kills what is still up."""

    def __init__(self, *common: str) -> None:
        self.common = common
        self.processes: list[Process] = []
        self.channels: list[grpc.aio.Channel] = []

    async def launch(
        self, *args: str, env: dict[str, str] | None = None
    ) -> a2a_pb2_grpc.A2AServiceStub:
        """Start one more (``env``: another version's, see ``unpacked``); a client of it."""
        process = await start(*AGENT, *self.common, *args, env=env)
        self.processes.append(process)
        channel = grpc.aio.insecure_channel(process.grpc_addr)
        self.channels.append(channel)
        return a2a_pb2_grpc.A2AServiceStub(channel)


@contextlib.asynccontextmanager
async def running(*common: str) -> AsyncIterator[Cluster]:
    """A ``Cluster``, torn down on the way out."""
    cluster = Cluster(*common)
    try:
        yield cluster
    finally:
        for channel in cluster.channels:
            await channel.close()
        for process in cluster.processes:
            if process.proc.returncode is None:
                process.proc.kill()
                await process.proc.wait()


async def ask(stub: a2a_pb2_grpc.A2AServiceStub) -> Task:
    task: Task = (await stub.SendMessage(send_request("hi"), metadata=V1, timeout=10)).task
    assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
    return task


async def answer(stub: a2a_pb2_grpc.A2AServiceStub, task: Task) -> Task:
    message = user_message("Ada", task_id=task.id, context_id=task.context_id)
    request = SendMessageRequest(message=message)
    done: Task = (await stub.SendMessage(request, metadata=V1, timeout=10)).task
    return done


async def snapshot_marked(nats_url: str, task_id: str) -> bool:
    """Whether the task's snapshot is in format 2 (marked) rather than format 1."""
    client = await nats.connect(nats_url)
    try:
        entry = await (await client.jetstream().key_value(TASKS_BUCKET)).get(task_id)
        assert entry.value is not None
        return entry.value.startswith(formats.MAGIC)
    finally:
        await client.close()


async def snapshot_indexed(nats_url: str, task_id: str) -> bool:
    """Whether the task's snapshot names its entries in the listing index."""
    client = await nats.connect(nats_url)
    try:
        msg = await client.jetstream().get_msg(
            f"KV_{TASKS_BUCKET}", subject=f"$KV.{TASKS_BUCKET}.{task_id}"
        )
        return INDEX_HEADER in (msg.headers or {})
    finally:
        await client.close()


async def test_the_previous_version_and_this_one_share_a_cluster_through_a_rolling_update(
    nats_url: str, tmp_path: Path
) -> None:
    # This version signs routed requests; the previous one does not, so this one trusts the
    # bus during the update (the documented upgrade path), and 0.1.0 ignores the signature.
    trust = "--nats-trust-bus"
    async with running("--nats", nats_url, "--lease", "1") as cluster, asyncio.timeout(90):
        processes = cluster.processes
        old = await cluster.launch(env=unpacked(WHEEL, tmp_path / "0.1.0"))
        new = await cluster.launch(trust, "--no-nats-task-log")  # (formats 1 and 2: this test's)
        # Each reads and continues what the other started (the new one writes format 1).
        from_old, from_new = await ask(old), await ask(new)
        for task, reader in ((from_old, new), (from_new, old)):
            seen = await reader.GetTask(GetTaskRequest(id=task.id), metadata=V1)
            assert seen.status.state == S.TASK_STATE_INPUT_REQUIRED
        assert not await snapshot_marked(nats_url, from_new.id), "format 1 beside 0.1.0"
        assert (await answer(new, from_old)).status.state == S.TASK_STATE_COMPLETED
        assert (await answer(old, from_new)).status.state == S.TASK_STATE_COMPLETED
        # The old instance is replaced by a new one: format 2 follows, read by both.
        processes[0].proc.send_signal(signal.SIGTERM)
        assert await processes[0].proc.wait() == 0
        other = await cluster.launch(trust, "--no-nats-task-log")
        await logged(processes[1], "writing format 2")  # the old one left
        later = await ask(new)
        assert await snapshot_marked(nats_url, later.id)
        assert (await answer(other, later)).status.state == S.TASK_STATE_COMPLETED
        finished = await new.GetTask(GetTaskRequest(id=from_old.id), metadata=V1)
        assert finished.status.state == S.TASK_STATE_COMPLETED, "format 1 read after"
        # Every instance keeps the listing index now: the smallest live one indexes
        # what 0.1.0 wrote (snapshots without entries), and listings find all of it.
        builders = [asyncio.create_task(logged(p, "listing index built")) for p in processes[1:]]
        _, waiting = await asyncio.wait(builders, return_when=asyncio.FIRST_COMPLETED)
        for builder in waiting:
            builder.cancel()
        assert await snapshot_indexed(nats_url, from_old.id), "indexed once 0.1.0 left"
        for stub in (new, other):
            listed = await stub.ListTasks(ListTasksRequest(page_size=10), metadata=V1)
            assert {from_old.id, from_new.id, later.id} <= {t.id for t in listed.tasks}


FORMAT_2 = ROOT / "tests" / "fixtures" / "format-2" / "a2a_grpc_server-0.2.0.dev0-py3-none-any.whl"
"""The last version of format 2."""


async def in_the_log(nats_url: str, task_id: str) -> bool:
    """Whether the task lives in the task log (format 3) rather than the snapshot bucket."""
    client = await nats.connect(nats_url)
    try:
        try:
            await client.jetstream().get_last_msg(LOG_STREAM, f"{LOG_SUBJECT}.t.{task_id}.>")
        except nats.js.errors.NotFoundError:
            return False
        return True
    finally:
        await client.close()


async def test_the_task_log_waits_for_the_last_format_2_instance_and_rolls_back_before_it(
    nats_url: str, tmp_path: Path
) -> None:
    """Issue 41's upgrade rule: an instance with the task log on (the default)
    creates tasks in the bucket while one of the last format-2 version runs, so stopping it
    (a rollback) leaves every task readable; once no such instance is left, new tasks go to
    the log, and both layouts are read, continued and listed through every instance."""
    common = ("--nats", nats_url, "--lease", "1", "--nats-key-file", str(cluster_key_file()))
    async with running(*common) as cluster, asyncio.timeout(90):
        processes, launch = cluster.processes, cluster.launch
        old = await launch(env=unpacked(FORMAT_2, tmp_path / "format-2"))
        new = await launch()
        await logged(processes[1], "writing format 2")  # (it heard the old one)
        from_old, from_new = await ask(old), await ask(new)
        assert not await in_the_log(nats_url, from_new.id), "the bucket beside format 2"
        seen = await old.GetTask(GetTaskRequest(id=from_new.id), metadata=V1)
        assert seen.status.state == S.TASK_STATE_INPUT_REQUIRED
        assert (await answer(new, from_old)).status.state == S.TASK_STATE_COMPLETED
        # Rolled back: the new one stops; the old one serves what it started.
        processes[1].proc.send_signal(signal.SIGTERM)
        assert await processes[1].proc.wait() == 0
        assert (await answer(old, from_new)).status.state == S.TASK_STATE_COMPLETED
        # Rolled forward: two new instances replace the old one; the log follows.
        again = await launch()
        processes[0].proc.send_signal(signal.SIGTERM)
        assert await processes[0].proc.wait() == 0
        other = await launch()
        await logged(processes[2], "creating tasks in the task log")
        later = await ask(again)
        assert await in_the_log(nats_url, later.id)
        seen = await other.GetTask(GetTaskRequest(id=later.id), metadata=V1)
        assert seen.status.state == S.TASK_STATE_INPUT_REQUIRED
        assert (await answer(other, later)).status.state == S.TASK_STATE_COMPLETED
        for stub in (again, other):
            listed = await stub.ListTasks(ListTasksRequest(page_size=10), metadata=V1)
            ids = [t.id for t in listed.tasks]
            assert ids[0] == later.id, "the log's tasks first"
            assert {from_old.id, from_new.id, later.id} <= set(ids)
            done = await stub.GetTask(GetTaskRequest(id=from_old.id), metadata=V1)
            assert done.status.state == S.TASK_STATE_COMPLETED, "the bucket read after"


LOG_READER = (
    ROOT / "tests" / "fixtures" / "log-reader" / "a2a_grpc_server-0.2.0.dev0-py3-none-any.whl"
)
"""93131b4: it reads the log, and creates tasks in the bucket."""


async def test_the_log_turned_on_beside_a_version_that_only_reads_it_rolls_back_to_it(
    nats_url: str, tmp_path: Path
) -> None:
    """The rolling update that turns the task log on (issue 41): beside 93131b4 (which reads
    the log but creates tasks in the bucket, as the release before this one), this one
    creates tasks there by default; the old one reads them, streams their changes to the
    final frame and, once this one is stopped (a rollback), continues them."""
    common = ("--nats", nats_url, "--lease", "1", "--nats-key-file", str(cluster_key_file()))
    async with running(*common) as cluster, asyncio.timeout(90):
        processes, launch = cluster.processes, cluster.launch
        old = await launch(env=unpacked(LOG_READER, tmp_path / "log-reader"))
        new = await launch()
        await logged(processes[1], "creating tasks in the task log")  # (it heard the old)
        streamed, released = await ask(new), await ask(new)
        from_old = await ask(old)
        assert await in_the_log(nats_url, streamed.id), "the log, once all read it"
        assert not await in_the_log(nats_url, from_old.id), "the old one: the bucket"
        seen = await old.GetTask(GetTaskRequest(id=released.id), metadata=V1)
        assert seen.status.state == S.TASK_STATE_INPUT_REQUIRED
        # The old one streams a log task's changes, made through this one, to the end.
        call = old.SubscribeToTask(SubscribeToTaskRequest(id=streamed.id), metadata=V1)
        frames: list[StreamResponse] = [await anext(aiter(call))]
        assert (await answer(new, streamed)).status.state == S.TASK_STATE_COMPLETED
        frames += [frame async for frame in call]
        assert taskops.frame_state(frames[-1]) == S.TASK_STATE_COMPLETED, frames[-1]
        assert await call.code() == grpc.StatusCode.OK
        assert (await answer(new, from_old)).status.state == S.TASK_STATE_COMPLETED
        # Rolled back: this one stops; the old one continues the log task it left.
        processes[1].proc.send_signal(signal.SIGTERM)
        assert await processes[1].proc.wait() == 0
        assert (await answer(old, released)).status.state == S.TASK_STATE_COMPLETED
        listed = await old.ListTasks(ListTasksRequest(page_size=10), metadata=V1)
        assert {streamed.id, released.id, from_old.id} <= {t.id for t in listed.tasks}

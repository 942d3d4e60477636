"""Every format instances share says its version; readers read each known one and refuse
the rest, naming it (``jetstream.formats``). The samples in tests/fixtures/formats are
committed: format 1's are byte for byte what the version before formats were versioned
wrote (checked against that version's code when they were made), format 2's what this
version writes once every instance reads it."""

from __future__ import annotations

import asyncio
import json
import uuid

import grpc
import nats
import pytest
from a2a.types.a2a_pb2 import GetTaskRequest, Message, Role, StreamResponse, TaskState
from nats.aio.msg import Msg

from a2a_grpc_server._internal.errors import UnknownFormatError
from a2a_grpc_server._internal.jetstream import formats, pushstore, tasklog
from a2a_grpc_server._internal.jetstream.conn import NatsConfig, connect
from a2a_grpc_server._internal.jetstream.journal import Entry, JetStreamJournal, Snapshot
from a2a_grpc_server._internal.jetstream.requests import JetStreamRequests
from a2a_grpc_server._internal.jetstream.routing import control_subject
from a2a_grpc_server._internal.jetstream.signing import REPLY_TO, Signer
from a2a_grpc_server._internal.journal import Change, VersionConflictError
from tests.support import CLUSTER_KEY
from tests.support import formatfixtures as fx
from tests.support.agents import InputAgent
from tests.support.clusterharness import instances
from tests.support.harness import V1, send_request

S = TaskState


def message(name: str) -> Msg:
    headers, data = fx.load(name)
    return Msg(None, subject="a2a.events.x", data=data, headers=headers)  # type: ignore[arg-type]


def test_todays_writers_make_the_committed_samples_byte_for_byte() -> None:
    for name, sample in {**fx.samples(), **fx.future_samples()}.items():
        stored = json.loads((fx.DIR / f"{name}.json").read_text())
        assert stored == json.loads(json.dumps(sample)), f"{name} drifted from its sample"


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_snapshot_of_each_known_format_reads_the_same(fmt: int) -> None:
    _, value = fx.load(f"snapshot-{fmt}")
    snap = Snapshot.decode(value, 5)
    assert (snap.owner, snap.seq, snap.pos, snap.scope, snap.rev) == (
        "instance-a",
        3,
        7,
        "t:alice",
        5,
    )
    assert snap.task() == fx.sample_task()
    assert snap.state == S.TASK_STATE_INPUT_REQUIRED


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_record_message_of_each_known_format_reads_the_same(fmt: int) -> None:
    entries = Entry.unpack(message(f"record-{fmt}"), 11)
    changes = fx.sample_changes()
    assert [(e.seq, e.kind, e.state, e.pos) for e in entries] == [
        (3, "frame", S.TASK_STATE_INPUT_REQUIRED, 11),
        (4, "message", 0, 11),
    ]
    assert entries[0].data == changes[0].frame
    assert changes[1].message is not None
    assert entries[1].data == changes[1].message.SerializeToString()


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_push_config_of_each_known_format_reads_the_same(fmt: int) -> None:
    _, value = fx.load(f"push-config-{fmt}")
    number, cursor, config = pushstore._unpack(formats.unmark(value, "a push config"))
    assert (number, cursor, config) == (1_700_000_000_000_000_000, 3, fx.sample_config())


def log_message(name: str) -> Msg:
    """A committed sample of the task log, as a direct get or a consumer hands it over."""
    headers, data = fx.load(name)
    kind = "s" if name.endswith("-s") else "e"
    return Msg(None, subject=fx.LOG_WHERE.subject(kind), data=data, headers=headers)  # type: ignore[arg-type]


def test_a_message_of_the_task_log_format_3_reads_the_same() -> None:
    s = tasklog.decode(log_message("log-3-s"), 11)
    changes = fx.sample_changes()
    assert (s.kind, s.pos, s.origin, s.task_id, s.seq) == ("s", 11, 11, fx.TASK_ID, 4)
    assert (s.scope, s.owner, s.owner_token) == ("t:alice", fx.OWNER, tasklog.token(fx.OWNER))
    assert (s.state, s.status_ns) == (S.TASK_STATE_INPUT_REQUIRED, 1_764_547_200 * 10**9)
    assert s.task() == fx.sample_task()
    assert [(e.seq, e.kind, e.pos) for e in s.changes] == [(3, "frame", 11), (4, "message", 11)]
    assert s.changes[0].data == changes[0].frame
    e = tasklog.decode(log_message("log-3-e"), 12)
    assert (e.kind, e.seq, e.snapshot, [c.seq for c in e.changes]) == ("e", 4, None, [4])


def test_a_message_of_the_task_log_of_an_unknown_format_is_refused() -> None:
    headers, data = fx.load("log-9")
    msg = Msg(None, subject=fx.LOG_WHERE.subject("s"), data=data, headers=headers)  # type: ignore[arg-type]
    with pytest.raises(UnknownFormatError, match="in format '9'"):
        tasklog.decode(msg, 1)


def test_heartbeats_say_which_formats_an_instance_reads() -> None:
    assert formats.read_heartbeat(fx.load("heartbeat-1")[1]) == {1}, "an older version's"
    assert formats.read_heartbeat(fx.load("heartbeat-2")[1]) == {1, 2}
    assert formats.read_heartbeat(fx.load("heartbeat-3")[1]) == {1, 2, 3}
    assert formats.read_heartbeat(formats.heartbeat()) == formats.READS
    assert json.loads(formats.heartbeat())["version"]


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("snapshot-9", lambda v: Snapshot.decode(v, 1)),
        ("push-config-9", lambda v: formats.unmark(v, "a push config")),
    ],
)
def test_a_value_of_an_unknown_format_is_refused_naming_it(name: str, read: object) -> None:
    _, value = fx.load(name)
    with pytest.raises(UnknownFormatError, match="in format '9'") as refused:
        read(value)  # type: ignore[operator]
    assert refused.value.details()["format"] == "9"
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_record_message_of_an_unknown_format_or_kind_is_refused() -> None:
    with pytest.raises(UnknownFormatError, match="in format '9'"):
        Entry.unpack(message("record-9"), 1)
    with pytest.raises(UnknownFormatError, match="kind 120"):
        Entry.unpack(message("record-kind-x"), 1)


def test_the_format_written_is_the_newest_every_live_instance_reads() -> None:
    policy = formats.Formats()
    assert policy.writing == formats.LEGACY, "until every instance was heard from"
    policy.heard("new-1", formats.heartbeat())
    assert policy.writing == formats.LEGACY
    policy.settle()
    assert policy.writing == formats.CURRENT
    policy.heard("old-1", b"")  # an instance of the version before formats
    assert policy.writing == formats.LEGACY, "it could not read format 2"
    policy.heard("old-1", formats.heartbeat())  # it was upgraded (same id)
    assert policy.writing == formats.CURRENT
    policy.heard("old-2", b"")
    policy.gone("old-2")  # the last old instance left
    assert policy.writing == formats.CURRENT


async def test_routed_requests_of_an_unknown_format_or_without_their_caller_are_refused(
    nats_url: str,
) -> None:
    async with (
        asyncio.timeout(30),
        instances(InputAgent(), [nats_url], names=("A",), lease=60) as [a],
    ):
        answer = await a.stub.SendMessage(send_request("hi"), metadata=V1, timeout=10)
        task_id = answer.task.id
        client = await nats.connect(nats_url)
        try:

            async def ask(op: str, headers: dict[str, str]) -> Msg:
                # Signed with the cluster's key: what is refused is the format, not the sender.
                subject, payload = control_subject(a.instance_id, op), task_id.encode()
                inbox = client.new_inbox()
                headers[REPLY_TO] = inbox
                Signer(CLUSTER_KEY).sign(subject, headers, payload)
                answers = await client.subscribe(inbox)
                await client.publish(subject, payload, reply=inbox, headers=headers)
                try:
                    return await answers.next_msg(timeout=5)
                finally:
                    await answers.unsubscribe()

            caller = {"A2a-Caller": '[null, ""]', "A2a-Call-Headers": "[]"}
            for op, headers, what in [
                ("cancel", {"A2a-Call-Headers": "[]"}, "without its caller"),
                ("cancel", {**caller, formats.HEADER: "9"}, "in format '9'"),
            ]:
                reply = await ask(op, headers)
                assert (reply.headers or {}).get("A2a-Error") == "UnknownFormatError", op
                assert what in reply.data.decode()
        finally:
            await client.close()
        task = await a.stub.GetTask(GetTaskRequest(id=task_id), metadata=V1)
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED, "none of them was served"


async def test_an_instance_writes_format_1_while_an_older_one_is_in_the_cluster(
    nats_url: str,
) -> None:
    async with (
        asyncio.timeout(30),
        # (in the bucket, whose snapshots say their format: the log is format 3 throughout)
        instances(InputAgent(), [nats_url], names=("A", "B"), lease=1.0, task_log=False) as (a, b),
    ):
        await a.cluster.formats.wait_for(formats.CURRENT)  # both read 2 (a lease after start)
        newer = await a.stub.SendMessage(send_request("hi"), metadata=V1, timeout=10)
        # B now plays a version before formats: its heartbeats are empty.
        b_lease = b.cluster.lease
        assert b_lease is not None
        b_lease._kv = _Empty(b_lease._kv)  # type: ignore[assignment]
        await a.cluster.formats.wait_for(formats.LEGACY)
        older = await a.stub.SendMessage(send_request("hi"), metadata=V1, timeout=10)
        for answer, marked in ((newer, True), (older, False)):
            stored = await a.cluster.conn.tasks.get(answer.task.id)
            assert stored.value is not None
            assert stored.value.startswith(formats.MAGIC) is marked
            seen = await b.stub.GetTask(GetTaskRequest(id=answer.task.id), metadata=V1)
            assert seen.status.state == S.TASK_STATE_INPUT_REQUIRED, "B reads either"


class _Empty:
    """A KV bucket whose puts carry no value (an older version's heartbeat)."""

    def __init__(self, kv: object) -> None:
        self._kv = kv

    async def put(self, key: str, value: bytes) -> int:
        return await self._kv.put(key, b"")  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._kv, name)


async def test_a_claim_holds_the_released_version_so_no_message_runs_twice(nats_url: str) -> None:
    conn = await connect(NatsConfig(servers=[nats_url], instance_id="writer"))
    requests = JetStreamRequests(conn.nc)
    await requests.start()
    settled = formats.Formats()
    settled.settle()  # (alone: every instance reads format 2)
    a = JetStreamJournal(requests, conn.js, "a", formats=settled)
    b = JetStreamJournal(requests, conn.js, "b", formats=settled)
    try:
        for late in ("before the claim", "after the claim"):
            waiting = fx.sample_task()
            waiting.id = f"t-{uuid.uuid4()}"
            frame = StreamResponse(task=waiting).SerializeToString()
            version = await a.create(waiting, [Change(1, frame, waiting.status.state)])
            assert await a.ownership.release(waiting.id, "a") and not await b.ownership.release(
                waiting.id, "a"
            )
            message = Message(message_id=f"m-{late}", role=Role.ROLE_USER, task_id=waiting.id)
            if late == "before the claim":  # the former owner, partitioned, appends anyway
                await a.update(waiting, version, [Change(2, message=message)])
                assert await b.ownership.claim(waiting.id) is None, "written after the release"
            else:
                claimed = await b.ownership.claim(waiting.id)
                assert claimed is not None and claimed.owner == "b"
                await a.update(waiting, version, [Change(2, message=message)])
                with pytest.raises(VersionConflictError):  # so b never runs a second message
                    await b.update(claimed.task, claimed.version, [Change(2, message=message)])
    finally:
        await a.close()
        await b.close()
        await requests.close()
        await conn.close()

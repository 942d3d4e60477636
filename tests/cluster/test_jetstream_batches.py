"""Spike for issue 41: one atomic JetStream batch per change of a task, on a real nats-server.

Nothing here uses the server's code: nats-py and raw JetStream requests only, on one
node and on a 3-node cluster with the stream at R3. Each test makes its own stream, on
subjects of its own (``<prefix>.task.<id>.ev``, ``<prefix>.task.<id>.snap``,
``<prefix>.idx.>``, ``<prefix>.key.<digest>``), and asserts what the engine does:

* one batch carries a task's event (compare-and-set on its subject), its snapshot (a
  rollup of its subject) and its index entry, and is stored whole with one ack;
* a failed check anywhere in the batch stores none of it, and the commit says why;
* a retry key's claim (a compare-and-set on its own subject, with a TTL) joins the
  batch that creates the task, so a second claim fails whole;
* ``Nats-TTL``, ``Nats-Rollup`` and ``Nats-Msg-Id`` work inside a batch; what the engine
  refuses inside one (table below), and that a message for another stream (a KV bucket)
  cannot join it;
* how a reader gets the newest snapshot and lists one scope's index.

How a batch is published (ADR-50, nats-server 2.12+; nats-py 2.16 has no API for it):
every message carries ``Nats-Batch-Id`` and ``Nats-Batch-Sequence`` (1, 2, …), the last
one ``Nats-Batch-Commit: 1`` and a reply subject; only the commit needs a reply, so a
batch costs one round trip. The decision record is docs/decisions/0001-cluster-store-layout.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from tests.support import natsserver
from tests.support.spikes import add_stream

Message = tuple[str, bytes, Mapping[str, str]]
"""One message of a batch: subject, payload, headers."""

ROLLUP = {"Nats-Rollup": "sub"}
TIMEOUT = 10.0
"""Seconds any one request may take (R3 included)."""
_streams = itertools.count()


def cas(version: int) -> dict[str, str]:
    """The compare-and-set header: the subject's last stored sequence must be ``version``."""
    return {"Nats-Expected-Last-Subject-Sequence": str(version)}


async def make_stream(nc: NATS, cluster: natsserver.Cluster, **options: Any) -> tuple[str, str]:
    """A stream of its own, at as many replicas as nodes; its name and subject prefix.

    ``options`` change the defaults: atomic batches, rollups, per-message TTLs and
    direct gets allowed. Waits while a new cluster elects its JetStream leader, and
    until the stream answers on the node of ``nc`` (on R3 its interest reaches the
    other nodes a moment after it is created).
    """
    n = next(_streams)
    name, prefix = f"SPIKE_{n}", f"spike{n}"
    config = StreamConfig(
        name=name,
        subjects=[f"{prefix}.task.*.*", f"{prefix}.idx.>", f"{prefix}.key.*"],
        num_replicas=len(cluster.nodes),
        **{
            "allow_atomic": True,
            "allow_rollup_hdrs": True,
            "allow_msg_ttl": True,
            "allow_direct": True,
            **options,
        },
    )
    async with asyncio.timeout(30):
        info = await add_stream(nc.jetstream(timeout=2.0), config)
        assert info.config.num_replicas == len(cluster.nodes)
        while True:
            if await _answers(nc, name, prefix):
                return name, prefix
            await asyncio.sleep(0.01)  # sync-ok: paces polling while the stream's interest spreads


async def _answers(nc: NATS, stream: str, prefix: str) -> bool:
    """Whether the stream takes publishes on each of its subjects and answers direct gets.

    Probes store nothing: each publish expects a version its subject does not have.
    """
    for subject in (f"{prefix}.task.probe.ev", f"{prefix}.idx.probe", f"{prefix}.key.probe"):
        try:
            await nc.request(subject, b"", TIMEOUT, headers=cas(1))
        except nats.errors.NoRespondersError:
            return False
    get = await nc.request(f"$JS.API.DIRECT.GET.{stream}.{prefix}.idx.probe", b"", TIMEOUT)
    return (get.headers or {}).get("Status") == "404"


async def publish_batch(
    nc: NATS, messages: Sequence[Message], *, ask_first: bool = False
) -> dict[str, Any]:
    """Publish ``messages`` as one atomic batch; the commit's answer (a PubAck or an error).

    Only the commit is a request, unless ``ask_first`` (ADR-50's start: the first
    message a request too, answered empty), which is asserted here.
    """
    batch = nats.nuid.NUID().next().decode()
    last = len(messages)
    for seq, (subject, payload, headers) in enumerate(messages, 1):
        marks = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(seq)}
        if seq == last:
            marks["Nats-Batch-Commit"] = "1"
        if seq == last or (seq == 1 and ask_first):
            reply = await nc.request(subject, payload, TIMEOUT, headers={**headers, **marks})
            if seq < last:
                assert reply.data == b""  # the start acknowledged, nothing stored yet
                continue
            answer: dict[str, Any] = json.loads(reply.data)
            return answer
        await nc.publish(subject, payload, headers={**headers, **marks})
    raise AssertionError("an empty batch")


async def subjects(nc: NATS, stream: str, pattern: str = ">") -> dict[str, int]:
    """How many messages the stream holds on each subject matching ``pattern``."""
    info = await nc.jetstream(timeout=TIMEOUT).stream_info(stream, subjects_filter=pattern)
    return dict(info.state.subjects or {})


async def direct_get(nc: NATS, stream: str, request: dict[str, Any]) -> list[Msg]:
    """A batched direct get: the messages answered, up to the end-of-batch (status 204).

    Raises:
        AssertionError: Another status (the status and its description).
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: list[Msg] = []
    try:
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), inbox)
        while True:
            msg = await sub.next_msg(timeout=TIMEOUT)
            status = (msg.headers or {}).get("Status")
            if status is None:
                found.append(msg)
            elif status == "204":
                return found
            else:
                raise AssertionError(f"{status} {(msg.headers or {}).get('Description')}")
    finally:
        await sub.unsubscribe()


def change(
    prefix: str, task: str, version: int, *, snap: int | None, scope: str = "s"
) -> list[Message]:
    """A task's change: its event (compare-and-set on ``version``), snapshot, index entry.

    ``snap``: the snapshot subject's last sequence (compare-and-set; None: no check).
    """
    snapshot = {**ROLLUP, **(cas(snap) if snap is not None else {})}
    return [
        (f"{prefix}.task.{task}.ev", f"event after {version}".encode(), cas(version)),
        (f"{prefix}.task.{task}.snap", f"snapshot after {version}".encode(), snapshot),
        (f"{prefix}.idx.{scope}.{task}", f"entry after {version}".encode(), ROLLUP),
    ]


async def test_one_batch_stores_a_change_its_snapshot_and_its_index_entry_with_one_ack(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, p = await make_stream(nc, cluster)
        info = await nc.jetstream(timeout=TIMEOUT).stream_info(stream)
        assert info.cluster is not None
        assert len(info.cluster.replicas or []) == len(cluster.nodes) - 1  # R3: 2 followers
        created = await publish_batch(nc, change(p, "t1", 0, snap=0))
        assert created == {"stream": stream, "seq": 3, "batch": created["batch"], "count": 3}

        # the next change: its event checks the task's version (1), the snapshot rolls
        # up its subject and the entry its own; the ack names the last message (6)
        updated = await publish_batch(nc, change(p, "t1", 1, snap=2))
        assert (updated["seq"], updated["count"]) == (6, 3)
        assert await subjects(nc, stream) == {
            f"{p}.task.t1.ev": 2,
            f"{p}.task.t1.snap": 1,
            f"{p}.idx.s.t1": 1,
        }
        js = nc.jetstream(timeout=TIMEOUT)
        snap = await js.get_last_msg(stream, f"{p}.task.t1.snap", direct=True)
        assert (snap.seq, snap.data) == (5, b"snapshot after 1")
        # the batch headers stay on what is stored (63 bytes a message, 85 on the commit)
        assert snap.headers is not None
        assert snap.headers["Nats-Batch-Id"] == updated["batch"]
        assert snap.headers["Nats-Batch-Sequence"] == "2"
        entry = await js.get_last_msg(stream, f"{p}.idx.s.t1", direct=True)
        assert entry.headers is not None and entry.headers["Nats-Batch-Commit"] == "1"


async def test_a_batch_whose_first_message_is_a_request_is_answered_empty_then_acked(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, p = await make_stream(nc, cluster)
        ack = await publish_batch(nc, change(p, "t1", 0, snap=0), ask_first=True)
        assert (ack["stream"], ack["seq"], ack["count"]) == (stream, 3, 3)


async def test_a_failed_check_stores_nothing_of_the_batch_and_the_commit_says_why(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, p = await make_stream(nc, cluster)
        await publish_batch(nc, change(p, "t1", 0, snap=0))
        before = await subjects(nc, stream)

        stale = await publish_batch(nc, change(p, "t1", 0, snap=2))  # the version is 1
        assert stale == {
            "error": {"code": 400, "err_code": 10071, "description": "wrong last sequence: 1"},
            "stream": stream,
            "seq": 0,
        }
        # a check failing on the last message takes the ones before it down too
        late = change(p, "t1", 1, snap=2)
        late[2] = (late[2][0], late[2][1], {**ROLLUP, **cas(99)})
        refused = await publish_batch(nc, late)
        assert refused["error"] == {
            "code": 400,
            "err_code": 10071,
            "description": "wrong last sequence: 3",
        }
        assert await subjects(nc, stream) == before
        snap = await nc.jetstream(timeout=TIMEOUT).get_last_msg(
            stream, f"{p}.task.t1.snap", direct=True
        )
        assert snap.data == b"snapshot after 0"


async def test_of_two_writers_racing_on_one_version_exactly_one_batch_lands(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    other = await nats.connect(cluster.urls[-1])  # on R3 another node than ``nc``'s
    try:
        async with asyncio.timeout(40):
            stream, p = await make_stream(nc, cluster)
            await publish_batch(nc, change(p, "t1", 0, snap=0))
            for _ in range(20):  # (each round a new version both try to extend)
                info = await nc.jetstream(timeout=TIMEOUT).stream_info(stream)
                ev = await nc.jetstream(timeout=TIMEOUT).get_last_msg(
                    stream, f"{p}.task.t1.ev", direct=True
                )
                snap = info.state.last_seq - 1
                answers = await asyncio.gather(
                    publish_batch(nc, change(p, "t1", ev.seq or 0, snap=snap)),
                    publish_batch(other, change(p, "t1", ev.seq or 0, snap=snap)),
                )
                assert sorted("error" in a for a in answers) == [False, True]
                error = next(a["error"] for a in answers if "error" in a)
                # 10071 once the winner is stored; 10164 while it is still in flight
                assert error["err_code"] in (10071, 10164)
            assert (await subjects(nc, stream))[f"{p}.task.t1.ev"] == 21
    finally:
        await other.close()


async def test_a_retry_key_claimed_in_the_creating_batch_fails_a_second_creation_whole(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, p = await make_stream(nc, cluster)
        claim: Message = (f"{p}.key.k1", b"t1", {**cas(0), "Nats-TTL": "10m"})
        assert (await publish_batch(nc, [claim, *change(p, "t1", 0, snap=0)]))["count"] == 4
        # the same message id again, which would start another task: refused, whole
        again: Message = (f"{p}.key.k1", b"t2", {**cas(0), "Nats-TTL": "10m"})
        refused = await publish_batch(nc, [again, *change(p, "t2", 0, snap=0)])
        assert refused["error"]["err_code"] == 10071
        assert refused["error"]["description"] == "wrong last sequence: 1"
        assert set(await subjects(nc, stream)) == {
            f"{p}.key.k1",
            f"{p}.task.t1.ev",
            f"{p}.task.t1.snap",
            f"{p}.idx.s.t1",
        }


async def test_a_per_message_ttl_a_rollup_and_a_message_id_are_kept_inside_a_batch(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, p = await make_stream(nc, cluster)
        ttl = {"Nats-TTL": "1h"}
        batch = change(p, "t1", 0, snap=0)
        batch[0] = (batch[0][0], batch[0][1], {**cas(0), "Nats-Msg-Id": "t1:1"})
        batch[1] = (batch[1][0], batch[1][1], {**batch[1][2], **ttl})
        batch[2] = (batch[2][0], batch[2][1], {**batch[2][2], **ttl})
        assert "error" not in await publish_batch(nc, batch)
        js = nc.jetstream(timeout=TIMEOUT)
        for subject in (f"{p}.task.t1.snap", f"{p}.idx.s.t1"):
            stored = await js.get_last_msg(stream, subject, direct=True)
            assert stored.headers is not None
            assert (stored.headers["Nats-TTL"], stored.headers["Nats-Rollup"]) == ("1h", "sub")

        # a retry of a batch that landed (its answer lost) is told so by its message id:
        # 10201, before the compare-and-set is checked, and nothing more is stored
        retried = await publish_batch(nc, batch)
        assert retried["error"] == {
            "code": 400,
            "err_code": 10201,
            "description": "atomic publish batch contains duplicate message id",
        }
        assert await subjects(nc, stream, f"{p}.task.t1.ev") == {f"{p}.task.t1.ev": 1}


# What the engine refuses inside a batch, each time dropping the whole batch: the case,
# the stream's options, the second message's subject (``ev``: the first one's, the
# task's event, again), both messages' headers, the refusal (a rollup's is a 500).
REFUSALS: list[tuple[str, dict[str, Any], str, list[dict[str, str]], int, str]] = [
    ("ttl-not-allowed", {"allow_msg_ttl": False}, "snap", [cas(0), {"Nats-TTL": "1h"}], 10166,
     "per-message TTL is disabled"),
    ("rollup-not-allowed", {"allow_rollup_hdrs": False}, "snap", [cas(0), ROLLUP], 10111,
     "rollup not permitted"),
    ("rollup-of-a-subject-written-before", {}, "ev", [{}, ROLLUP], 10111,
     "batch rollup sub invalid"),
    ("rollup-all-not-first", {}, "snap", [{}, {"Nats-Rollup": "all"}], 10111,
     "batch rollup all invalid"),
    ("check-of-a-subject-written-before", {}, "ev", [{}, cas(0)], 10164, "wrong last sequence"),
    ("expected-last-sequence-not-first", {}, "snap", [{}, {"Nats-Expected-Last-Sequence": "1"}],
     10164, "wrong last sequence"),
    ("expected-last-msg-id", {}, "snap", [{"Nats-Expected-Last-Msg-Id": "x"}, {}], 10177,
     "atomic publish unsupported header used: Nats-Expected-Last-Msg-Id"),
    ("one-message-id-twice", {}, "snap", [{"Nats-Msg-Id": "x"}, {"Nats-Msg-Id": "x"}], 10201,
     "atomic publish batch contains duplicate message id"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "second", "headers", "err_code", "description"),
    [case[1:] for case in REFUSALS],
    ids=[case[0] for case in REFUSALS],
)
async def test_what_a_batch_may_not_carry_drops_the_whole_batch(
    nc: NATS,
    cluster: natsserver.Cluster,
    options: dict[str, Any],
    second: str,
    headers: list[dict[str, str]],
    err_code: int,
    description: str,
) -> None:
    async with asyncio.timeout(40):
        stream, p = await make_stream(nc, cluster, **options)
        batch: list[Message] = [
            (f"{p}.task.t1.ev", b"one", headers[0]),
            (f"{p}.task.t1.{second}", b"two", headers[1]),
            (f"{p}.idx.s.t1", b"entry", {}),
        ]
        answer = await publish_batch(nc, batch)
        code = 500 if err_code == 10111 else 400
        assert answer["error"] == {"code": code, "err_code": err_code, "description": description}
        assert await subjects(nc, stream) == {}


async def test_a_message_for_another_stream_cannot_join_a_batch(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, p = await make_stream(nc, cluster)
        js = nc.jetstream(timeout=TIMEOUT)
        bucket = f"SPIKE_KV_{p}"
        kv = await js.create_key_value(bucket=bucket, replicas=len(cluster.nodes))
        # the snapshot in a KV bucket (its own stream, no atomic publish): the bucket
        # drops its message, so the task's stream sees a gap and drops the rest
        answer = await publish_batch(
            nc,
            [
                (f"{p}.task.t1.ev", b"event", cas(0)),
                (f"$KV.{bucket}.t1", b"snapshot", {}),
                (f"{p}.idx.s.t1", b"entry", ROLLUP),
            ],
        )
        assert answer["error"] == {
            "code": 400,
            "err_code": 10176,
            "description": "atomic publish batch is incomplete",
        }
        # and ended by it, the bucket's stream answers the commit itself
        answer = await publish_batch(
            nc, [(f"{p}.task.t1.ev", b"event", cas(0)), (f"$KV.{bucket}.t1", b"snapshot", {})]
        )
        assert answer["error"]["err_code"] == 10174  # atomic publish is disabled
        assert answer["stream"] == f"KV_{bucket}"
        assert await subjects(nc, stream) == {}
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("t1")


async def test_a_batch_holds_at_most_1000_messages_and_a_stream_50_open_batches(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(50):
        stream, p = await make_stream(nc, cluster)
        entries = [(f"{p}.idx.big.t{i}", b"entry", ROLLUP) for i in range(1001)]
        too_large = await publish_batch(nc, entries)
        assert too_large["error"] == {
            "code": 400,
            "err_code": 10199,
            "description": "atomic publish batch is too large: 1000",
        }
        assert (await publish_batch(nc, entries[:1000]))["count"] == 1000

        # batches opened and not committed: the 51st is refused (429) until one ends
        opened = [f"open-{i}" for i in range(51)]
        answers = []
        for batch in opened:
            marks = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "1"}
            answers.append(await nc.request(f"{p}.idx.s.x", b"", TIMEOUT, headers=marks))
        assert [a.data for a in answers[:50]] == [b""] * 50
        assert json.loads(answers[50].data)["error"] == {
            "code": 429,
            "err_code": 10210,
            "description": "atomic publish too many inflight",
        }
        for batch in opened[:50]:  # a gap abandons a batch at once (else after 10 s)
            marks = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "3"}
            gap = await nc.request(f"{p}.idx.s.x", b"", TIMEOUT, headers=marks)
            assert json.loads(gap.data)["error"]["err_code"] == 10176
        assert await subjects(nc, stream, f"{p}.idx.s.>") == {}


async def test_a_reader_gets_the_newest_snapshots_and_lists_one_scope(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(40):
        stream, p = await make_stream(nc, cluster)
        for task, scope in (("t1", "a"), ("t2", "a"), ("t3", "b"), ("t4", "a")):
            assert "error" not in await publish_batch(nc, change(p, task, 0, snap=0, scope=scope))
        t1 = await nc.jetstream(timeout=TIMEOUT).get_last_msg(stream, f"{p}.task.t1.ev")
        snap = (await nc.jetstream(timeout=TIMEOUT).get_last_msg(stream, f"{p}.task.t1.snap")).seq
        assert "error" not in await publish_batch(
            nc, change(p, "t1", t1.seq or 0, snap=snap, scope="a")
        )

        # the newest snapshot of one task: a direct get, last by subject
        newest = await nc.jetstream(timeout=TIMEOUT).get_last_msg(
            stream, f"{p}.task.t1.snap", direct=True
        )
        assert newest.data == f"snapshot after {t1.seq}".encode()
        # of many tasks: one batched direct get (``multi_last``), in the order last written
        snaps = await direct_get(
            nc,
            stream,
            {"multi_last": [f"{p}.task.t1.snap", f"{p}.task.t2.snap", f"{p}.task.t4.snap"]},
        )
        assert [m.headers["Nats-Subject"] for m in snaps if m.headers] == [
            f"{p}.task.t2.snap",
            f"{p}.task.t4.snap",
            f"{p}.task.t1.snap",
        ]
        # one scope's index: one entry per task (the rollups keep only the newest), read
        # in the order written with a batched get by subject, or listed by stream info
        listed = await direct_get(
            nc, stream, {"seq": 1, "next_by_subj": f"{p}.idx.a.*", "batch": 100}
        )
        assert [m.data for m in listed] == [
            b"entry after 0",
            b"entry after 0",
            f"entry after {t1.seq}".encode(),
        ]
        assert await subjects(nc, stream, f"{p}.idx.a.*") == {
            f"{p}.idx.a.t1": 1,
            f"{p}.idx.a.t2": 1,
            f"{p}.idx.a.t4": 1,
        }


async def test_multi_last_refuses_a_wildcard_over_more_than_1024_subjects(
    nc: NATS, cluster: natsserver.Cluster
) -> None:
    async with asyncio.timeout(50):
        stream, p = await make_stream(nc, cluster)
        entries = [(f"{p}.idx.big.t{i}", b"entry", ROLLUP) for i in range(1025)]
        assert (await publish_batch(nc, entries[:1000]))["count"] == 1000
        assert (await publish_batch(nc, entries[1000:1024]))["count"] == 24
        assert len(await direct_get(nc, stream, {"multi_last": [f"{p}.idx.big.*"]})) == 1024
        assert (await publish_batch(nc, entries[1024:]))["count"] == 1
        with pytest.raises(AssertionError, match="413 Too Many Results"):
            await direct_get(nc, stream, {"multi_last": [f"{p}.idx.big.*"]})
        # a batched get by subject pages through them instead
        page = await direct_get(
            nc, stream, {"seq": 1, "next_by_subj": f"{p}.idx.big.*", "batch": 500}
        )
        assert len(page) == 500

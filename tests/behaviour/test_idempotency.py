"""Idempotent SendMessage (the idempotency extension): a request retried with the same
message id (or ``idempotency-key``) runs the executor once, in sequence, concurrently,
after the first call was cut mid-call, blocking and streaming; a reused id with another
body is refused; another caller's identical id is its own; the window can be turned off."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc
import pytest
from a2a.types.a2a_pb2 import SendMessageRequest, StreamResponse, Task, TaskState

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.errors import UnknownFormatError
from a2a_grpc_server._internal.journal import Change
from a2a_grpc_server._internal.journal.keys import (
    ANSWER_KEPT,
    PENDING_FOR,
    KeyRecord,
    MemorySentKeys,
)
from a2a_grpc_server._internal.journal.memory import MemoryJournal
from a2a_grpc_server._internal.rpc import idempotency
from tests.support.agents import CountingAgent, InputAgent
from tests.support.harness import KEYED, V1, copy, rich_status, send_request, serve

S = TaskState


async def rest(
    call: grpc.aio.UnaryStreamCall[SendMessageRequest, StreamResponse],
) -> list[StreamResponse]:
    """What is left of a stream read with ``read()``, to its end."""
    frames = []
    while (frame := await call.read()) is not grpc.aio.EOF:
        assert isinstance(frame, StreamResponse)
        frames.append(frame)
    return frames


async def test_a_message_sent_twice_in_sequence_runs_once() -> None:
    agent = CountingAgent()
    agent.gate.set()
    async with asyncio.timeout(20), serve(agent) as h:
        request = send_request("book it")
        first = (await h.stub.SendMessage(copy(request), metadata=KEYED)).task
        again = (await h.stub.SendMessage(copy(request), metadata=KEYED)).task
        assert first.status.state == S.TASK_STATE_COMPLETED
        assert again.id == first.id and again.status.state == S.TASK_STATE_COMPLETED
        assert again.artifacts == first.artifacts
        assert agent.runs == [request.message.message_id]


async def test_a_message_sent_twice_at_once_runs_once_and_both_get_its_outcome() -> None:
    agent = CountingAgent()
    async with asyncio.timeout(20), serve(agent) as h:
        request = send_request("book it")
        calls = [
            asyncio.ensure_future(h.stub.SendMessage(copy(request), metadata=KEYED))
            for _ in range(2)
        ]
        await agent.started.wait()
        agent.gate.set()
        answers = [(await call).task for call in calls]
        assert {a.id for a in answers} == {answers[0].id}
        assert all(a.status.state == S.TASK_STATE_COMPLETED for a in answers)
        assert agent.runs == [request.message.message_id]


async def test_a_blocking_send_cut_mid_call_and_retried_runs_once() -> None:
    agent = CountingAgent()
    async with asyncio.timeout(20), serve(agent) as h:
        request = send_request("pay")
        cut = h.stub.SendMessage(copy(request), metadata=KEYED)
        await agent.started.wait()
        cut.cancel()  # the connection broke after the executor began
        with pytest.raises(asyncio.CancelledError):
            await cut
        retry = asyncio.ensure_future(h.stub.SendMessage(copy(request), metadata=KEYED))
        agent.gate.set()
        task = (await retry).task
        assert task.status.state == S.TASK_STATE_COMPLETED and len(task.artifacts) == 1
        assert agent.runs == [request.message.message_id]


async def test_a_stream_cut_mid_call_and_retried_streams_the_same_task_to_its_end() -> None:
    agent = CountingAgent()
    async with asyncio.timeout(20), serve(agent) as h:
        request = send_request("send it")
        cut = h.stub.SendStreamingMessage(copy(request), metadata=KEYED)
        first: StreamResponse = await cut.read()
        task_id = first.task.id
        await agent.started.wait()
        cut.cancel()
        retry = h.stub.SendStreamingMessage(copy(request), metadata=KEYED)
        snapshot: StreamResponse = await retry.read()
        assert snapshot.task.id == task_id, "the retry streams the first request's task"
        agent.gate.set()
        frames = await rest(retry)
        assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
        assert all(
            f.status_update.task_id == task_id for f in frames if f.HasField("status_update")
        )
        again = h.stub.SendStreamingMessage(copy(request), metadata=KEYED)
        ended = [frame async for frame in again]  # once it ended: one frame, the task
        assert [f.task.status.state for f in ended] == [S.TASK_STATE_COMPLETED]
        assert agent.runs == [request.message.message_id]


async def test_a_retried_follow_up_is_added_and_run_once() -> None:
    async with asyncio.timeout(20), serve(InputAgent()) as h:
        task = (await h.stub.SendMessage(send_request("hi"), metadata=KEYED)).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        follow_up = send_request("ada", task_id=task.id)
        answers = [
            (await h.stub.SendMessage(copy(follow_up), metadata=KEYED)).task for _ in range(2)
        ]
        assert [a.status.state for a in answers] == [S.TASK_STATE_COMPLETED] * 2
        ids = [m.message_id for m in answers[1].history]
        assert ids.count(follow_up.message.message_id) == 1, "the follow-up is in history once"


class HeldJournal(MemoryJournal):
    """A journal whose write of a follow-up's message waits for ``release`` (a remote one,
    slow), and lands even if the writer stopped waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.writing = asyncio.Event()
        self.release = asyncio.Event()

    async def update(self, task: Task, expected_version: int, changes: Sequence[Change]) -> int:
        if not (self.hold and any(change.message is not None for change in changes)):
            return await super().update(task, expected_version, changes)
        self.hold = False
        self.writing.set()

        async def write() -> int:
            await self.release.wait()
            return await MemoryJournal.update(self, task, expected_version, changes)

        return await asyncio.shield(asyncio.ensure_future(write()))


async def test_a_follow_up_cut_while_its_message_is_written_is_added_and_run_once() -> None:
    journal = HeldJournal()
    async with asyncio.timeout(20), serve(InputAgent(), journal=journal) as h:
        task = (await h.stub.SendMessage(send_request("hi"), metadata=KEYED)).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        follow_up = send_request("ada", task_id=task.id)
        journal.hold = True
        call = h.stub.SendMessage(copy(follow_up), metadata=KEYED)
        await journal.writing.wait()
        call.cancel()  # the caller leaves while its message is being written
        with contextlib.suppress(asyncio.CancelledError):
            await call
        assert call.cancelled()
        await h.service.rpc_metrics.wait_quiet()  # the server let the call go
        journal.release.set()  # ... and the write lands after it
        again = (await h.stub.SendMessage(copy(follow_up), metadata=KEYED)).task
        assert again.status.state == S.TASK_STATE_COMPLETED
        ids = [m.message_id for m in again.history]
        assert ids.count(follow_up.message.message_id) == 1, "the follow-up is in history once"


async def test_a_reused_message_id_with_another_body_is_refused_naming_it() -> None:
    agent = CountingAgent()
    agent.gate.set()
    async with asyncio.timeout(20), serve(agent) as h:
        request = send_request("book it")
        await h.stub.SendMessage(copy(request), metadata=KEYED)
        other = copy(request)
        other.message.parts[0].text = "book something else"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.SendMessage(other, metadata=KEYED)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        _, info = rich_status(caught.value)
        assert info.reason == "MESSAGE_ID_REUSED"
        assert info.metadata["id"] == request.message.message_id
        assert request.message.message_id in (caught.value.details() or "")
        assert len(agent.runs) == 1


async def test_another_callers_identical_message_id_starts_its_own_task() -> None:
    agent = CountingAgent()
    agent.gate.set()
    async with asyncio.timeout(20), serve(agent) as h:
        request = send_request("book it")
        mine = (await h.stub.SendMessage(copy(request), metadata=KEYED)).task
        theirs_request = copy(request)
        theirs_request.tenant = "tenant-b"
        theirs = (await h.stub.SendMessage(theirs_request, metadata=KEYED)).task
        assert theirs.id != mine.id and len(agent.runs) == 2


async def test_an_idempotency_key_keys_the_request_instead_of_its_message_id() -> None:
    """A client that reuses message ids by mistake sends a key per request."""
    agent = CountingAgent()
    agent.gate.set()
    async with asyncio.timeout(20), serve(agent) as h:
        request = send_request("one", msg_id="reused")
        other = send_request("two", msg_id="reused")
        first = (await h.stub.SendMessage(request, metadata=(*V1, ("idempotency-key", "k1")))).task
        second = (await h.stub.SendMessage(other, metadata=(*V1, ("idempotency-key", "k2")))).task
        again = (
            await h.stub.SendMessage(copy(request), metadata=(*V1, ("idempotency-key", "k1")))
        ).task
        assert first.id != second.id and again.id == first.id
        assert len(agent.runs) == 2
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.SendMessage(other, metadata=(*V1, ("idempotency-key", "k1")))
        assert rich_status(caught.value)[1].metadata["field"] == "idempotency-key"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.SendMessage(
                send_request("x"),
                metadata=(*V1, ("idempotency-key", "a"), ("idempotency-key", "b")),
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_call_that_does_not_ask_is_run_as_sent_whatever_its_message_id() -> None:
    """At the defaults a message id is not a retry key: kits and demos reuse ids."""
    agent = CountingAgent()
    agent.gate.set()
    async with asyncio.timeout(20), serve(agent) as h:
        request = send_request("book it", msg_id="m1")
        first = (await h.stub.SendMessage(copy(request), metadata=V1)).task
        again = (await h.stub.SendMessage(copy(request), metadata=V1)).task
        edited = send_request("book something else", msg_id="m1")
        other = (await h.stub.SendMessage(edited, metadata=V1)).task
        assert len({first.id, again.id, other.id}) == 3
        assert agent.runs == ["m1"] * 3
        call = h.stub.SendMessage(copy(request), metadata=KEYED)
        assert (await call.initial_metadata())["a2a-extensions"] == idempotency.URI
        keyed = (await call).task
        assert keyed.id not in {first.id, again.id}, "unasked calls left no key behind"
        assert (await h.stub.SendMessage(copy(request), metadata=KEYED)).task.id == keyed.id
        assert agent.runs == ["m1"] * 4


async def test_every_request_keys_calls_that_do_not_ask() -> None:
    agent = CountingAgent()
    agent.gate.set()
    config = ServerConfig(idempotency_every_request=True)
    async with asyncio.timeout(20), serve(agent, config) as h:
        [declared] = [e for e in h.service.card.capabilities.extensions if e.uri == idempotency.URI]
        assert declared.params["every_request"] is True
        request = send_request("book it")
        first = (await h.stub.SendMessage(copy(request), metadata=V1)).task
        again = (await h.stub.SendMessage(copy(request), metadata=V1)).task
        assert again.id == first.id and len(agent.runs) == 1


async def test_the_card_declares_the_extension_and_a_window_of_0_turns_it_off() -> None:
    agent = CountingAgent()
    agent.gate.set()
    async with asyncio.timeout(20), serve(agent) as h:
        [declared] = [e for e in h.service.card.capabilities.extensions if e.uri == idempotency.URI]
        assert declared.params["every_request"] is False
        assert declared.params["key_header"] == "idempotency-key"
    async with asyncio.timeout(20), serve(agent, ServerConfig(idempotency_window=0)) as h:
        assert idempotency.URI not in [e.uri for e in h.service.card.capabilities.extensions]
        request = send_request("again")
        for _ in range(2):
            await h.stub.SendMessage(copy(request), metadata=KEYED)
        assert agent.runs[-2:] == [request.message.message_id] * 2, "off: it runs twice"


async def test_a_key_expires_after_the_window_and_a_pending_one_is_taken_over() -> None:
    now = [1000.0]
    keys = MemorySentKeys(window=60.0, most=2, clock=lambda: now[0])
    mine = KeyRecord("d1")
    assert await keys.claim("k", mine) is None
    assert await keys.claim("k", KeyRecord("d2")) == KeyRecord("d1", at=1000.0)
    now[0] += PENDING_FOR + 1  # its claimer never said what it started: abandoned
    assert await keys.claim("k", KeyRecord("d3")) is None
    await keys.settle("k", KeyRecord("d3").started("t3", 4))
    now[0] += 30
    found = await keys.claim("k", KeyRecord("d4"))
    assert found is not None and (found.task_id, found.after) == ("t3", 4), "settled: kept"
    now[0] += 31  # past the window of its claim
    assert await keys.claim("k", KeyRecord("d5")) is None
    for key in ("a", "b"):  # at most two kept: the oldest goes
        await keys.claim(key, KeyRecord(key))
    assert len(keys) == 2 and await keys.claim("k", KeyRecord("d6")) is None


def test_a_record_in_a_format_this_version_does_not_read_is_refused() -> None:
    record = KeyRecord("d", "t", 3, b"answer", 12.5)
    assert KeyRecord.decode(record.encode()) == record
    for data in (b'{"format": 3}', b"not json", b'{"format": 1, "digest": "d"}'):
        with pytest.raises(UnknownFormatError):
            KeyRecord.decode(data)


async def test_answers_are_kept_within_their_bytes_and_a_large_one_is_not_kept() -> None:
    keys = MemorySentKeys(window=60.0, most=100, most_bytes=2500)
    for n in range(3):
        assert await keys.claim(f"k{n}", KeyRecord(f"d{n}")) is None
        await keys.settle(f"k{n}", KeyRecord(f"d{n}").answered(b"x" * 1000))
    assert len(keys) == 2, "over 2,500 bytes of answers: the oldest went"
    assert await keys.claim("k0", KeyRecord("d0")) is None
    large = KeyRecord("d").answered(b"x" * (ANSWER_KEPT + 1))
    assert large.dropped and not large.answer and not large.pending
    assert KeyRecord.decode(large.encode()) == large


async def test_an_uncertain_record_is_format_2_and_replaced_only_unchanged() -> None:
    # A follow-up routed to an owner that did not answer (cluster mode): an older
    # version refuses format 2 rather than answer the task as if the message ran.
    uncertain = KeyRecord("d", "t", at=5.0).uncertain("t", 7, "owner-1", 2, 99.0)
    assert b'"format":2' in uncertain.encode() and b'"asked":"owner-1"' in uncertain.encode()
    assert KeyRecord.decode(uncertain.encode()) == uncertain
    assert not uncertain.pending and uncertain.after == 7
    assert KeyRecord.decode(uncertain.started("t", 7).encode()).asked == ""
    keys = MemorySentKeys(window=60.0, most=10, clock=lambda: 10.0)
    await keys.claim("k", KeyRecord("d"))
    await keys.settle("k", uncertain)
    found = await keys.claim("k", KeyRecord("d"))
    assert found is not None and found.asked == "owner-1", "kept: a retry looks first"
    assert await keys.claim("k", KeyRecord("d"), replacing=KeyRecord("d", "other")) == found
    assert await keys.claim("k", KeyRecord("d"), replacing=found) is None, "taken over"

"""The synchronous resume client example against grpcio-testing's fake channel.

The fake channel lets the test play the server call by call: which status a
stream ends with, and what the client sends next. That is what this client's
logic is about (each status, each cursor), not the server, so a scripted
server fits better here than a real one. (The fake channel hands a failed
stream's status to the client before frames still queued, so the test waits
until the client has handled a frame before it ends the stream.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import grpc_testing  # type: ignore[import-untyped]
import pytest
from a2a.types import a2a_pb2
from a2a.types.a2a_pb2 import (
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from a2a.types.a2a_pb2_grpc import A2AServiceStub
from examples.resume_client import FALLBACK, RESUME, follow, seq_of, skipped

SERVICE = a2a_pb2.DESCRIPTOR.services_by_name["A2AService"]
SUBSCRIBE = SERVICE.methods_by_name["SubscribeToTask"]
S = TaskState


def snapshot(seq: int, skipped_from: int = 0) -> StreamResponse:
    task = Task(id="t1", context_id="c1", status=TaskStatus(state=S.TASK_STATE_WORKING))
    task.metadata[RESUME] = {"seq": seq}
    if skipped_from:
        task.metadata[RESUME] = {"seq": seq, "skipped": {"from": skipped_from, "to": seq}}
    return StreamResponse(task=task)


def artifact(seq: int) -> StreamResponse:
    event = TaskArtifactUpdateEvent(task_id="t1", context_id="c1")
    event.artifact.artifact_id = f"a{seq}"
    event.metadata[RESUME] = {"seq": seq}
    return StreamResponse(artifact_update=event)


def completed(seq: int) -> StreamResponse:
    event = TaskStatusUpdateEvent(
        task_id="t1", context_id="c1", status=TaskStatus(state=S.TASK_STATE_COMPLETED)
    )
    event.metadata[RESUME] = {"seq": seq}
    return StreamResponse(status_update=event)


class Client:
    """``follow`` running in a thread on a fake channel; the test plays the server."""

    def __init__(self, retries: int = 5) -> None:
        self.channel = grpc_testing.channel([SERVICE], grpc_testing.strict_real_time())
        self.handled: list[StreamResponse] = []
        self.error: grpc.RpcError | None = None
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(retries,), daemon=True)
        self._thread.start()

    def _run(self, retries: int) -> None:
        stub = A2AServiceStub(self.channel)
        try:
            follow(stub, "t1", self._handle, retries=retries, backoff=0)
        except grpc.RpcError as err:
            self.error = err

    def _handle(self, frame: StreamResponse) -> None:
        with self._progress:
            self.handled.append(frame)
            self._progress.notify_all()

    def wait_handled(self, count: int) -> None:
        """Wait (at most 5 s) until the client has handled ``count`` frames in all."""
        with self._progress:
            assert self._progress.wait_for(lambda: len(self.handled) >= count, timeout=5)

    def next_call(self) -> tuple[dict[str, str], Any]:
        """The client's next SubscribeToTask (waits for it): its metadata and the call."""
        metadata, request, rpc = self.channel.take_unary_stream(SUBSCRIBE)
        assert request.id == "t1"
        return dict(metadata), rpc

    def done(self) -> bool:
        self._thread.join(timeout=5)
        return not self._thread.is_alive()


@contextmanager
def client(retries: int = 5) -> Iterator[Client]:
    c = Client(retries)
    yield c
    assert c.done(), "the client did not end"


def test_a_broken_stream_resumes_after_the_last_frame_it_handled() -> None:
    with client() as c:
        metadata, rpc = c.next_call()
        assert metadata["a2a-extensions"] == RESUME and "a2a-resume-after" not in metadata
        assert metadata[FALLBACK[0]] == FALLBACK[1], "it asks for the snapshot fallback"
        for frame in (snapshot(2), artifact(3)):
            rpc.send_response(frame)
        c.wait_handled(2)
        rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "connection reset")
        metadata, rpc = c.next_call()
        assert metadata["a2a-resume-after"] == "3"
        assert metadata[FALLBACK[0]] == FALLBACK[1]
        for frame in (artifact(4), completed(5)):
            rpc.send_response(frame)
        rpc.terminate((), grpc.StatusCode.OK, "")
    assert [seq_of(f) for f in c.handled] == [2, 3, 4, 5], "each frame once"
    assert c.error is None


def test_a_cursor_too_old_gets_the_task_marked_and_the_cursor_goes_on_from_it() -> None:
    with client() as c:
        _, rpc = c.next_call()
        rpc.send_response(snapshot(2))
        c.wait_handled(1)
        rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "connection reset")
        metadata, rpc = c.next_call()
        assert metadata["a2a-resume-after"] == "2"
        for frame in (snapshot(40, skipped_from=3), artifact(41)):  # 3 to 40 were not kept
            rpc.send_response(frame)
        c.wait_handled(3)
        rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "connection reset")
        metadata, rpc = c.next_call()
        assert metadata["a2a-resume-after"] == "41", "the snapshot's seq is a cursor like any"
        rpc.send_response(completed(42))
        rpc.terminate((), grpc.StatusCode.OK, "")
    assert [seq_of(f) for f in c.handled] == [2, 40, 41, 42]
    assert [skipped(f) for f in c.handled] == [None, (3, 40), None, None]
    assert c.error is None


def test_a_cursor_a_server_without_the_fallback_cannot_serve_starts_again_from_a_snapshot() -> None:
    with client() as c:
        _, rpc = c.next_call()
        rpc.send_response(snapshot(2))
        c.wait_handled(1)
        rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "connection reset")
        metadata, rpc = c.next_call()
        assert metadata["a2a-resume-after"] == "2"
        rpc.terminate((), grpc.StatusCode.OUT_OF_RANGE, "frame 3 is no longer kept")
        metadata, rpc = c.next_call()
        assert "a2a-resume-after" not in metadata, "resubscribed without a cursor"
        for frame in (snapshot(40), completed(41)):
            rpc.send_response(frame)
        rpc.terminate((), grpc.StatusCode.OK, "")
    assert [seq_of(f) for f in c.handled] == [2, 40, 41]
    assert c.handled[1].WhichOneof("payload") == "task", "the task again, whole"


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL],
)
def test_a_status_resuming_cannot_help_ends_it_without_another_call(code: grpc.StatusCode) -> None:
    with client() as c:
        _, rpc = c.next_call()
        rpc.terminate((), code, "no")
    assert c.error is not None and c.error.code() == code  # type: ignore[attr-defined]


def test_a_stream_that_keeps_breaking_gives_up_after_its_retries() -> None:
    with client(retries=2) as c:
        for _ in range(3):
            _, rpc = c.next_call()
            rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert c.error is not None and c.error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]

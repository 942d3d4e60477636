"""A real server on 127.0.0.1:0 in this process, with real clients, and a leak check."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from a2a.client.transports.grpc import GrpcTransport
from a2a.server.agent_execution import AgentExecutor
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from google.rpc import error_details_pb2, status_pb2
from prometheus_client.parser import text_string_to_metric_families

from a2a_grpc_server import A2AService, ServerConfig
from a2a_grpc_server._internal.app.service import grpc_options
from a2a_grpc_server._internal.journal import TaskJournal
from a2a_grpc_server._internal.model import taskops
from a2a_grpc_server._internal.rpc import idempotency
from a2a_grpc_server._internal.rpc.auth import Authenticator, AuthInterceptor, TokenFile
from a2a_grpc_server._internal.rpc.resume import RESUME_AFTER_KEY, URI
from a2a_grpc_server.testing import assert_nothing_left

if TYPE_CHECKING:
    from tests.support.agents import BurstAgent, ChunkAgent

V1 = (("a2a-version", "1.0"),)
KEYED = (*V1, ("a2a-extensions", idempotency.URI))
"""A v1.0 call that asks for safe retries (the idempotency extension activated)."""


@dataclass
class Harness:
    """One server and its clients."""

    service: A2AService
    server: grpc.aio.Server
    address: str
    channel: grpc.aio.Channel
    stub: a2a_pb2_grpc.A2AServiceStub
    client: GrpcTransport

    async def settle(self, within: float = 0.3) -> None:
        """Wait (at most ``within`` s) until no run and no stream of ours is alive, then
        assert that no coroutine of this package is left on the loop."""
        async with asyncio.timeout(within):
            await self.service.servicer.wait_streams_closed()
            await self.service.engine.wait_idle()
        assert_nothing_left()


async def expose(service: A2AService, auth: Authenticator | None = None) -> Harness:
    """Serve ``service`` on a real grpc.aio server on 127.0.0.1:0, with clients of it.

    With ``auth``, every A2A call is authenticated with it (as ``A2AServer`` does).
    """
    guard = [AuthInterceptor(auth)] if auth is not None else []
    interceptors = [*service.interceptors(), *guard]  # as A2AServer has them
    server = grpc.aio.server(options=grpc_options(service.config), interceptors=interceptors)
    service.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    client = GrpcTransport(grpc.aio.insecure_channel(address), None)
    stub = a2a_pb2_grpc.A2AServiceStub(channel)
    return Harness(service, server, address, channel, stub, client)


@contextlib.asynccontextmanager
async def serve(
    executor: AgentExecutor,
    config: ServerConfig | None = None,
    journal: TaskJournal | None = None,
    auth: Authenticator | None = None,
) -> AsyncIterator[Harness]:
    """Start the service on a real grpc.aio server on port 0 (``auth``: see ``expose``).

    On a normal exit it asserts, from inside this (the server's) process,
    that no run, stream or coroutine of the package outlived the test by
    more than 300 ms; tests that leave a task running fail here.
    """
    service = A2AService(
        executor, config=config or ServerConfig(cancel_timeout=1.0), journal=journal
    )
    harness = await expose(service, auth)
    server, channel, client = harness.server, harness.channel, harness.client
    try:
        yield harness
        # Every test ends with nothing of ours alive: no run, no stream, no
        # coroutine of this package, 300 ms after its last stream ended.
        await harness.settle()
    finally:
        await service.shutdown(grace=0)
        await client.close()
        await channel.close()
        await server.stop(grace=None)


def user_message(
    text: str = "hello", *, task_id: str = "", context_id: str = "", msg_id: str = ""
) -> Message:
    """A user message with one text part."""
    import uuid

    return Message(
        message_id=msg_id or str(uuid.uuid4()),
        role=Role.ROLE_USER,
        task_id=task_id,
        context_id=context_id,
        parts=[Part(text=text)],
    )


def copy(request: SendMessageRequest) -> SendMessageRequest:
    """A copy of ``request``, as a retry sends it."""
    again = SendMessageRequest()
    again.CopyFrom(request)
    return again


def send_request(
    text: str = "hello", *, immediately: bool = False, **ids: str
) -> SendMessageRequest:
    """A SendMessageRequest for ``user_message(text)``."""
    return SendMessageRequest(
        message=user_message(text, **ids),
        configuration=SendMessageConfiguration(return_immediately=immediately),
    )


def rich_status(err: grpc.aio.AioRpcError) -> tuple[status_pb2.Status, error_details_pb2.ErrorInfo]:
    """The google.rpc.Status and its ErrorInfo from a failed call."""
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            assert isinstance(value, bytes)
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return status, info
    raise AssertionError(f"no ErrorInfo in {err!r}")


def last_state(frames: list[StreamResponse]) -> TaskState:
    """The state the last frame of a stream carries."""
    assert frames, "stream ended without any frame"
    last = frames[-1]
    kind = last.WhichOneof("payload")
    if kind == "status_update":
        return last.status_update.status.state
    assert kind == "task", f"stream ended with a {kind} frame"
    return last.task.status.state


def kinds(frames: Iterable[StreamResponse]) -> list[str]:
    """A readable summary of frames: payload kind and state."""
    out = []
    for f in frames:
        kind = f.WhichOneof("payload")
        if kind == "task":
            out.append(f"task:{f.task.status.state}")
        elif kind == "status_update":
            out.append(f"status:{f.status_update.status.state}")
        else:
            out.append(str(kind))
    return out


async def read_all(call: Any, into: list[StreamResponse]) -> None:
    """Read a stream call to its end (raises what ended it, if not OK)."""
    while (frame := await call.read()) is not grpc.aio.EOF:
        into.append(frame)


async def attach_as_it_flows(
    stub: a2a_pb2_grpc.A2AServiceStub, agent: ChunkAgent, points: list[int]
) -> tuple[list[StreamResponse], list[list[StreamResponse]], str]:
    """Start a chunked task; attach one subscriber after each number of frames in
    ``points`` (in the middle of the journal writes); let the task complete once
    every subscriber has its snapshot; return every stream's frames."""
    sender = stub.SendStreamingMessage(send_request("go"), metadata=V1)
    task_id = (await sender.read()).task.id
    assert (await sender.read()).status_update.status.state == TaskState.TASK_STATE_WORKING
    agent.release.set()
    subscribers: list[asyncio.Future[list[StreamResponse]]] = []
    attached: list[asyncio.Event] = []

    async def subscriber(snapshot: asyncio.Event) -> list[StreamResponse]:
        call = stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=V1)
        frames: list[StreamResponse] = [await call.read()]
        snapshot.set()
        await read_all(call, frames)
        return frames

    from_sender: list[StreamResponse] = []
    while len(from_sender) < agent.count + 1:  # the artifact and every chunk
        from_sender.append(await sender.read())
        while points and len(from_sender) >= points[0]:
            points.pop(0)
            attached.append(asyncio.Event())
            subscribers.append(asyncio.ensure_future(subscriber(attached[-1])))
    for event in attached:
        await event.wait()
    agent.finish.set()
    await read_all(sender, from_sender)
    return from_sender, list(await asyncio.gather(*subscribers)), task_id


async def burst_to_readers(
    stub: a2a_pb2_grpc.A2AServiceStub, readers_at: str, agent: BurstAgent, readers: int
) -> tuple[list[StreamResponse], list[dict[str, object]]]:
    """Start ``agent``'s task through ``stub``; attach ``readers`` SubscribeToTask streams
    (in a child process) on the server at ``readers_at``; release the burst. Returns the
    sender's frames after WORKING and each reader's summary (``readerproc``)."""
    from tests.support import readerproc

    sender = stub.SendStreamingMessage(send_request("go"), metadata=V1)
    task_id = (await sender.read()).task.id
    assert (await sender.read()).status_update.status.state == TaskState.TASK_STATE_WORKING
    attached = await readerproc.start(readers_at, task_id, readers)
    agent.release.set()
    from_sender: list[StreamResponse] = []
    await read_all(sender, from_sender)
    return from_sender, await attached.results()


RESUME = (*V1, ("a2a-extensions", URI))
"""Call metadata that activates the resume extension."""


def seq_of(frame: StreamResponse) -> int:
    """The sequence number the resume extension put in a frame's metadata."""
    kind = frame.WhichOneof("payload")
    assert kind is not None
    metadata = getattr(frame, kind).metadata
    assert URI in metadata, f"no seq in {kind}"
    return int(metadata[URI]["seq"])


def resume_call(stub: a2a_pb2_grpc.A2AServiceStub, task_id: str, after: int) -> Any:
    """SubscribeToTask resumed after frame ``after``."""
    metadata = (*RESUME, (RESUME_AFTER_KEY, str(after)))
    return stub.SubscribeToTask(SubscribeToTaskRequest(id=task_id), metadata=metadata)


def assert_each_rebuilds(streams: list[list[StreamResponse]], recorded: Task) -> None:
    """Each stream's snapshot plus its frames is the recorded task (no frame missed or twice)."""
    for frames in streams:
        assert list(rebuilt(frames).artifacts) == list(recorded.artifacts), "no frame twice"
        assert frames[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED


def rebuilt(frames: list[StreamResponse]) -> Task:
    """The task a subscriber holds: its snapshot with every frame after it applied."""
    assert frames[0].WhichOneof("payload") == "task"
    task = taskops.copy(frames[0].task)
    for frame in frames[1:]:
        task = taskops.apply_frame(task, frame)
    return task


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint (negative numbers as their 64-bit two's complement)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# Two callers of a server authenticated with ``tokens``.


def tokens(tmp_path: Path) -> TokenFile:
    path = tmp_path / "tokens"
    path.write_text("alice:alice-token\nbob:bob-token\n")
    return TokenFile(path)


ALICE = (*V1, ("authorization", "Bearer alice-token"))
BOB = (*V1, ("authorization", "Bearer bob-token"))


async def error_of(attempt: Any, frames: list[Any] | None = None) -> grpc.aio.AioRpcError:
    """The error a call ends with (unary: awaited; stream: read until it fails, each frame
    read appended to ``frames``)."""
    try:
        if hasattr(attempt, "read"):
            while True:
                frame = await attempt.read()
                if frame is grpc.aio.EOF:
                    raise AssertionError("the stream ended without an error")
                if frames is not None:
                    frames.append(frame)
        await attempt
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


Sample = tuple[str, tuple[tuple[str, str], ...]]


def samples(text: str) -> dict[Sample, float]:
    """Every sample of an exposition, by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

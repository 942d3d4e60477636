"""What the ``a2a.server`` span takes from a call: the client's address from grpc's peer
string, the draft's attributes from a request (none from one that did not decode; ids cut to
the longest the server accepts), and no span for services other than A2A."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    Message,
    SendMessageRequest,
    StreamResponse,
    TaskState,
)

from a2a_grpc_server._internal.model.names import MAX_ID_CHARS
from a2a_grpc_server._internal.rpc import tracing
from a2a_grpc_server._internal.rpc.tracing import (
    client_attributes,
    request_attributes,
    server_spans,
)


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("ipv4:127.0.0.1:50123", {"client.address": "127.0.0.1", "client.port": 50123}),
        ("ipv6:[::1]:50123", {"client.address": "::1", "client.port": 50123}),
        ("ipv6:%5B::1%5D:50123", {"client.address": "::1", "client.port": 50123}),
        ("unix:/run/a2a.sock", {"client.address": "/run/a2a.sock"}),
        ("unknown", {}),
        (None, {}),
    ],
)
def test_the_client_address_comes_from_the_peer_string(
    peer: str | None, expected: dict[str, Any]
) -> None:
    assert client_attributes(peer) == expected


def test_a_request_gives_its_tenant_message_task_and_context() -> None:
    message = Message(message_id="m", task_id="t", context_id="c", reference_task_ids=["r"])
    assert request_attributes(SendMessageRequest(tenant="acme", message=message)) == {
        "a2a.tenant": "acme",
        "a2a.message.id": "m",
        "a2a.task.id": "t",
        "gen_ai.conversation.id": "c",
        "a2a.message.reference_task_ids": ["r"],
    }


def test_a_request_that_did_not_decode_gives_nothing_and_long_ids_are_cut() -> None:
    assert request_attributes(object()) == {}
    long = request_attributes(GetTaskRequest(id="x" * 10_000))
    assert long == {"a2a.task.id": "x" * MAX_ID_CHARS}


async def _behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    return None


def test_calls_of_other_services_are_left_untraced() -> None:
    wrap = server_spans()
    assert wrap("/grpc.health.v1.Health/Check", "unary", _behavior) is _behavior
    assert wrap("/lf.a2a.v1.A2AService/GetTask", "unary", _behavior) is not _behavior


class _Sink:
    """What a stream's context is to ``_Watched``: something frames are written to."""

    def __init__(self) -> None:
        self.written: list[StreamResponse | bytes] = []

    async def write(self, frame: StreamResponse | bytes) -> None:
        self.written.append(frame)


async def test_a_traced_stream_keeps_what_its_frames_say_not_the_frames() -> None:
    sink = _Sink()
    watched = tracing._Watched(sink)  # type: ignore[arg-type]
    snapshot = StreamResponse(task={"id": "t1", "context_id": "c1", "status": {"state": 2}})
    snapshot.task.artifacts.add().parts.add().text = "x" * 100_000
    await watched.write(snapshot)
    done = StreamResponse(status_update={"task_id": "t1", "context_id": "c1"})
    done.status_update.status.state = TaskState.TASK_STATE_COMPLETED
    await watched.write(done)
    held = [getattr(watched, name) for name in tracing._Watched.__slots__]
    assert not any(isinstance(value, StreamResponse) for value in held), "no frame kept"
    found = watched.attributes()
    assert found["a2a.task.id"] == "t1" and found["gen_ai.conversation.id"] == "c1"
    assert found["a2a.task.state"] == "TASK_STATE_COMPLETED"
    assert sink.written == [snapshot, done]

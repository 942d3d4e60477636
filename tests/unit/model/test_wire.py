"""Tags added to a serialized frame stay inside its one payload field, as clients in other
languages need (ts-proto and protobuf.js keep only the last occurrence of a field)."""

from __future__ import annotations

from a2a.types.a2a_pb2 import StreamResponse, TaskState, TaskStatusUpdateEvent
from google.protobuf.unknown_fields import UnknownFieldSet

from a2a_grpc_server._internal.model import generation, wire
from a2a_grpc_server._internal.rpc import resume
from tests.support.harness import seq_of


def status_frame(**metadata: str) -> bytes:
    event = TaskStatusUpdateEvent(task_id="t1", context_id="c1")
    event.status.state = TaskState.TASK_STATE_WORKING
    for key, value in metadata.items():
        event.metadata[key] = value
    return StreamResponse(status_update=event).SerializeToString()


def occurrences(data: bytes, start: int, end: int, field: int) -> int:
    """How often the message in ``data[start:end]`` has ``field`` (length-delimited or varint)."""
    count, at = 0, start
    while at < end:
        key, at = wire.read_varint(data, at)
        count += key >> 3 == field
        if key & 7 == 2:
            size, at = wire.read_varint(data, at)
            at += size
        else:
            _, at = wire.read_varint(data, at)
    return count


def test_both_tags_go_inside_the_one_payload_field() -> None:
    frame = resume.tag(generation.tag(status_frame(), 7), 7)
    bounds = wire.payload_bounds(frame)
    assert bounds is not None, "the frame is still one payload field"
    parsed = StreamResponse.FromString(frame)
    assert parsed.status_update.task_id == "t1"
    assert seq_of(parsed) == 7
    unknown = UnknownFieldSet(parsed.status_update)
    numbers = [(unknown[i].field_number, unknown[i].data) for i in range(len(unknown))]
    assert numbers == [(generation.STATUS_FIELD, 7)], "the v1.1 generation, inside the payload"


def test_an_agents_metadata_is_kept_in_one_metadata_field_beside_the_seq() -> None:
    frame = resume.tag(status_frame(mine="yes"), 3)
    bounds = wire.payload_bounds(frame)
    assert bounds is not None
    assert occurrences(frame, *bounds, field=4) == 1, "one metadata field, not two"
    metadata = StreamResponse.FromString(frame).status_update.metadata
    assert metadata["mine"] == "yes" and seq_of(StreamResponse.FromString(frame)) == 3


def test_a_message_frame_gets_the_seq_and_no_generation() -> None:
    frame = StreamResponse(message={"message_id": "m", "role": 2}).SerializeToString()
    assert generation.tag(frame, 2) == frame
    tagged = StreamResponse.FromString(resume.tag(frame, 2))
    assert tagged.message.message_id == "m" and seq_of(tagged) == 2

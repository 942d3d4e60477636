"""Protobuf wire bytes: what adds a field to a serialized frame's payload without parsing it.

A StreamResponse frame is one length-delimited payload field (task, message,
status_update or artifact_update). A field is added *inside* that payload
(its length prefix grows), never as a second occurrence of the payload field
after it: protobuf merges such occurrences, but protobuf.js 7 (under
@grpc/proto-loader) and ts-proto (@a2a-js/sdk) keep the last one only, and
their clients then read an empty payload (tests/node).
"""

from __future__ import annotations


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``data[at]`` and the index just after it."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def payload_bounds(frame: bytes) -> tuple[int, int] | None:
    """Where the payload of a one-field frame starts and ends (None: not such a frame).

    The payload field's tag is one byte (field numbers 1 to 15).
    """
    if len(frame) < 2 or frame[0] & 7 != 2:
        return None
    size, start = read_varint(frame, 1)
    return (start, start + size) if start + size == len(frame) else None


def has_field(data: bytes, start: int, end: int, field: int) -> bool:
    """Whether the message in ``data[start:end]`` has a top-level ``field``.

    A group (which these messages never use) answers True: it may have.
    """
    at = start
    while at < end:
        key, at = read_varint(data, at)
        if key >> 3 == field:
            return True
        kind = key & 7
        if kind == 0:
            _, at = read_varint(data, at)
        elif kind == 2:
            size, at = read_varint(data, at)
            at += size
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        else:
            return True
    return False


def add_to_payload(frame: bytes, fields: bytes) -> bytes | None:
    """``frame`` with the serialized ``fields`` added at the end of its payload.

    Returns:
        The new frame, or None if ``frame`` is not one payload field.
    """
    bounds = payload_bounds(frame)
    if bounds is None:
        return None
    start, end = bounds
    head = frame[:1] + varint(end - start + len(fields))
    return b"".join((head, memoryview(frame)[start:], fields))

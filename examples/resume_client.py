"""A client that follows a task to its end across broken connections (the resume extension).

    python -m examples.resume_client 127.0.0.1:50051 TASK_ID

Synchronous (grpc's blocking API). It subscribes with the resume extension
active and remembers the number of the last frame it handled. When the stream
breaks (UNAVAILABLE: the connection or the instance went away) it subscribes
again with ``a2a-resume-after`` — on whichever instance the address reaches —
so every frame is handled exactly once. It asks for the snapshot fallback
(``a2a-resume-fallback: snapshot``): where frames after its cursor are no
longer kept, the server sends the whole ``Task`` as it stands instead, marked
with the frames it stands for, and goes on after it. A server without the
fallback answers OUT_OF_RANGE there (as it does for a cursor past the task's
end); the client then starts again from a snapshot. Any other status ends it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import grpc
from a2a.types.a2a_pb2 import StreamResponse, SubscribeToTaskRequest
from a2a.types.a2a_pb2_grpc import A2AServiceStub
from google.protobuf import json_format

RESUME = "urn:a2a-grpc-server:extension:resume:v1"
"""The resume extension's URI (see the server's docs/how-to/resume.md)."""
FALLBACK = ("a2a-resume-fallback", "snapshot")
"""Call metadata asking for the task as it stands where frames are no longer kept."""


def seq_of(frame: StreamResponse) -> int:
    """The frame's number in its task's log, as the extension put it in its metadata."""
    payload = getattr(frame, frame.WhichOneof("payload") or "task")
    return int(payload.metadata[RESUME]["seq"])


def skipped(frame: StreamResponse) -> tuple[int, int] | None:
    """The frames a ``Task`` frame stands in for, as (first, last), or None.

    Set on the task the server sends where frames after the cursor were no
    longer kept: the task as it stands includes what they carried.
    """
    if frame.WhichOneof("payload") != "task":
        return None
    marker = json_format.MessageToDict(frame.task.metadata).get(RESUME, {})
    if "skipped" not in marker:
        return None
    return int(marker["skipped"]["from"]), int(marker["skipped"]["to"])


def follow(
    stub: A2AServiceStub,
    task_id: str,
    handle: Callable[[StreamResponse], None],
    *,
    retries: int = 5,
    backoff: float = 0.2,
) -> None:
    """Call ``handle`` with every frame of the task, once each, until its final one.

    Args:
        stub: A stub on a channel to the server (or its load balancer).
        task_id: The task to follow.
        handle: Called with each frame; a ``Task`` frame is the whole task
            (the first frame, one that stands in for frames no longer kept,
            see ``skipped``, and the first after a restart from a snapshot).
        retries: Broken streams in a row to resume before giving up.
        backoff: Seconds before the first resumption; doubled each time.

    Raises:
        grpc.RpcError: A status resuming cannot help (the task does not exist,
            has ended before the first subscription, ...), or UNAVAILABLE more
            than ``retries`` times in a row.
    """
    last: int | None = None
    broken = 0
    while True:
        metadata = [("a2a-version", "1.0"), ("a2a-extensions", RESUME), FALLBACK]
        if last is not None:
            metadata.append(("a2a-resume-after", str(last)))
        try:
            for frame in stub.SubscribeToTask(
                SubscribeToTaskRequest(id=task_id), metadata=metadata
            ):
                handle(frame)
                last, broken = seq_of(frame), 0
            return  # the stream ended after the task's final frame
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            if code == grpc.StatusCode.OUT_OF_RANGE:
                last = None  # a cursor past the end (or a server without the fallback)
            elif code == grpc.StatusCode.UNAVAILABLE and broken < retries:
                time.sleep(backoff * 2**broken)  # let the connection (or the instance) come back
                broken += 1
            else:
                raise


def main(argv: Sequence[str] | None = None) -> int:
    """Print every frame of a task until it ends."""
    address, task_id = (argv if argv is not None else sys.argv[1:])[:2]
    with grpc.insecure_channel(address) as channel:  # type: ignore[no-untyped-call]
        follow(A2AServiceStub(channel), task_id, lambda frame: print(seq_of(frame), frame))
    return 0


if __name__ == "__main__":
    sys.exit(main())

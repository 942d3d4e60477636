"""Many SubscribeToTask readers in a child process: ``python -m tests.support.readerproc``.

    python -m tests.support.readerproc ADDRESS TASK_ID STREAMS

Opens STREAMS streams to the task, reads each one's snapshot, prints
``attached``, reads every stream to its end, then prints one JSON line: per
stream, the artifact ids it received in order, its last frame's state, and
whether its frames were byte for byte the first stream's. Burst tests use it
so that readers and server do not share one core (a 10,000-frame burst to
100 streams is a million frames).
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
from a2a.types.a2a_pb2 import StreamResponse, SubscribeToTaskRequest

from tests.support import ROOT

METHOD = "/lf.a2a.v1.A2AService/SubscribeToTask"
V1 = (("a2a-version", "1.0"),)


async def main(address: str, task_id: str, streams: int) -> None:
    """See the module docstring."""
    async with grpc.aio.insecure_channel(address) as channel:
        subscribe: grpc.aio.UnaryStreamMultiCallable[SubscribeToTaskRequest, bytes]
        subscribe = channel.unary_stream(
            METHOD,
            request_serializer=SubscribeToTaskRequest.SerializeToString,
            response_deserializer=None,  # bytes: parsed once below
        )
        calls = [subscribe(SubscribeToTaskRequest(id=task_id), metadata=V1) for _ in range(streams)]
        for call in calls:
            snapshot = StreamResponse.FromString(await call.read())
            assert snapshot.task.id == task_id, snapshot
        print("attached", flush=True)

        async def read(
            call: grpc.aio.UnaryStreamCall[SubscribeToTaskRequest, bytes],
        ) -> list[bytes]:
            frames = []
            while (frame := await call.read()) is not grpc.aio.EOF:
                frames.append(frame)
            return frames

        results = await asyncio.gather(*(read(c) for c in calls))
    reference = results[0]
    first = summary(reference)
    report = []
    for frames in results:
        same = frames == reference
        report.append({**(first if same else summary(frames)), "same_as_first": same})
    print(json.dumps(report), flush=True)


def summary(frames: list[bytes]) -> dict[str, object]:
    """The artifact ids a stream carried, in order, and its last frame's state."""
    parsed = [StreamResponse.FromString(f) for f in frames]
    return {
        "ids": [
            p.artifact_update.artifact.artifact_id
            for p in parsed
            if p.WhichOneof("payload") == "artifact_update"
        ],
        "last_state": parsed[-1].status_update.status.state if parsed else 0,
    }


class Readers:
    """A running ``readerproc``, attached to its task (see ``start``)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def results(self) -> list[dict[str, object]]:
        """Every stream's summary, once all of them ended."""
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        await self.proc.wait()
        assert line, "the readers' process exited without a report"
        report: list[dict[str, object]] = json.loads(line)
        return report


async def start(address: str, task_id: str, streams: int) -> Readers:
    """Start the readers; return once every stream received its snapshot."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.readerproc",
        address,
        task_id,
        str(streams),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 28,  # the report is one line: every stream's artifact ids
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
        assert line.strip() == b"attached", line
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    return Readers(proc)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))

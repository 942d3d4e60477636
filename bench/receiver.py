"""A webhook receiver for the push benchmark: ``python -m bench.receiver [--hold]``.

Runs in its own process (so it takes no CPU from the load generator), binds
127.0.0.1 on a free port, prints ``ready <port>`` and answers every POST
204 (or, with ``--hold``, never: a dead webhook that keeps the connection
open). ``GET /stats`` returns JSON: ``posts`` (frames received), ``finals``
(frames carrying TASK_STATE_COMPLETED), ``tasks`` (distinct task ids with a
final frame) and ``cpu_s`` (this process's CPU seconds so far). Serves until
SIGTERM.

It stands in for a webhook that runs on another machine, yet shares this
machine's cores with the server under test: so it does as little as it can
per POST, on one event loop (an ``asyncio.Protocol`` reading HTTP/1.1 with
keep-alive, ``Content-Length`` or chunked bodies): 47 us of CPU per POST
against 98-106 us for ``http.server``'s thread per connection, which took 28 %
of a core at ~2,800 POSTs a second (docs/decisions/0018-benchmark-method.md).
It is a benchmark's receiver, not a general HTTP server: anything it cannot
read closes the connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

HOLD_AT_MOST = 600.0
"""Seconds a held request stays open at most."""
MAX_HEAD = 64 * 1024
"""Most bytes of a request's line and headers."""
MAX_BODY = 16 * 1024 * 1024
"""Most bytes of a request's body."""
NO_CONTENT = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"


class Counts:
    """What arrived."""

    def __init__(self) -> None:
        self.posts = 0
        self.finals = 0
        self.tasks: set[str] = set()

    def stats(self) -> bytes:
        """The ``GET /stats`` body."""
        return json.dumps(
            {
                "posts": self.posts,
                "finals": self.finals,
                "tasks": len(self.tasks),
                "cpu_s": time.process_time(),
            }
        ).encode()


def _task_id(body: bytes) -> str:
    """The task id in a frame (ours: a StreamResponse; a2a-sdk: a Task or an event)."""
    try:
        frame = json.loads(body)
    except ValueError:
        return ""
    for payload in (frame.get("task"), frame.get("statusUpdate"), frame.get("artifactUpdate")):
        if isinstance(payload, dict):
            return str(payload.get("id") or payload.get("taskId") or "")
    return str(frame.get("id") or frame.get("taskId") or "")


class Connection(asyncio.Protocol):
    """One client connection: requests in, answers out, in order."""

    def __init__(self, counts: Counts, hold: bool) -> None:
        self._counts = counts
        self._hold = hold
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._held = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        """Answer every whole request the buffer holds."""
        self._buffer += data
        while self._transport is not None and not self._held:
            try:
                request = self._take()
            except ValueError:  # (a size that is not a number)
                self._close()
                return
            if request is None:
                return
            self._answer(*request)

    def _take(self) -> tuple[str, str, dict[str, str], bytes] | None:
        """The first whole request in the buffer (method, path, headers, body), if any."""
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD:
                self._close()
            return None
        line, *fields = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        parts = line.split(" ")
        if len(parts) != 3:
            self._close()
            return None
        headers = {}
        for field in fields:
            name, _, value = field.partition(":")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            taken = _chunks(buffer, start)
            if taken is None:
                return None
            body, start = taken
        else:
            size = int(headers.get("content-length", "0") or "0")
            if size < 0 or size > MAX_BODY:
                self._close()
                return None
            if len(buffer) < start + size:
                return None
            body, start = bytes(buffer[start : start + size]), start + size
        del buffer[:start]
        return parts[0], parts[1], headers, body

    def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        transport = self._transport
        assert transport is not None
        if method == "GET" and path == "/stats":
            stats = self._counts.stats()
            transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(stats)).encode()
                + b"\r\n\r\n"
                + stats
            )
            return
        if self._hold:  # (reads nothing more: the answer never comes)
            self._held = True
            transport.pause_reading()
            asyncio.get_running_loop().call_later(HOLD_AT_MOST, self._close)
            return
        counts = self._counts
        counts.posts += 1
        if b"TASK_STATE_COMPLETED" in body:
            counts.finals += 1
            counts.tasks.add(headers.get("x-a2a-task-id") or _task_id(body))
        transport.write(NO_CONTENT)

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the transport."""
        self._transport = None


def _chunks(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked body from ``start`` (and where the next request starts), if all here."""
    body = bytearray()
    at = start
    while True:
        end = buffer.find(b"\r\n", at)
        if end < 0:
            return None
        size = int(bytes(buffer[at:end]).split(b";")[0], 16)
        at = end + 2
        if size == 0:
            trailer = buffer.find(b"\r\n\r\n", at - 2)
            return (bytes(body), trailer + 4) if trailer >= 0 else None
        if len(buffer) < at + size + 2:
            return None
        body += buffer[at : at + size]
        at += size + 2


async def serve(hold: bool) -> None:
    """Serve until SIGTERM."""
    loop = asyncio.get_running_loop()
    counts = Counts()
    server = await loop.create_server(lambda: Connection(counts, hold), "127.0.0.1", 0)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    port = server.sockets[0].getsockname()[1]
    print(f"ready {port}", flush=True)
    await stop.wait()
    server.close()


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", action="store_true", help="never answer a POST")
    args = parser.parse_args()
    asyncio.run(serve(args.hold))
    sys.exit(0)


if __name__ == "__main__":
    main()

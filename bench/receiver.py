"""A webhook receiver for the push benchmark: ``python -m bench.receiver [--hold]``.

Runs in its own process (so it takes no CPU from the load generator), binds
127.0.0.1 on a free port, prints ``ready <port>`` and answers every POST
204 (or, with ``--hold``, never: a dead webhook that keeps the connection
open). ``GET /stats`` returns JSON: ``posts`` (frames received), ``finals``
(frames carrying TASK_STATE_COMPLETED) and ``tasks`` (distinct task ids with
a final frame). Serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType

HOLD_AT_MOST = 600.0
"""Seconds a held request stays open at most."""


class Counts:
    """What arrived (updated from the server's threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posts = 0
        self.finals = 0
        self.tasks: set[str] = set()


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


def handler(counts: Counts, hold: threading.Event | None) -> type[BaseHTTPRequestHandler]:
    """The request handler class."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if hold is not None:
                hold.wait(HOLD_AT_MOST)
                return
            final = b"TASK_STATE_COMPLETED" in body
            task_id = self.headers.get("X-A2A-Task-Id") or _task_id(body)
            with counts.lock:
                counts.posts += 1
                if final:
                    counts.finals += 1
                    counts.tasks.add(task_id)
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            with counts.lock:
                stats = {"posts": counts.posts, "finals": counts.finals, "tasks": len(counts.tasks)}
            body = json.dumps(stats).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return None

    return Handler


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", action="store_true", help="never answer a POST")
    args = parser.parse_args()
    hold = threading.Event() if args.hold else None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(Counts(), hold))
    server.daemon_threads = True

    def stop(signum: int, frame: FrameType | None) -> None:
        if hold is not None:
            hold.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"ready {server.server_address[1]}", flush=True)
    server.serve_forever()
    server.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()

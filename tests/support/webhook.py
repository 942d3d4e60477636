"""A real HTTP webhook receiver on 127.0.0.1 (stdlib ``http.server`` in a thread) for push tests.

It records every POST (headers, ProtoJSON body parsed back into a
``StreamResponse``) and answers as its ``script`` says: a status, extra
headers, or hold the request open until ``release`` is set. Tests wait on
it with ``wait_for`` (an event from the receiver thread, never a sleep).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from a2a.types.a2a_pb2 import (
    SendMessageRequest,
    StreamResponse,
    TaskPushNotificationConfig,
    TaskState,
)
from google.protobuf import json_format

HOLD_AT_MOST = 30.0
"""Seconds a held request waits for ``release`` at most (the test has failed by then)."""


@dataclass
class Post:
    """One request the receiver got."""

    path: str
    headers: dict[str, str]
    frame: StreamResponse
    at: float
    """``time.monotonic()`` when it arrived."""

    @property
    def seq(self) -> int:
        """The frame's sequence number (``X-A2A-Sequence``)."""
        return int(self.headers["x-a2a-sequence"])

    @property
    def state(self) -> TaskState:
        """The state the frame carries (UNSPECIFIED for an artifact update)."""
        kind = self.frame.WhichOneof("payload")
        if kind == "task":
            return self.frame.task.status.state
        if kind == "status_update":
            return self.frame.status_update.status.state
        return TaskState.TASK_STATE_UNSPECIFIED


@dataclass
class Answer:
    """How the receiver answers one request."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    hold: bool = False
    """Keep the request open until ``Receiver.release`` is set."""


@dataclass
class Receiver:
    """See the module docstring."""

    script: Callable[[Post, int], Answer] = lambda post, attempt: Answer()
    """(the post, how many requests came before it) -> the answer."""
    posts: list[Post] = field(default_factory=list)
    """Requests answered 2xx (delivered), in the order they were answered."""
    attempts: list[Post] = field(default_factory=list)
    """Every request, delivered or not, in arrival order."""
    release: threading.Event = field(default_factory=threading.Event)
    port: int = 0
    _changed: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str = "/hook") -> str:
        """The webhook URL."""
        return f"http://127.0.0.1:{self.port}{path}"

    def frames(self, task_id: str) -> list[Post]:
        """Delivered posts of one task, in arrival order."""
        return [p for p in self.posts if p.headers.get("x-a2a-task-id") == task_id]

    async def wait_for(self, done: Callable[[], bool], within: float = 10.0) -> None:
        """Wait until ``done()`` holds, re-checked after every request."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(changed.set)

        with self._lock:
            self._changed.append(wake)
        try:
            async with asyncio.timeout(within):
                while not done():
                    await changed.wait()
                    changed.clear()
        finally:
            with self._lock:
                self._changed.remove(wake)

    def _record(self, post: Post) -> Answer:
        with self._lock:
            answer = self.script(post, len(self.attempts))
            self.attempts.append(post)
            if 200 <= answer.status < 300 and not answer.hold:
                self.posts.append(post)
            self._wake()
        return answer

    def _released(self, post: Post, answer: Answer) -> None:
        with self._lock:
            if 200 <= answer.status < 300:
                self.posts.append(post)
            self._wake()

    def _wake(self) -> None:
        for wake in list(self._changed):
            wake()


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            frame = json_format.Parse(body.decode(), StreamResponse())
            headers = {k.lower(): v for k, v in self.headers.items()}
            post = Post(self.path, headers, frame, time.monotonic())
            json.loads(body)  # (valid JSON as well as a StreamResponse)
            answer = receiver._record(post)
            if answer.hold:
                receiver.release.wait(HOLD_AT_MOST)
                receiver._released(post, answer)
            self.send_response(answer.status)
            for name, value in answer.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            return None

    return Handler


@contextlib.contextmanager
def receiving(
    script: Callable[[Post, int], Answer] | None = None, *, tls: tuple[Path, Path] | None = None
) -> Iterator[Receiver]:
    """A running receiver on 127.0.0.1 (a free port), stopped on exit.

    Args:
        script: How it answers (default: 200 to everything).
        tls: (certificate, key) PEM files: it serves https.
    """
    receiver = Receiver() if script is None else Receiver(script=script)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(receiver))
    server.daemon_threads = True
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    receiver.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, name="webhook", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def with_webhook(
    request: SendMessageRequest, url: str, *, token: str = "", config_id: str = ""
) -> SendMessageRequest:
    """``request`` carrying an inline push config for ``url``."""
    request.configuration.task_push_notification_config.CopyFrom(
        TaskPushNotificationConfig(id=config_id, url=url, token=token)
    )
    return request


def assert_complete(posts: list[Post], final: TaskState, first_seq: int = 1) -> None:
    """Every frame from ``first_seq`` on, in order, ending with ``final``: at least once (a
    frame may come again, right after itself, as a receiver that drops repeats expects)."""
    seqs = [p.seq for p in posts]
    assert seqs == sorted(seqs), seqs
    distinct = sorted(set(seqs))
    assert distinct == list(range(first_seq, first_seq + len(distinct))), seqs
    assert posts[-1].state == final, [p.frame.WhichOneof("payload") for p in posts]


@contextlib.asynccontextmanager
async def bare_http(
    speak: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[int]:
    """A TCP server on 127.0.0.1 whose connections ``speak`` serves; yields its port.

    A connection the peer drops ends quietly; every connection is closed, and its
    handler cancelled, when the block ends.
    """
    handlers: list[asyncio.Task[Any]] = []

    async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        handlers.append(handler)
        try:
            await speak(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    server = await asyncio.start_server(serve_one, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        server.close()
        await server.wait_closed()

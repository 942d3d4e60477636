"""Webhooks on one host:port that answer 503 and then a stray answer: nothing is counted
delivered, and every frame is given up (issue 42, 6).

The receiver is a real asyncio server on 127.0.0.1. Its stray answer (a 200 sent after
the 503) arrives once the next request on that connection was written, as a stray that
was late on the network would: the client cannot tell it from an answer to that request.
"""

from __future__ import annotations

import asyncio

from a2a.types.a2a_pb2 import TaskPushNotificationConfig, TaskState

from a2a_grpc_server import ServerConfig
from tests.support.agents import InputAgent
from tests.support.harness import V1, send_request, serve
from tests.support.webhook import bare_http

STRAY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
BUSY = b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n"


async def test_three_webhooks_on_one_host_answering_503_and_a_stray_get_nothing_delivered() -> None:
    requests: list[bytes] = []

    async def busy_and_stray(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        owed = False
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            requests.append(head.split(b" ", 2)[1])
            writer.write((STRAY if owed else b"") + BUSY)
            await writer.drain()
            owed = True  # (a stray follows every 503)

    config = ServerConfig(cancel_timeout=1.0, push_allow_private=True, push_retry_for=1.0)
    async with (
        bare_http(busy_and_stray) as port,
        asyncio.timeout(30),
        serve(InputAgent(), config) as h,
    ):
        task = (await h.stub.SendMessage(send_request("hi"), metadata=V1)).task
        for path in ("a", "b", "c"):
            await h.stub.CreateTaskPushNotificationConfig(
                TaskPushNotificationConfig(task_id=task.id, url=f"http://127.0.0.1:{port}/{path}"),
                metadata=V1,
            )
        answer = await h.stub.SendMessage(
            send_request("bob", task_id=task.id, context_id=task.context_id), metadata=V1
        )
        assert answer.task.status.state == TaskState.TASK_STATE_COMPLETED
        await h.settle(within=20)  # every frame given up
        counted = h.service.metrics.push_deliveries
        assert len(requests) > 3, "each webhook was tried more than once"
        assert counted["delivered"] == 0, dict(counted)
        assert counted["given_up"] >= 3, dict(counted)

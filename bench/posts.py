"""``python -m bench.posts``: the CPU one webhook POST costs this process (the push sender alone).

    .venv/bin/python -m bench.posts [--posts 3000] [--in-flight 16]

Starts ``bench.receiver`` (its own process, 127.0.0.1, answers 204), then
sends ``--posts`` POSTs of one small frame through ``push.sender.WebhookSender``
(the server's sender, its defaults but for private addresses), ``--in-flight``
at a time, after 200 to warm up, and prints this process's CPU per POST
(``time.process_time``) and POSTs per second. Bounded in count, and each POST
by the sender's 10 s timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from a2a.types.a2a_pb2 import TaskPushNotificationConfig

from a2a_grpc_server._internal.push.screen import Screen
from a2a_grpc_server._internal.push.sender import Outcome, WebhookSender

from .push import Receiver

BODY = b'{"statusUpdate":{"taskId":"t","contextId":"c","status":{"state":"TASK_STATE_WORKING"}}}'


async def main(posts: int, in_flight: int) -> None:
    """Send the POSTs and print what they cost."""
    receiver = await Receiver.start(hold=False)
    sender = WebhookSender(Screen(allow_private=True), timeout=10, max_connections=100)
    config = TaskPushNotificationConfig(id="c", url=receiver.url, token="tok")
    gate = asyncio.Semaphore(in_flight)

    async def one(seq: int) -> None:
        async with gate:
            attempt = await sender.post(config, "t", seq, BODY)
            if attempt.outcome is not Outcome.DELIVERED:
                raise RuntimeError(f"POST {seq}: {attempt.detail}")

    try:
        await asyncio.gather(*(one(i) for i in range(200)))  # warm-up
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(posts)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        print(
            f"{posts} POSTs, {in_flight} in flight: {1e6 * cpu / posts:.0f} us of CPU per POST, "
            f"{posts / wall:,.0f} POSTs/s"
        )
    finally:
        await sender.close()
        await receiver.stop()


def cli() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--posts", type=int, default=3000)
    parser.add_argument("--in-flight", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.posts, args.in_flight))
    sys.exit(0)


if __name__ == "__main__":
    cli()

"""What a retry key as ``Nats-Msg-Id`` costs nats-server: memory per id in the duplicate window.

    .venv/bin/python -m bench.nats_msgid [--messages 200000] [--window 86400] [--reps 2]

Issue 41 (docs/decisions/0001, plan item 2): layout E could carry a turn's retry key
as the ``Nats-Msg-Id`` of its first change, so a key costs no write of its own; but
nats-server keeps every id of a stream's ``duplicate_window`` in memory, and our
window (``idempotency_window``) is a day. On a nats-server of its own per run (one
node, file storage), this process publishes ``--messages`` messages of 300 bytes to
one stream, with a unique ``Nats-Msg-Id`` each or without, in windows of 500
in flight, and reads nats-server's resident memory (``/proc/<pid>/status``) before
and after. Prints bytes of memory per message, median [min-max]; loopback only,
bounded by ``--messages`` and a 120 s deadline per run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid
from pathlib import Path

import nats
from nats.js.api import StreamConfig

from tests.support import natsserver

WINDOW_IN_FLIGHT = 500


def resident_bytes(pid: int) -> int:
    """The process's resident memory (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def run(messages: int, window: float, with_ids: bool) -> float:
    """Bytes of nats-server memory per message published."""
    with natsserver.running(1) as cluster:
        node = cluster.nodes[0]
        assert node.proc is not None
        nc = await nats.connect(cluster.urls[0])
        try:
            js = nc.jetstream()
            await js.add_stream(
                StreamConfig(name="IDS", subjects=["ids.>"], duplicate_window=window)
            )
            await asyncio.sleep(0.5)  # sync-ok: let the server settle before reading RSS
            before = resident_bytes(node.proc.pid)
            payload = b"x" * 300
            async with asyncio.timeout(120):
                for start in range(0, messages, WINDOW_IN_FLIGHT):
                    acks = [
                        await js.publish_async(
                            f"ids.{n % 1000}",
                            payload,
                            headers={"Nats-Msg-Id": uuid.uuid4().hex} if with_ids else None,
                        )
                        for n in range(start, min(start + WINDOW_IN_FLIGHT, messages))
                    ]
                    await asyncio.gather(*acks)
            await asyncio.sleep(0.5)  # sync-ok: as above
            return (resident_bytes(node.proc.pid) - before) / messages
        finally:
            await nc.close()


async def main(args: argparse.Namespace) -> None:
    rows: dict[str, list[float]] = {"with Nats-Msg-Id": [], "without": []}
    for _ in range(args.reps):
        rows["with Nats-Msg-Id"].append(await run(args.messages, args.window, True))
        rows["without"].append(await run(args.messages, args.window, False))
    print(
        f"nats-server memory per message, bytes ({args.messages} messages, "
        f"duplicate_window {args.window:.0f} s, {args.reps} repetitions)"
    )
    for name, values in rows.items():
        print(f"{name:<20} {statistics.median(values):8.0f} [{min(values):.0f}-{max(values):.0f}]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--window", type=float, default=86_400.0)
    parser.add_argument("--reps", type=int, default=2)
    asyncio.run(main(parser.parse_args()))

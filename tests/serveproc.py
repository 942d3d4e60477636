"""``a2a-grpc-server serve`` as a child process, started and waited for by its ready line."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"ready: grpc (\S+) \((?:plaintext|TLS|mTLS)\), agent card https?://(\S+)")


class Process:
    """A running ``serve`` process and the addresses it printed."""

    def __init__(self, proc: asyncio.subprocess.Process, grpc_addr: str, http_addr: str) -> None:
        self.proc, self.grpc_addr, self.http_addr = proc, grpc_addr, http_addr


async def start(*args: str) -> Process:
    """Start ``serve`` on free ports with ``args``; return once it printed its ready line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "a2a_grpc_server.cli",
        "serve",
        "--port",
        "0",
        "--http-port",
        "0",
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COUNTDOWN_TICK": "0.05"},
    )
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(20):
            while True:
                line = (await proc.stderr.readline()).decode()
                assert line, "server exited before it was ready"
                if match := READY.search(line):
                    return Process(proc, match.group(1), match.group(2))
    except BaseException:
        if proc.returncode is None:
            proc.kill()  # never leave a server behind a failed start
        await proc.wait()
        raise

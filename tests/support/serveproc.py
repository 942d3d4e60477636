"""``a2a-grpc-server serve`` as a child process, started and waited for by its ready line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator

import grpc
from a2a.client.transports.grpc import GrpcTransport

from tests.support import ROOT, cluster_key_file, clusterharness

READY = re.compile(r"ready: grpc (\S+) \((?:plaintext|TLS|mTLS)\), agent card https?://([^/\s]+)")


class Process:
    """A running ``serve`` process and the addresses it printed."""

    def __init__(self, proc: asyncio.subprocess.Process, grpc_addr: str, http_addr: str) -> None:
        self.proc, self.grpc_addr, self.http_addr = proc, grpc_addr, http_addr
        self.read: list[str] = []
        """Lines ``start`` read after the ready line (``logged`` looks there first)."""


READY_WITHIN = 20.0
"""Seconds a server may take to say it is ready (and, creating tasks in the task log, to
have heard the cluster)."""
SETTLED = "writing format 2"
"""What an instance logs once it has heard every other (``jetstream.formats``)."""


async def start(*args: str, env: dict[str, str] | None = None) -> Process:
    """Start ``serve`` on free ports with ``args``; return once it printed its ready line.

    ``env``: variables to set for it beside this process's (e.g. ``PYTHONPATH`` to run
    another version's code). In cluster mode (``--nats``) it gets the test run's cluster
    key unless ``args`` or ``env`` say otherwise (``env``: another version may not know
    the flag).
    """
    if "--nats" in args and env is None and "--nats-key-file" not in args:
        args = (*args, "--nats-key-file", str(cluster_key_file()))
    chosen = clusterharness.TASK_LOG if "--nats" in args and env is None else None
    if chosen is not None:  # (a layout chosen: its flag, before any the test gives)
        args = ("--nats-task-log" if chosen else "--no-nats-task-log", *args)
    task_log = bool(chosen)  # (then ready once new tasks go to the log, below)
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
        env={**os.environ, "COUNTDOWN_TICK": "0.05", **(env or {})},
    )
    assert proc.stderr is not None
    said: list[str] = []
    try:
        async with asyncio.timeout(READY_WITHIN):
            while True:
                line = (await proc.stderr.readline()).decode()
                assert line, "server exited before it was ready; it said:\n" + "".join(said[-20:])
                said.append(line)
                if match := READY.search(line):
                    ready = Process(proc, match.group(1), match.group(2))
                    if task_log and not any(SETTLED in said_line for said_line in said):
                        while SETTLED not in (line := (await proc.stderr.readline()).decode()):
                            assert line, "server exited before it heard the cluster"
                        ready.read.append(line)  # (new tasks go to the log from here)
                    return ready
    except BaseException as exc:
        if proc.returncode is None:
            proc.kill()  # never leave a server behind a failed start
        await proc.wait()
        if isinstance(exc, TimeoutError):
            raise NotReadyError(
                f"not ready within {READY_WITHIN:g} s; it said:\n" + "".join(said[-20:])
            ) from exc
        raise


class NotReadyError(Exception):
    """A server did not say it was ready in time (what it said is in the message)."""


@contextlib.asynccontextmanager
async def owner_process(
    nats_url: str,
    lease: float,
    *args: str,
    agent: str = "tests.support.agents:Hanging",
) -> AsyncIterator[tuple[Process, GrpcTransport]]:
    """A ``serve`` process running ``agent`` in the cluster (with ``args``), and a client
    of it; killed on exit if it still runs."""
    owner = await start("--agent", agent, "--nats", nats_url, "--lease", str(lease), *args)
    client = GrpcTransport(grpc.aio.insecure_channel(owner.grpc_addr), None)
    try:
        yield owner, client
    finally:
        await client.close()
        if owner.proc.returncode is None:
            owner.proc.kill()
            await owner.proc.wait()


async def logged(process: Process, text: str) -> None:
    """Wait until the process logs a line holding ``text`` (after its ready line)."""
    for at, line in enumerate(process.read):
        if text in line:
            del process.read[: at + 1]
            return
    process.read.clear()
    assert process.proc.stderr is not None
    while text not in (line := (await process.proc.stderr.readline()).decode()):
        assert line, f"exited before it logged {text!r}"


def refusal(*args: str) -> str:
    """Run ``serve`` with ``args``, which it must refuse at start; return what it said."""
    done = subprocess.run(
        [sys.executable, "-m", "a2a_grpc_server.cli", "serve", "--port", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0, (args, done.stderr[-300:])
    return done.stderr

"""docs/tutorial.md runs as written, and the reader sees what it says.

How the test reads the page:

* its files are the Python blocks whose first line names them (``# call.py``);
* its commands are the bash blocks whose first line names a terminal (``# terminal 1``):
  terminal 1 serves (the echo agent, then the tutorial's agent), terminal 2 calls (the echo
  agent, then a long task of the tutorial's agent), terminal 3 cancels that task;
* what the reader sees is each text block after an ``<!-- output: KEY -->`` comment.

What it changes, and only this:

* The install step (``pip install -e .``) is not run again: the files go into a temporary
  directory holding a link to this checkout's ``.venv`` (scripts/check installs the checkout
  the same way). The test checks that the step is the README's.
* Ports: the tutorial uses the defaults (gRPC 127.0.0.1:50051, card 127.0.0.1:8080). The
  test appends ``--port 0 --http-port 0`` to each serve command (the last flag wins), reads
  the ports the server chose from its ready line, and replaces ``127.0.0.1:50051`` and
  ``127.0.0.1:8080`` with them, in the files and in the expected output.
* Clients run with ``PYTHONUNBUFFERED=1``, so the test reads each frame's line as it comes.

Ctrl+C is SIGINT. Every process runs in a session of its own, and whatever still runs at
the end is killed with its session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from tests.support import ROOT
from tests.support.serveproc import READY

PAGE = ROOT / "docs" / "tutorial.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
FILE = re.compile(r"^# ([\w.]+\.py)\n")
TERMINAL = re.compile(r"^# terminal (\d)\n(.+)\n$")
OUTPUT = re.compile(r"^<!-- output: (.+?) -->\n```text\n(.*?)^```", re.S | re.M)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
GRPC, CARD = "127.0.0.1:50051", "127.0.0.1:8080"
"""The addresses the tutorial shows (serve's defaults); the test's servers take free ports."""

WITHIN = 20.0
"""Seconds any one step may take: a server to be ready or to stop, a client to end."""
AT_ONCE = 5.0
"""Seconds the stream may take to end once the cancel is answered (the agent steps every 1 s;
``cancel_timeout`` is 3 s): the frame is already there, only the client's exit is left."""


class Tutorial:
    """The tutorial's files, commands per terminal, and outputs, as the page has them."""

    def __init__(self, text: str) -> None:
        self.files: dict[str, str] = {}
        self.terminals: dict[int, list[str]] = {}
        self.install: list[str] = []
        for language, body in FENCE.findall(text):
            if language == "python" and (named := FILE.match(body)):
                assert named.group(1) not in self.files, f"two blocks are {named.group(1)}"
                self.files[named.group(1)] = body
            elif language == "bash" and (terminal := TERMINAL.match(body)):
                self.terminals.setdefault(int(terminal.group(1)), []).append(terminal.group(2))
            elif language == "bash" and "pip install -e .\n" in body + "\n":
                self.install.append(body.strip())
        self.outputs: dict[str, list[str]] = {}
        for key, body in OUTPUT.findall(text):
            assert key not in self.outputs, f"two outputs are marked {key!r}"
            self.outputs[key] = body.splitlines()


def local(lines: list[str], grpc_addr: str, card_addr: str) -> list[str]:
    """``lines`` as this test's servers say them (their ports, not the defaults)."""
    return [line.replace(GRPC, grpc_addr).replace(CARD, card_addr) for line in lines]


async def start(command: str, cwd: Path) -> asyncio.subprocess.Process:
    """Run a tutorial ``command`` in ``cwd`` as the reader's shell would, in its own session."""
    return await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        command,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


async def stop(proc: asyncio.subprocess.Process) -> None:
    """Kill ``proc``'s session if it still runs (never leave a process behind)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def run(command: str, cwd: Path) -> list[str]:
    """Run a client ``command`` to its end; return the lines it printed."""
    proc = await start(command, cwd)
    try:
        async with asyncio.timeout(WITHIN):
            out, err = await proc.communicate()
    finally:
        await stop(proc)
    assert proc.returncode == 0, f"{command!r} failed:\n{err.decode()[-3000:]}"
    return out.decode().splitlines()


class Server:
    """A serve command of the tutorial, running on free ports."""

    def __init__(self, proc: asyncio.subprocess.Process, ready: str) -> None:
        self.proc, self.ready = proc, ready
        match = READY.search(ready)
        assert match is not None
        self.grpc_addr, self.card_addr = match.group(1), match.group(2)
        self.said: list[str] = [ready]
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        """Keep reading what it logs (so the pipe never fills)."""
        assert self.proc.stderr is not None
        while line := (await self.proc.stderr.readline()).decode():
            self.said.append(line)

    async def ctrl_c(self) -> None:
        """Stop it as the reader does (Ctrl+C), and wait until it exits."""
        os.killpg(self.proc.pid, signal.SIGINT)
        async with asyncio.timeout(WITHIN):
            await self.proc.wait()
            await self.reader
        assert self.proc.returncode == 0, "".join(self.said[-20:])


@contextlib.asynccontextmanager
async def serving(command: str, cwd: Path) -> AsyncIterator[Server]:
    """Start a serve command of the tutorial on free ports; yield it once it said it is ready."""
    assert command.startswith(".venv/bin/a2a-grpc-server serve"), command
    proc = await start(f"{command} --port 0 --http-port 0", cwd)
    assert proc.stderr is not None
    said: list[str] = []
    server: Server | None = None
    try:
        async with asyncio.timeout(WITHIN):
            while not READY.search(line := (await proc.stderr.readline()).decode()):
                assert line, f"{command!r} exited before it was ready:\n" + "".join(said[-20:])
                said.append(line)
        server = Server(proc, line.rstrip("\n"))
        yield server
    finally:
        await stop(proc)
        if server is not None:  # (its reader ends with the process's stderr)
            async with asyncio.timeout(WITHIN):
                await server.reader


def write_files(tutorial: Tutorial, server: Server, where: Path) -> None:
    """Save the tutorial's files in ``where``, pointed at ``server``."""
    for name, text in tutorial.files.items():
        [text] = local([text], server.grpc_addr, server.card_addr)
        (where / name).write_text(text)


def check_ready_line(tutorial: Tutorial, server: Server) -> None:
    [expected] = local(tutorial.outputs["serve"], server.grpc_addr, server.card_addr)
    assert server.ready.endswith(expected), (server.ready, expected)


async def test_the_tutorial_runs_as_written(tmp_path: Path) -> None:
    tutorial = Tutorial(PAGE.read_text())
    assert set(tutorial.files) == {"call.py", "slow_agent.py", "cancel.py"}, tutorial.files
    assert {n: len(c) for n, c in tutorial.terminals.items()} == {1: 2, 2: 2, 3: 1}
    [serve_echo, serve_agent] = tutorial.terminals[1]
    [call_echo, call_long] = tutorial.terminals[2]
    [cancel] = tutorial.terminals[3]
    assert set(tutorial.outputs) == {"serve", "call.py hello", "cancel.py", "call.py 30"}
    assert call_echo.endswith(" call.py hello") and call_long.endswith(" call.py 30")
    [install] = tutorial.install
    readme = (ROOT / "README.md").read_text()
    assert f"\n{install} && " in readme, "the install step is no longer the README's"
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # (this checkout's .venv)

    async with asyncio.timeout(50):  # (under pytest's own 60 s)
        # Serve the echo agent, and call it.
        async with serving(serve_echo, tmp_path) as server:
            check_ready_line(tutorial, server)
            write_files(tutorial, server, tmp_path)
            assert await run(call_echo, tmp_path) == tutorial.outputs["call.py hello"]
            await server.ctrl_c()

        # Serve your own agent; start a long task; cancel it from a second call.
        async with serving(serve_agent, tmp_path) as server:
            check_ready_line(tutorial, server)
            write_files(tutorial, server, tmp_path)
            stream = await start(call_long, tmp_path)
            assert stream.stdout is not None
            try:
                seen: list[str] = []
                async with asyncio.timeout(WITHIN):  # until the agent has done a step
                    while not seen or not seen[-1].startswith("artifact "):
                        line = (await stream.stdout.readline()).decode()
                        assert line, f"the stream ended early: {seen}"
                        seen.append(line.rstrip("\n"))
                canceled = await run(cancel, tmp_path)
                # "Terminal 2 stops at once": CancelTask answered after the final frame
                # was appended, so the stream ends now, not a step or a timeout later.
                async with asyncio.timeout(AT_ONCE):
                    rest, err = await stream.communicate()
                assert stream.returncode == 0, err.decode()[-3000:]
            finally:
                await stop(stream)
            seen += rest.decode().splitlines()
            await server.ctrl_c()

    # cancel.py printed the task's id and its new state.
    assert [UUID.sub("ID", line) for line in canceled] == [
        UUID.sub("ID", line) for line in tutorial.outputs["cancel.py"]
    ]
    # The stream: the task, WORKING, the steps done before the cancel, then the final frame.
    expected = tutorial.outputs["call.py 30"]
    steps = [f"artifact step {n} of 30" for n in range(1, 31)]
    shown = [line for line in expected if line.startswith("artifact ")]
    done = [line for line in seen if line.startswith("artifact ")]
    assert shown == steps[: len(shown)], f"the tutorial shows no run of steps: {shown}"
    assert done == steps[: len(done)] and 0 < len(done) < 30, seen
    assert seen[: -1 - len(done)] == expected[: -1 - len(shown)], (seen, expected)
    assert seen[-1] == expected[-1], f"the stream's final frame: {seen[-1]!r}, not {expected[-1]!r}"

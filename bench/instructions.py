"""``python -m bench.instructions``: instructions the server process spends per call.

    .venv/bin/python -m bench.instructions [--servers ours@../before,ours,raw]
                                           [--calls 320] [--streams 96]

CPU time on this machine moves by 15 % between repetitions of the same code
(``python -m bench``); the number of instructions a process executes hardly
moves at all. Each server of ``--servers`` (as ``python -m bench`` names them,
``@DIR`` included) runs under valgrind's callgrind, in its own process, with
its defaults; this process drives it through generated stubs, 16 callers on 4
connections: 160 blocking SendMessage and 16 streams to warm up, then the
counters are zeroed, ``--calls`` SendMessage ("unary"), a dump, zeroed again,
``--streams`` SendStreamingMessage of 13 frames ("stream"), a dump. It prints,
per server, instructions per unary call and per streamed frame (all threads
of the server process: the event loop, gRPC's poller and its C core), and
their ratio to ``raw``'s when raw runs.

What it leaves out: the kernel's work (system calls, the loopback), and what
an instruction costs (cache misses, stalls): it complements the CPU figures
of ``python -m bench``, which include both, and does not replace them.
Bounded in count; each phase also by ``PHASE_AT_MOST`` seconds. Needs
``valgrind`` (and its ``callgrind_control``) on ``PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from . import load

WARM_CALLS = 160
WARM_STREAMS = 16
CALLERS = 16
FRAMES = 13
"""Frames of one ``stream`` (the task, WORKING, 10 artifacts, COMPLETED)."""
PHASE_AT_MOST = 900.0
"""Seconds one phase may take under valgrind (about 50 times slower than without)."""
READY_WITHIN = 180.0
"""Seconds a server may take to start under valgrind."""
DUMP_POLLS = 600
"""Checks, 0.1 s apart, for a dump the server is writing."""


async def _control(command: str, pid: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        "callgrind_control",
        command,
        str(pid),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    if await proc.wait() != 0:
        raise RuntimeError(f"callgrind_control {command} {pid} failed")


def _total(dump: Path) -> int:
    """The instructions a callgrind dump counts."""
    with dump.open() as lines:
        for line in lines:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"{dump} holds no total")


async def measure(kind: str, calls: int, streams: int, out: Path) -> dict[str, float]:
    """Instructions per unary call and per streamed frame of one server of ``kind``."""
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", kind)  # (``ours@../before``: a file name)
    wrapper = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/{name}.%p")
    target = await load.start(kind, wrapper=wrapper, ready_within=READY_WITHIN)
    pid = target.proc.pid
    try:
        async with asyncio.timeout(PHASE_AT_MOST):
            await load.send_message(target, CALLERS, PHASE_AT_MOST, WARM_CALLS)
            await load.streaming(target, CALLERS, PHASE_AT_MOST, WARM_STREAMS)
        figures: dict[str, float] = {}
        phases: dict[str, Callable[[], Awaitable[load.Result]]] = {
            "unary": lambda: load.send_message(target, CALLERS, PHASE_AT_MOST, calls),
            "stream": lambda: load.streaming(target, CALLERS, PHASE_AT_MOST, streams),
        }
        for number, (phase, run) in enumerate(phases.items(), start=1):
            await _control("-z", pid)
            async with asyncio.timeout(PHASE_AT_MOST):
                done = int((await run())["n"])  # (a few more than asked: callers in flight)
            await _control("-d", pid)
            dump = out / f"{name}.{pid}.{number}"
            for _ in range(DUMP_POLLS):  # (written by the server process)
                if dump.exists():
                    break
                await asyncio.sleep(0.1)  # sync-ok: a file another process writes
            else:
                raise RuntimeError(f"{kind}: callgrind wrote no {dump.name}")
            figures[phase] = _total(dump) / (done * FRAMES if phase == "stream" else done)
        return figures
    finally:
        await load.stop(target)


async def main(args: argparse.Namespace) -> list[tuple[str, dict[str, float]]]:
    """Measure every server in turn."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="a2a-callgrind-") as tmp:
        for kind in args.servers.split(","):
            print(f"{kind} ...", flush=True)
            rows.append((kind, await measure(kind, args.calls, args.streams, Path(tmp))))
    return rows


def cli() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="ours,raw")
    parser.add_argument("--calls", type=int, default=320)
    parser.add_argument("--streams", type=int, default=96)
    args = parser.parse_args()
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        sys.exit("bench.instructions needs valgrind and callgrind_control on PATH")
    rows = asyncio.run(main(args))
    raw = dict(rows).get("raw")
    print(f"\n{'server':24} {'per unary call':>16} {'per streamed frame':>20}")
    for kind, figures in rows:
        cells = []
        for name in ("unary", "stream"):
            cell = f"{figures[name]:,.0f}"
            if raw is not None and kind != "raw":
                cell += f" ({figures[name] / raw[name]:.2f}x raw)"
            cells.append(cell)
        print(f"{kind:24} {cells[0]:>16} {cells[1]:>20}")
    print(
        f"\ninstructions of the server process (callgrind), {args.calls} calls and "
        f"{args.streams} streams of {FRAMES} frames after a warm-up, 16 callers; defaults"
    )


if __name__ == "__main__":
    cli()

"""``python -m bench.push``: what push notifications cost, ours beside a2a-sdk and raw grpc.aio.

    .venv/bin/python -m bench.push [--reps 3] [--servers ours,sdk,raw] [--tasks 900]
                                   [--json PATH] [--profile DIR]

Each repetition starts, per server, a fresh server process and two webhook
receivers in their own processes (``bench.receiver``: one answers 204, one
never answers), all on 127.0.0.1, then runs:

* ``SendMessage x16``: ``--tasks`` blocking SendMessage at 16 callers, no webhook;
* ``SendMessage x16 + webhook``: the same, each task with an inline push config
  for the live receiver; the run ends when the receiver has every task's final
  frame (or after 60 s), so ``server_cpu_us_per_unit`` covers the deliveries;
  ``drain_ms`` is how long after the last answer the last final frame arrived,
  ``finals_missing`` how many tasks' final frames never did;
* ``fan-out 1000 to 10`` and ``... + dead webhook``: the fan-out of ``python -m
  bench``, without and with a push config on the task for the receiver that
  never answers (frames not delivered to the subscribers within 60 s count as
  missing).

raw has no push: it answers the same, ignoring the config (the grpc.aio limit).
``--tasks`` is 900 by default: every task's config counts against the caller's
``quota_push_configs`` (1,000) for as long as the ended task is kept, and
every call here is one caller's.
The servers run their defaults but for one setting this benchmark must change:
ours gets ``push_allow_private=True`` (by default it refuses to post to
127.0.0.1) and a2a-sdk gets a push sender and config store (it has none by
default). Prints the table of ``python -m bench`` and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx

from . import load
from .__main__ import profile_path, summarize, table
from .load import Result

ROOT = Path(__file__).resolve().parent.parent
DRAIN_AT_MOST = 60.0
"""Seconds the webhook run waits for the last final frame."""
DEAD_WEBHOOK_WAIT = 60.0
"""Seconds the fan-out with a dead webhook may take; what has not arrived by then is missing."""
PUSH_ARGS = ("--push-to-loopback",)


class Receiver:
    """A ``bench.receiver`` process."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}/hook"

    @classmethod
    async def start(cls, *, hold: bool) -> Receiver:
        """Start one; return once it printed its port."""
        args = [sys.executable, "-m", "bench.receiver", *(["--hold"] if hold else [])]
        proc = await asyncio.create_subprocess_exec(
            *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        assert proc.stdout is not None
        async with asyncio.timeout(20):
            line = (await proc.stdout.readline()).decode().split()
        if line[:1] != ["ready"]:
            proc.kill()
            await proc.wait()
            raise RuntimeError("the receiver did not start")
        return cls(proc, int(line[1]))

    async def stats(self) -> dict[str, float]:
        """What it received so far, and the CPU seconds it spent (``bench.receiver``)."""
        async with httpx.AsyncClient(trust_env=False) as client:
            answer = await client.get(f"http://127.0.0.1:{self.port}/stats", timeout=10)
            stats: dict[str, float] = answer.json()
            return stats

    async def stop(self) -> None:
        """Stop the process."""
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def run_kind(kind: str, tasks: int, profile: str = "") -> dict[str, Result]:
    """Every scenario against one fresh server of ``kind`` and fresh receivers."""
    live, dead = await Receiver.start(hold=False), await Receiver.start(hold=True)
    extra = (*PUSH_ARGS, "--profile", profile) if profile else PUSH_ARGS
    target = await load.start(kind, extra=extra)
    try:
        await load.send_message(target, 4, 0.5, 500)  # warm-up
        out: dict[str, Result] = {}
        out["SendMessage x16"] = await load.send_message(target, 16, 120, tasks)
        first = await live.stats()
        before, began = first["tasks"], time.perf_counter()

        async def drained(sent: int) -> Result:
            t0 = time.perf_counter()
            stats = first
            deadline = t0 + DRAIN_AT_MOST
            while time.perf_counter() < deadline:
                stats = await live.stats()
                if stats["tasks"] - before >= sent:
                    break
                await asyncio.sleep(0.05)
            return {
                "drain_ms": (time.perf_counter() - t0) * 1000,
                "finals_missing": sent - (stats["tasks"] - before),
                # (it shares the cores: a busy receiver slows the server down)
                "receiver_cpu_pct": 100
                * (stats["cpu_s"] - first["cpu_s"])
                / (time.perf_counter() - began),
            }

        out["SendMessage x16 + webhook"] = await load.send_message(
            target, 16, 120, tasks, webhook=live.url, drained=drained if kind != "raw" else None
        )
        out["fan-out 1000 to 10"] = await load.fan_out(target, 10, 1000)
        out["fan-out 1000 to 10 + dead webhook"] = await load.fan_out(
            target, 10, 1000, webhook=dead.url, within=DEAD_WEBHOOK_WAIT
        )
        for name, result in out.items():
            print(f"  {kind:6} {name:34} " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
        return out
    finally:
        await load.stop(target)
        await live.stop()
        await dead.stop()


PLAN = [
    ("SendMessage x16", ["tasks_per_s", "p99_ms"]),
    (
        "SendMessage x16 + webhook",
        ["tasks_per_s", "p99_ms", "drain_ms", "finals_missing", "receiver_cpu_pct"],
    ),
    ("fan-out 1000 to 10", ["frames_per_s", "missing_final_frames", "lag_p99_ms"]),
    ("fan-out 1000 to 10 + dead webhook", ["frames_per_s", "missing_final_frames", "lag_p99_ms"]),
]


async def main(args: argparse.Namespace) -> dict[str, object]:
    """Run every repetition."""
    kinds = args.servers.split(",")
    reps = []
    for rep in range(args.reps):
        print(f"repetition {rep + 1}/{args.reps}", flush=True)
        reps.append(
            {
                kind: await run_kind(kind, args.tasks, profile_path(args.profile, kind, rep))
                for kind in kinds
            }
        )
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "params": vars(args) | {"json": str(args.json)},
        "summary": summarize(reps, PLAN, kinds),
        "repetitions": reps,
    }


def cli() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--servers", default="ours,sdk,raw")
    parser.add_argument(
        "--tasks",
        type=int,
        default=900,
        help="tasks per SendMessage run (with a webhook each: within quota_push_configs, 1000)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "push.json")
    parser.add_argument(
        "--profile", default="", help="a directory: cProfile each server into <kind>-<rep>.prof"
    )
    args = parser.parse_args()
    report = asyncio.run(main(args))
    summary = report["summary"]
    assert isinstance(summary, list)
    print()
    print(
        "ours: ServerConfig defaults but push_allow_private=True (the receivers are on "
        "127.0.0.1); sdk: a2a-sdk defaults plus its push sender and config store"
    )
    print(table(summary, args.servers.split(",")))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    cli()

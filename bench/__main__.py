"""``python -m bench``: ours beside a2a-sdk and a bare grpc.aio servicer, in one run.

    .venv/bin/python -m bench [--reps 3] [--servers ours,ours-nats,sdk,raw]
                              [--seconds 2] [--memory 1000,10000] [--uvloop] [--json PATH]
                              [--only TEXT] [--profile DIR]

A server name may end in ``+uvloop`` to run it on uvloop beside the others, e.g.
``--servers ours,ours+uvloop,raw,raw+uvloop`` compares both loops in one run;
``--uvloop`` puts every server on uvloop. A name may end in ``@DIR`` to serve the
code of another checkout (e.g. a worktree of the commit before a change) beside
this one's, paired per repetition: ``--servers ours@../before,ours,raw``.
``--only`` takes names separated by commas (each matched as a substring).

Each server runs in its own process on 127.0.0.1 (``bench.servers``), started
fresh for every repetition and for every memory measurement; this process is
the load generator (plain generated gRPC stubs, four connections). For each
scenario it prints the median over the repetitions with the spread
[min-max], and the ratios ours/a2a-sdk and ours/raw, paired per repetition
(then the median), plus server and client CPU so a saturated machine can be
told from a slow server. Writes everything, raw per-repetition results
included, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from a2a_grpc_server import ServerConfig
from tests.support import natsserver

from . import load
from .load import Result, Target

ROOT = Path(__file__).resolve().parent.parent
Scenario = tuple[str, list[str], Callable[[Target], Awaitable[Result]]]


def scenarios(seconds: float) -> list[Scenario]:
    """The throughput and latency scenarios: (name, headline metrics, run)."""
    out: list[Scenario] = []
    for callers in (1, 16, 64):
        out.append(
            (
                f"SendMessage x{callers}",
                ["tasks_per_s", "p50_ms", "p99_ms"],
                lambda t, c=callers: load.send_message(t, c, seconds, 200_000),  # type: ignore[misc]
            )
        )
    for callers in (16, 64):
        out.append(
            (
                f"streaming x{callers}",
                ["streams_per_s", "frames_per_s"],
                lambda t, c=callers: load.streaming(t, c, seconds, 100_000),  # type: ignore[misc]
            )
        )
    for count in (1000, 10_000):
        for subs in (1, 10, 100):
            out.append(
                (
                    f"fan-out {count} to {subs}",
                    ["frames_per_s", "missing_frames", "missing_final_frames", "lag_p99_ms"],
                    lambda t, s=subs, c=count: load.fan_out(t, s, c),  # type: ignore[misc]
                )
            )
    out.append(("cancel -> final frame", ["p50_ms", "p99_ms", "missing_final_frames"], load.cancel))
    out.append(
        (
            "burst to 20 unread",
            [
                "other_p50_ms",
                "other_p99_ms",
                "other_max_ms",
                "missing_frames",
                "missing_final_frames",
            ],
            load.burst_unread,
        )
    )
    return out


async def run_kind(
    kind: str,
    plan: list[Scenario],
    nats: natsserver.Node | None,
    uvloop: bool,
    profile: str = "",
) -> dict[str, Result]:
    """Every scenario against one fresh server of ``kind`` (profiled into ``profile``).

    On NATS, the nats-server's CPU is reported beside the server's.
    """
    extra = ("--profile", profile) if profile else ()
    url = nats.url if nats is not None else None
    pid = nats.proc.pid if nats is not None and nats.proc and kind.startswith("ours-nats") else None
    target = await load.start(kind, nats=url, nats_pid=pid, uvloop=uvloop, extra=extra)
    try:
        await load.send_message(target, 4, 0.5, 500)  # warm-up
        results = {}
        for name, _, run in plan:
            results[name] = await run(target)
            print(f"  {kind:10} {name:24} {_brief(results[name])}", flush=True)
        return results
    finally:
        await load.stop(target)


async def memory(
    kind: str, sizes: list[int], nats: natsserver.Node | None, uvloop: bool
) -> dict[str, Result]:
    """Resident bytes per parked task, alone and with a subscriber, each on a fresh server."""
    out = {}
    for size in sizes:
        for subscribe in (False, True):
            name = f"RSS per parked task{' + subscriber' if subscribe else ''} at {size}"
            url = nats.url if nats is not None else None
            target = await load.start(kind, nats=url, uvloop=uvloop)
            try:
                await load.send_message(target, 4, 0.5, 500)  # warm-up
                out[name] = await load.parked_memory(
                    target, size, with_subscriber=subscribe, seconds=90
                )
            finally:
                await load.stop(target)
            print(f"  {kind:10} {name:40} {_brief(out[name])}", flush=True)
    return out


def profile_path(directory: str, kind: str, rep: int) -> str:
    """Where the cProfile of ``kind``'s server in repetition ``rep`` goes ("" for none)."""
    if not directory:
        return ""
    os.makedirs(directory, exist_ok=True)
    name = kind.replace(os.sep, "_")  # (a kind@DIR names a directory)
    return os.path.abspath(os.path.join(directory, f"{name}-{rep + 1}.prof"))


def _brief(result: Result) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in result.items())


@contextlib.contextmanager
def maybe_nats(wanted: bool) -> Iterator[natsserver.Node | None]:
    """A nats-server for ``ours-nats``, if it is among the servers."""
    if not wanted:
        yield None
        return
    with natsserver.running(1) as cluster:
        yield cluster.nodes[0]


def summarize(
    reps: list[dict[str, dict[str, Result]]], plan: list[tuple[str, list[str]]], kinds: list[str]
) -> list[dict[str, object]]:
    """Median and spread per metric and server; paired ratios per repetition."""
    rows: list[dict[str, object]] = []
    for name, metrics in plan:
        for metric in [
            *metrics,
            "server_cpu_us_per_unit",
            "nats_cpu_us_per_unit",
            "server_cpu_pct",
            "nats_cpu_pct",
            "client_cpu_pct",
        ]:
            row: dict[str, object] = {"scenario": name, "metric": metric}
            for kind in kinds:
                values = [
                    r[kind][name][metric] for r in reps if metric in r.get(kind, {}).get(name, {})
                ]
                if values:
                    row[kind] = {
                        "median": statistics.median(values),
                        "min": min(values),
                        "max": max(values),
                    }
            for other in ("sdk", "raw"):
                pairs = [
                    r["ours"][name][metric] / r[other][name][metric]
                    for r in reps
                    if metric in r.get("ours", {}).get(name, {})
                    and r.get(other, {}).get(name, {}).get(metric)
                ]
                if pairs:
                    row[f"ours/{other}"] = statistics.median(pairs)
            if len(row) > 2:
                rows.append(row)
    return rows


def table(rows: list[dict[str, object]], kinds: list[str]) -> str:
    """The summary as text: median [min-max] per server, then the ratios."""
    head = f"{'scenario':26} {'metric':22}" + "".join(f"{k:>24}" for k in kinds)
    head += f"{'ours/sdk':>10}{'ours/raw':>10}"
    lines = [head]
    for row in rows:
        cells = []
        for kind in kinds:
            cell = row.get(kind)
            if isinstance(cell, dict):
                cells.append(f"{_num(cell['median'])} [{_num(cell['min'])}-{_num(cell['max'])}]")
            else:
                cells.append("-")
        ratios = [row.get("ours/sdk"), row.get("ours/raw")]
        line = f"{row['scenario']!s:26} {row['metric']!s:22}" + "".join(f"{c:>24}" for c in cells)
        line += "".join(f"{r:>10.2f}" if isinstance(r, float) else f"{'-':>10}" for r in ratios)
        lines.append(line)
    return "\n".join(lines)


def settings() -> str:
    """What the servers ran with: ours with every default (the line says so)."""
    defaults = ServerConfig()
    shown = ", ".join(
        f"{name}={getattr(defaults, name)}"
        for name in ("log_max_frames", "log_max_bytes", "log_total_bytes", "resume_window")
    )
    return (
        f"ours, ours-nats: ServerConfig() and NatsConfig() defaults, nothing changed ({shown}); "
        "ours-v10, ours-nats-v10 (if run): the same but generation=False, idempotency_window=0; "
        "ours-unpaced (if run): the same but loop_slice=0; "
        "sdk: a2a-sdk defaults; every server on "
        + ("uvloop" if "--uvloop" in sys.argv else "asyncio unless its name ends in +uvloop")
    )


def _num(value: object) -> str:
    assert isinstance(value, float | int)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


async def main(args: argparse.Namespace) -> dict[str, object]:
    """Run every repetition, then the memory measurements."""
    kinds = args.servers.split(",")
    wanted = [name for name in args.only.split(",") if name]
    plan = [s for s in scenarios(args.seconds) if not wanted or any(w in s[0] for w in wanted)]
    reps: list[dict[str, dict[str, Result]]] = []
    mem: dict[str, dict[str, Result]] = {}
    with maybe_nats(any(k.startswith("ours-nats") for k in kinds)) as nats:
        for rep in range(args.reps):
            print(f"repetition {rep + 1}/{args.reps}", flush=True)
            reps.append(
                {
                    k: await run_kind(
                        k, plan, nats, args.uvloop, profile_path(args.profile, k, rep)
                    )
                    for k in kinds
                }
            )
        sizes = [int(s) for s in args.memory.split(",") if s]
        if sizes:
            print("memory", flush=True)
            for kind in kinds:
                mem[kind] = await memory(kind, sizes, nats, args.uvloop)
    rows = summarize(reps, [(n, m) for n, m, _ in plan], kinds)
    mem_plan = sorted({name for per in mem.values() for name in per})
    rows += summarize([mem], [(n, ["bytes_per_task"]) for n in mem_plan], kinds) if mem else []
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loop": "uvloop" if args.uvloop else "asyncio (per server: +uvloop)",
        },
        "params": vars(args) | {"json": str(args.json)},
        "summary": rows,
        "repetitions": reps,
        "memory": mem,
    }


def cli() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--servers", default="ours,ours-nats,sdk,raw")
    parser.add_argument("--seconds", type=float, default=2.0, help="per throughput scenario")
    parser.add_argument("--memory", default="1000,10000", help="parked-task counts ('' for none)")
    parser.add_argument("--uvloop", action="store_true", help="servers on uvloop")
    parser.add_argument(
        "--only", default="", help="the scenarios whose name contains one of these (commas)"
    )
    parser.add_argument(
        "--profile", default="", help="a directory: cProfile each server into <kind>-<rep>.prof"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "bench.json")
    args = parser.parse_args()
    report = asyncio.run(main(args))
    kinds = args.servers.split(",")
    summary = report["summary"]
    assert isinstance(summary, list)
    print()
    print(settings())
    print(table(summary, kinds))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    cli()

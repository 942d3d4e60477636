"""TaskLog on its own: numbering, cursors, the close order, and what is kept (with a fake clock)."""

from __future__ import annotations

import asyncio

import pytest
from a2a.types.a2a_pb2 import TaskState

from a2a_grpc_server._internal.errors import FrameNotKeptError, RelayLostError
from a2a_grpc_server._internal.log.tasklog import (
    ENTRY_OVERHEAD,
    TRIM_EVERY,
    LogClosedError,
    LogLimits,
    LogPool,
    LogReader,
    TaskLog,
)
from a2a_grpc_server._internal.model import taskops
from a2a_grpc_server._internal.obs.metrics import Metrics

S = TaskState
FINAL = S.TASK_STATE_COMPLETED


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool(
    *, frames: int = 100, nbytes: int = 1 << 20, total: int = 1 << 24, window: float = 60.0
) -> tuple[LogPool, FakeClock]:
    clock = FakeClock()
    return LogPool(total, LogLimits(frames, nbytes, window), Metrics(), clock), clock


async def drain(reader: LogReader) -> list[int]:
    return [seq async for seq, _, _ in reader]


async def test_frames_are_numbered_and_a_subscriber_starts_right_after_its_snapshot() -> None:
    p, _ = pool()
    log = TaskLog("t", p)
    log.snapshot = taskops.new_task("t", "c", None)
    assert log.subscribe()[1].next_seq == 1
    early = log.subscribe()[1]
    assert [log.append(b"a"), log.append(b"b")] == [1, 2]
    snapshot, late = log.subscribe()
    assert snapshot is not None and snapshot is not log.snapshot, "a copy"
    assert late.next_seq == 3
    log.append(b"", 0)  # a change without a frame takes a number, no reader gets it
    log.seal(b"end", FINAL)
    assert await drain(early) == [1, 2, 4]
    assert await drain(late) == [4]
    assert log.final_seq == 4


async def test_seal_appends_the_final_frame_then_runs_callbacks_then_readers_drain() -> None:
    p, _ = pool()
    log = TaskLog("t", p)
    reader = log.subscribe()[1]
    log.append(b"a")
    seen: list[int] = []
    log.on_close(lambda: seen.append(log.final_seq))
    log.seal(b"end", FINAL)
    log.seal(b"again", FINAL)  # idempotent
    assert seen == [2], "the final frame is in the log before the callbacks run"
    assert [(seq, frame) async for seq, frame, _ in reader] == [(1, b"a"), (2, b"end")]
    with pytest.raises(LogClosedError):
        log.append(b"late")
    with pytest.raises(LogClosedError):
        log.subscribe()
    assert p.metrics.final_frames == 1


@pytest.mark.parametrize("how", ["seal", "sever"])
async def test_a_raising_close_callback_neither_stops_the_others_nor_strands_a_reader(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    p, _ = pool()
    log = TaskLog("t", p, relayed=how == "sever")
    reader = log.subscribe()[1]
    waiting = asyncio.ensure_future(anext(reader))
    await asyncio.sleep(0)  # sync-ok: lets the reader reach its wait (it has nothing to read)
    ran: list[str] = []

    def faulty() -> None:
        ran.append("faulty")
        raise RuntimeError("callback bug")

    log.on_close(faulty)
    log.on_close(lambda: ran.append("next"))
    if how == "seal":
        log.seal(b"end", FINAL)
        assert (await asyncio.wait_for(waiting, 1))[:2] == (1, b"end")
        with pytest.raises(StopAsyncIteration):
            await anext(reader)
    else:
        log.sever(RelayLostError("gone"))
        with pytest.raises(RelayLostError):
            await asyncio.wait_for(waiting, 1)
    assert ran == ["faulty", "next"]
    assert log.closed
    assert "close callback" in caplog.text


async def test_a_waiting_reader_wakes_on_append_and_a_severed_log_drains_then_raises() -> None:
    p, _ = pool()
    log = TaskLog("t", p, relayed=True)
    reader = log.subscribe()[1]
    waiting = asyncio.ensure_future(anext(reader))
    await asyncio.sleep(0)  # sync-ok: lets the reader reach its wait (it has nothing to read)
    assert not waiting.done()
    log.append(b"a")
    assert (await waiting)[0] == 1
    log.append(b"b")
    log.sever(RelayLostError("gone"))
    assert (await anext(reader))[0] == 2
    with pytest.raises(RelayLostError):
        await anext(reader)


async def test_the_budget_drops_the_oldest_frames_and_a_reader_behind_it_is_told() -> None:
    p, _ = pool(frames=4)
    log = TaskLog("t", p)
    behind = log.subscribe()[1]
    for _ in range(9):
        log.append(b"x")
    log.seal(b"end", FINAL)
    assert (log.first_kept, log.last_seq, log.kept) == (7, 10, 4), "the final frame stays"
    with pytest.raises(FrameNotKeptError) as caught:
        await anext(behind)
    assert (caught.value.wanted, caught.value.first_kept, caught.value.last) == (1, 7, 10)
    assert p.metrics.frames_dropped == 6


async def test_the_byte_budget_counts_each_frame_with_its_overhead() -> None:
    p, _ = pool(nbytes=3 * (100 + ENTRY_OVERHEAD))
    log = TaskLog("t", p)
    log.subscribe()
    for _ in range(5):
        log.append(b"x" * 100)
    assert log.kept == 3
    assert log.kept_bytes == p.used == 3 * (100 + ENTRY_OVERHEAD)


async def test_frames_nobody_can_read_are_numbered_but_not_kept() -> None:
    p, _ = pool()
    log = TaskLog("t", p)
    for _ in range(3):
        log.append(b"x" * 100)
    assert (log.last_seq, log.kept, p.used) == (3, 0, 0)
    reader = log.subscribe()[1]
    for _ in range(TRIM_EVERY):
        log.append(b"y")
        assert (await anext(reader))[1] == b"y"
    log.append(b"z")
    assert log.kept <= 2, "what every reader has read is released"
    reader.close()
    assert (log.kept, p.used) == (0, 0)


async def test_a_resumable_log_keeps_frames_for_the_window_then_releases_them() -> None:
    p, clock = pool(window=60)
    log = TaskLog("t", p)
    log.make_resumable()
    log.append(b"a")
    clock.now += 30
    log.append(b"b")
    p._sweep()
    assert log.first_kept == 1, "both are in the window"
    clock.now += 40
    p._sweep()
    assert (log.first_kept, log.kept) == (2, 1), "the first left the window"
    log.seal(b"end", FINAL)
    assert p.retained("t") is log, "an ended resumable log stays readable"
    assert [s async for s, _, _ in log.reader(2)] == [2, 3]
    clock.now += 61
    p._sweep()
    assert p.retained("t") is None and p.used == 0
    p.close()


async def test_past_the_servers_budget_ended_logs_go_first_then_the_appenders_oldest() -> None:
    size = 100 + ENTRY_OVERHEAD
    p, _ = pool(total=5 * size)
    ended = TaskLog("ended", p)
    ended.make_resumable()
    for _ in range(2):
        ended.append(b"x" * 100)
    ended.seal(b"y" * 100, FINAL)
    live = TaskLog("live", p)
    live.subscribe()
    live.append(b"x" * 100)
    live.append(b"x" * 100)
    assert p.used == 5 * size and p.retained("ended") is ended
    live.append(b"x" * 100)
    assert p.retained("ended") is None and ended.kept == 0, "the ended log went first"
    for _ in range(4):
        live.append(b"x" * 100)
    assert p.used <= 5 * size and live.kept == 5
    assert p.peak <= 5 * size
    p.close()


async def test_readers_that_give_up_waiting_leave_nothing_behind() -> None:
    p, _ = pool()
    log = TaskLog("t", p)
    for _ in range(100):
        waiting = asyncio.ensure_future(log.wait_changed())
        await asyncio.sleep(0)  # sync-ok: lets it start waiting before it gives up
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert not log._waiters, "no future of a departed waiter is kept"


async def test_an_ended_log_is_not_released_under_a_reader_still_draining_it() -> None:
    size = 100 + ENTRY_OVERHEAD
    p, clock = pool(total=4 * size, window=60)
    ended = TaskLog("ended", p)
    ended.make_resumable()
    draining = ended.subscribe()[1]
    ended.append(b"x" * 100)
    ended.seal(b"y" * 100, FINAL)
    other = TaskLog("other", p)
    other.subscribe()
    for _ in range(3):
        other.append(b"z" * 100)  # over the server's budget: ended is read, so it stays
    clock.now += 61
    p._sweep()  # past its window: still read, so it stays
    assert [s async for s, _, _ in draining] == [1, 2], "the reader gets every frame"
    assert p.retained("ended") is None and ended.kept == 0, "released once it was read"
    p.close()

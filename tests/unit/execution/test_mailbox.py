"""Mailbox: bounded, FIFO, one reader, and no buffer held while it is empty."""

from __future__ import annotations

import asyncio

import pytest

from a2a_grpc_server._internal.execution.mailbox import Mailbox


async def test_items_come_out_in_order_and_a_drained_mailbox_holds_no_buffer() -> None:
    box: Mailbox[int] = Mailbox(10)
    for i in range(5):
        await box.put(i)
    assert [box.get_nowait() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert box.empty()
    assert box._items is None and box._putters is None


def test_reading_an_empty_mailbox_is_an_error() -> None:
    box: Mailbox[str] = Mailbox(1)
    with pytest.raises(IndexError):
        box.get_nowait()


async def test_a_full_mailbox_makes_putters_wait_in_order() -> None:
    box: Mailbox[int] = Mailbox(1)
    await box.put(0)
    second = asyncio.ensure_future(box.put(1))
    third = asyncio.ensure_future(box.put(2))
    await asyncio.sleep(0)  # sync-ok: both putters reach their wait
    assert not second.done() and not third.done()
    async with asyncio.timeout(1):
        assert box.get_nowait() == 0
        await second
        assert box.get_nowait() == 1
        await third
        assert box.get_nowait() == 2


async def test_a_cancelled_putter_leaves_its_place_to_the_next() -> None:
    box: Mailbox[int] = Mailbox(1)
    await box.put(0)
    cancelled = asyncio.ensure_future(box.put(1))
    waiting = asyncio.ensure_future(box.put(2))
    await asyncio.sleep(0)  # sync-ok: both putters reach their wait
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    async with asyncio.timeout(1):
        assert box.get_nowait() == 0
        await waiting
        assert box.get_nowait() == 2
    assert box.empty()


async def test_a_putter_woken_then_cancelled_passes_the_slot_on() -> None:
    box: Mailbox[int] = Mailbox(1)
    await box.put(0)
    first = asyncio.ensure_future(box.put(1))
    second = asyncio.ensure_future(box.put(2))
    await asyncio.sleep(0)  # sync-ok: both putters reach their wait
    assert box.get_nowait() == 0  # wakes `first`...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    async with asyncio.timeout(1):
        await second
        assert box.get_nowait() == 2


async def test_bytes_bound_the_mailbox_too_and_one_large_item_still_passes_alone() -> None:
    box: Mailbox[str] = Mailbox(100, max_bytes=10)
    await box.put("a", 6)
    blocked = asyncio.ensure_future(box.put("b", 6))
    await asyncio.sleep(0)  # sync-ok: the putter reaches its wait
    assert not blocked.done() and box.bytes == 6
    async with asyncio.timeout(1):
        assert box.get_nowait() == "a"
        await blocked
        assert box.bytes == 6
        assert box.get_nowait() == "b"
        await box.put("huge", 50)  # larger than the bound, but the box is empty
        assert box.bytes == 50
        assert box.get_nowait() == "huge"
    assert box.bytes == 0 and box._items is None

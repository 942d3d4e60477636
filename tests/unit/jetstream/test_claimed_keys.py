"""``jetstream.keys.Claimed``: the keys an instance claimed, bounded per caller."""

from __future__ import annotations

from a2a_grpc_server._internal.jetstream.keys import Claimed


def test_past_the_bound_the_greediest_callers_oldest_keys_go() -> None:
    now = [100.0]
    claimed = Claimed(window=60.0, most=3, clock=lambda: now[0])
    assert claimed.add("alice-1", "alice") == []
    assert claimed.add("bob-1", "bob") == []
    assert claimed.add("bob-2", "bob") == []
    assert claimed.add("bob-3", "bob") == ["bob-1"], "bob keeps the most: his oldest"
    assert claimed.add("carol-1", "carol") == ["bob-2"]
    assert claimed.add("alice-2", "alice") == ["alice-1"], "alice keeps the most now"
    assert len(claimed) == 3


def test_claims_past_the_window_and_released_ones_are_not_tracked() -> None:
    now = [100.0]
    claimed = Claimed(window=60.0, most=2, clock=lambda: now[0])
    claimed.add("bob-1", "bob")
    claimed.add("bob-2", "bob")
    claimed.discard("bob-2")
    assert claimed.add("bob-3", "bob") == [], "a released key made room"
    now[0] += 61  # the bucket forgot both: nothing to delete for them
    assert claimed.add("bob-4", "bob") == [] and len(claimed) == 1
    assert claimed.add("bob-4", "bob") == [] and len(claimed) == 1, "a key claimed again"

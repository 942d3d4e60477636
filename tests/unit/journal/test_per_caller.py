"""``journal.keys.PerCaller``: which caller keeps the most keys, without a scan."""

from __future__ import annotations

from a2a_grpc_server._internal.journal.keys import PerCaller


def test_the_oldest_key_of_the_caller_keeping_the_most_goes_first() -> None:
    per = PerCaller()
    for caller, key in [("alice", "a1"), ("bob", "b1"), ("bob", "b2"), ("alice", "a2")]:
        per.add(caller, key)
    per.add("bob", "b1")  # (held already: stays in its place, counts once)
    assert per.greediest_oldest() == "b1", "a tie: bob reached two first"
    per.add("alice", "a3")
    assert per.greediest_oldest() == "a1"
    for key in ("a1", "a2", "a3"):
        per.discard("alice", key)
    per.discard("alice", "a1")  # (not counted any more: nothing happens)
    assert per.greediest_oldest() == "b1"
    per.discard("bob", "b1")
    per.add("carol", "c1")
    assert per.greediest_oldest() == "b2", "bob and carol hold one each: bob came first"


def test_many_callers_at_the_bound_stay_consistent() -> None:
    per = PerCaller()
    kept: dict[str, list[str]] = {}
    for n in range(3_000):  # (bounded: 3,000 adds, one key each past the first 100)
        caller = f"c{n % 997}"
        per.add(caller, f"k{n}")
        kept.setdefault(caller, []).append(f"k{n}")
        if n >= 100:
            gone = per.greediest_oldest()
            owner = next(c for c, keys in kept.items() if keys and keys[0] == gone)
            assert len(kept[owner]) == max(len(keys) for keys in kept.values())
            per.discard(owner, gone)
            kept[owner].pop(0)
    assert sum(len(keys) for keys in kept.values()) == 100

"""RevList: an ordered index that agrees with a sorted list through any adds and removes."""

from __future__ import annotations

import random

import pytest

from a2a_grpc_server.journal.index import BLOCK, RevList


@pytest.mark.parametrize("seed", range(20))
def test_a_revlist_walks_like_a_sorted_list_through_random_adds_and_removes(seed: int) -> None:
    rng = random.Random(seed)
    revs, model, top = RevList(), list[int](), 0
    for _ in range(3 * BLOCK):
        if model and rng.random() < 0.45:
            gone = rng.choice(model)
            model.remove(gone)
            revs.remove(gone)
        else:
            top += rng.randint(1, 3)
            model.append(top)
            revs.add(top)
        assert len(revs) == len(model)
        bound = rng.choice([None, rng.randint(0, top + 2)])
        want = sorted((r for r in model if bound is None or r < bound), reverse=True)
        assert list(revs.below(bound)) == want


def test_a_revlist_refuses_a_revision_not_above_the_top_and_one_it_does_not_hold() -> None:
    revs = RevList()
    revs.add(5)
    with pytest.raises(ValueError, match="not above"):
        revs.add(5)
    with pytest.raises(KeyError):
        revs.remove(4)
    revs.remove(5)
    assert list(revs.below()) == [] and len(revs) == 0
    with pytest.raises(KeyError):
        revs.remove(5)

"""RevList: an ordered index that agrees with a sorted list through any adds and removes."""

from __future__ import annotations

import gc
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


@pytest.mark.parametrize("seed", range(10))
def test_a_revlist_of_one_or_two_revisions_walks_like_a_sorted_list(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        revs, model, top = RevList(), list[int](), rng.randint(0, 3)
        for _ in range(rng.randint(1, 6)):
            if model and (len(model) == 2 or rng.random() < 0.4):
                gone = rng.choice(model)
                model.remove(gone)
                revs.remove(gone)
            else:
                top += rng.randint(1, 3)
                model.append(top)
                revs.add(top)
            assert len(revs) == len(model)
            for bound in (None, *range(top + 2)):
                want = sorted((r for r in model if bound is None or r < bound), reverse=True)
                assert list(revs.below(bound)) == want
            if model:
                with pytest.raises(ValueError, match="not above"):
                    revs.add(model[-1])


def test_a_revlist_of_one_revision_holds_no_list() -> None:
    # (an index per context, kept as long as its tasks: each list is one more
    # object for the garbage collector's full passes)
    revs = RevList()
    revs.add(7)
    assert not [o for o in gc.get_referents(revs) if isinstance(o, list) and o]
    assert list(revs.below()) == [7] and list(revs.below(7)) == [] and list(revs.below(8)) == [7]
    revs.add(9)
    assert list(revs.below()) == [9, 7]
    revs.remove(7)
    assert list(revs.below()) == [9]
    with pytest.raises(KeyError):
        revs.remove(7)

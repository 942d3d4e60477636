"""RevList: an ordered index that agrees with a sorted list through any adds and removes."""

from __future__ import annotations

import random

import pytest

from a2a_grpc_server._internal.journal.index import BLOCK, RevList


def _step(rng: random.Random, revs: RevList, model: list[int], top: int, *, remove: bool) -> int:
    """Remove a random revision from both, or add one above ``top``; the new top."""
    if remove:
        gone = rng.choice(model)
        model.remove(gone)
        revs.remove(gone)
        return top
    top += rng.randint(1, 3)
    model.append(top)
    revs.add(top)
    return top


def _agrees(revs: RevList, model: list[int], bounds: list[int | None]) -> None:
    assert len(revs) == len(model)
    for bound in bounds:
        want = sorted((r for r in model if bound is None or r < bound), reverse=True)
        assert list(revs.below(bound)) == want


@pytest.mark.parametrize("seed", range(20))
def test_a_revlist_walks_like_a_sorted_list_through_random_adds_and_removes(seed: int) -> None:
    rng = random.Random(seed)
    revs, model, top = RevList(), list[int](), 0
    for _ in range(3 * BLOCK):
        top = _step(rng, revs, model, top, remove=bool(model) and rng.random() < 0.45)
        _agrees(revs, model, [rng.choice([None, rng.randint(0, top + 2)])])


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
            remove = bool(model) and (len(model) == 2 or rng.random() < 0.4)
            top = _step(rng, revs, model, top, remove=remove)
            _agrees(revs, model, [None, *range(top + 2)])
            if model:
                with pytest.raises(ValueError, match="not above"):
                    revs.add(model[-1])

"""How long a long-poll waits: short of the deadline gRPC reports by enough to answer."""

from __future__ import annotations

import pytest

from a2a_grpc_server._internal.model import generation


@pytest.mark.parametrize(
    ("deadline", "over_read"), [(1.0, 0.01), (5.0, 0.01), (10.0, 0.1), (20.0, 0.1), (100.0, 1.0)]
)
def test_a_poll_answers_well_before_a_deadline_grpc_read_long(
    deadline: float, over_read: float
) -> None:
    # gRPC's timeout header reads long by up to 1 % (measured: see ``MARGIN_SHARE``).
    waits = generation.wait_for(deadline + over_read)
    assert deadline - waits >= generation.MARGIN or waits == generation.MAX_WAIT


def test_each_poll_already_waiting_moves_the_answer_earlier() -> None:
    alone, behind = generation.wait_for(30.0), generation.wait_for(30.0, waiting=1000)
    assert alone - behind == pytest.approx(1000 * generation.MARGIN_PER_POLL)


def test_without_a_deadline_or_without_time_left() -> None:
    assert generation.wait_for(None) == generation.MAX_WAIT
    assert generation.wait_for(0.2) == 0.0, "less than the margin: answer at once"
    assert generation.wait_for(600.0) == generation.MAX_WAIT

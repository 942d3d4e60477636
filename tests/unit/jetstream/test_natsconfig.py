"""``NatsConfig`` refuses settings no cluster can run with, before anything connects."""

from __future__ import annotations

import pytest

from a2a_grpc_server._internal.jetstream.natsconfig import NatsConfig


def test_an_empty_instance_id_is_refused() -> None:
    """The empty id means nobody (a released task's owner): an instance named so would own
    tasks no sweep ever ends, and its control subjects would have an empty token."""
    with pytest.raises(ValueError, match="instance_id must not be empty"):
        NatsConfig(instance_id="")
    assert NatsConfig().instance_id, "a fresh id by default"


@pytest.mark.parametrize("instance_id", ["*", ">", "a.b", "two words", "tab\there"])
def test_an_instance_id_that_is_not_one_subject_token_is_refused(instance_id: str) -> None:
    """An id names this instance's control subjects (``a2a.ctl.<id>.<op>``): ``*`` would
    subscribe to every instance's routed requests, ``a.b`` to none of its own."""
    with pytest.raises(ValueError, match="one NATS subject token"):
        NatsConfig(instance_id=instance_id)


def test_routed_in_flight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="routed_in_flight must be positive"):
        NatsConfig(routed_in_flight=0)

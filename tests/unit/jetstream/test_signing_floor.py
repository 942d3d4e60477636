"""``jetstream.signing.Signer``'s floor: requests signed before the receiver started are
refused (a replay after a restart); answers are not held to it (a clock a little behind)."""

from __future__ import annotations

import time

import pytest

from a2a_grpc_server._internal.errors import UnsignedMessageError
from a2a_grpc_server._internal.jetstream.signing import SIGNATURE, Signer
from tests.support import CLUSTER_KEY


def test_an_answer_signed_before_the_receiver_started_is_taken_a_request_is_not() -> None:
    sender = Signer(CLUSTER_KEY)
    answer: dict[str, str] = {"A2a-Answers": "n1"}
    request: dict[str, str] = {}
    sender.sign("inbox", answer, b"done")
    sender.sign("a2a.ctl.x.send", request, b"go")
    stamps = [float(h[SIGNATURE].split(":")[1]) for h in (answer, request)]
    while time.time() <= max(stamps):  # (the receiver starts after both stamps: ms, rounded)
        pass
    receiver = Signer(CLUSTER_KEY)
    assert receiver.check("inbox", answer, b"done", answer=True)
    with pytest.raises(UnsignedMessageError, match="before this instance started"):
        receiver.check("a2a.ctl.x.send", request, b"go")
    with pytest.raises(UnsignedMessageError, match="twice"):
        receiver.check("inbox", answer, b"done", answer=True)

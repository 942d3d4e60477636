"""The NATS retry (``jetstream.retry``): which JetStream answers are tried again and which
refuse at once. A publish JetStream is still proposing ("duplicate message id is in
process") is an earlier attempt of the same write whose outcome is not known yet: tried
again, never a refusal."""

from __future__ import annotations

import nats.js.errors
import pytest

from a2a_grpc_server._internal.jetstream.retry import IN_FLIGHT, Retry
from a2a_grpc_server._internal.journal import StoreRefusedError, StoreUnavailableError


async def test_a_write_still_in_flight_is_tried_again_until_its_outcome_is_known() -> None:
    attempts = 0

    async def publish() -> int:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise nats.js.errors.APIError(
                code=409, err_code=IN_FLIGHT, description="duplicate message id is in process"
            )
        return 96  # (the first attempt's position, answered as a duplicate)

    assert await Retry(5.0)(publish, "record a change") == 96
    assert attempts == 3


async def test_any_other_refusal_is_final_at_once() -> None:
    attempts = 0

    async def publish() -> int:
        nonlocal attempts
        attempts += 1
        raise nats.js.errors.APIError(code=400, err_code=10060, description="expected stream")

    with pytest.raises(StoreRefusedError, match="expected stream"):
        await Retry(5.0)(publish, "record a change")
    assert attempts == 1


async def test_a_write_in_flight_past_the_budget_is_unavailable_not_refused() -> None:
    async def publish() -> int:
        raise nats.js.errors.APIError(code=409, err_code=IN_FLIGHT, description="in process")

    with pytest.raises(StoreUnavailableError, match=r"0\.3 s"):
        await Retry(0.3)(publish, "record a change")

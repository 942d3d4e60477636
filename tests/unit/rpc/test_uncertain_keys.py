"""Which routed errors leave a retry key *uncertain* (``rpc.idempotency.Claim.release``).

Only a wait that ran out may have let the owner act. A refusal as too late, by the asker
before it sends or by the owner before it acts, did nothing: the key goes, and a retry
runs at once (it was held MESSAGE_IN_PROGRESS for minutes, a review found).
"""

from __future__ import annotations

import time

from a2a.types.a2a_pb2 import Message, SendMessageRequest

from a2a_grpc_server._internal.cluster.routed import decode_error, encode_error
from a2a_grpc_server._internal.errors import OwnerTimeoutError, OwnerTooLateError
from a2a_grpc_server._internal.journal.keys import PENDING_FOR, KeyRecord, MemorySentKeys
from a2a_grpc_server._internal.model.caller import Caller
from a2a_grpc_server._internal.rpc.idempotency import URI, Claim, Retries


async def claimed() -> Claim:
    keys = MemorySentKeys(window=60.0, most=10)
    record = KeyRecord("d", "t-1")
    assert await keys.claim("k", record) is None
    return Claim(keys, "k", record)


async def test_the_owners_too_late_refusal_crosses_as_itself_and_lets_the_key_go() -> None:
    crossed = decode_error(*encode_error(OwnerTooLateError("too late to act")))
    assert isinstance(crossed, OwnerTooLateError) and not crossed.sent
    claim = await claimed()
    await claim.release(crossed, "t-1")
    assert await claim.keys.claim("k", KeyRecord("d")) is None, "released: a retry runs"


async def test_a_wait_that_ran_out_leaves_the_key_uncertain() -> None:
    timeout = OwnerTimeoutError("did not answer")
    timeout.asked, timeout.after, timeout.seen, timeout.until = "owner-1", 3, 2, 99.0
    claim = await claimed()
    await claim.release(timeout, "t-1")
    found = await claim.keys.claim("k", KeyRecord("d"))
    assert found is not None
    assert (found.asked, found.after, found.seen, found.until) == ("owner-1", 3, 2, 99.0)


async def test_an_abandoned_follow_up_is_answered_if_it_was_recorded() -> None:
    # Its claimer died after the owner recorded the message: taking the key over blindly
    # after PENDING_FOR ran the turn a second time (a review found).
    now = [time.time() - PENDING_FOR - 10]
    retries = Retries(MemorySentKeys(window=3600.0, most=10, clock=lambda: now[0]))
    call = Caller((("a2a-extensions", URI),))
    request = SendMessageRequest(message=Message(message_id="m-1", task_id="t-1"))
    claim, _ = await retries.admit(request, call)
    assert claim is not None, "the first request: its claimer dies before it settles"
    now[0] = time.time()

    async def recorded(prior: KeyRecord) -> bool:
        return True

    async def not_recorded(prior: KeyRecord) -> bool:
        return False

    again, prior = await retries.admit(request, call, recorded)
    assert again is None and prior is not None and prior.task_id == "t-1" and not prior.pending
    taken, _ = await retries.admit(request, call, not_recorded)
    assert taken is not None, "not recorded: the retry takes the key over and runs"

"""Which routed errors leave a retry key *uncertain* (``rpc.idempotency.Claim.release``).

Only a wait that ran out may have let the owner act. A refusal as too late, by the asker
before it sends or by the owner before it acts, did nothing: the key goes, and a retry
runs at once (it was held MESSAGE_IN_PROGRESS for minutes, a review found).
"""

from __future__ import annotations

from a2a_grpc_server.cluster.routed import decode_error, encode_error
from a2a_grpc_server.errors import OwnerTimeoutError, OwnerTooLateError
from a2a_grpc_server.journal.keys import KeyRecord, MemorySentKeys
from a2a_grpc_server.rpc.idempotency import Claim


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

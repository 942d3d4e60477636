"""Routed requests and their answers, signed with the key every instance of the cluster shares.

A routed request (``routing``) makes the owner act as the caller it names:
cancel a task, continue it, deliver a push config. Without a signature any
client of the NATS bus could publish one (``a2a.ctl.<owner>.cancel`` with
``A2a-Caller ["alice",""]``) and act as alice. So each request and each
answer carries ``A2a-Signature: 1:<unix time>:<nonce>:<HMAC-SHA256>`` over
its subject, its headers and its payload, keyed with the cluster's secret
(``NatsConfig.key_file``); a receiver refuses one that is unsigned, signed
with another key, older or newer than ``MAX_SKEW`` seconds (instances'
clocks must agree that closely), signed before this instance started, or
whose nonce it has seen (a replay).
Nonces are kept in memory only, so the start is what carries over a restart
under the same ``--instance-id``: nothing signed before this run started can
be meant for it (it subscribed after that), and what an earlier run received
was signed before its end. Nothing is persisted for it; it holds while
instances' clocks agree more closely than an instance takes to restart
(NTP: milliseconds, against a second or more). A peer's request signed within
that skew of this instance's start is refused too, unanswered (its asker
times out): the same condition keeps that from happening.
A request's signed headers name the subject its answer goes to
(``A2a-Reply-To``), so a replay cannot redirect the answer; an answer's name
the request it answers (``A2a-Answers``: the request's nonce), and the asker
reads its inbox until an answer signed for its request comes, so another
message there (a forged one, or one for another request) changes nothing.
An owner does not answer a request it refused: it never signs an answer for
a forger to use.

Unsigned messages are accepted only with ``NatsConfig.trust_bus`` (a bus
locked down by NATS accounts and permissions, or a rolling upgrade from a
version before signing); without a key and without ``trust_bus`` an
instance refuses to join. What this does not cover: the records, snapshots,
push configs and heartbeats in JetStream, which any client allowed to
write the ``A2A_*`` streams and buckets can change. Restrict those with NATS
permissions (see docs/how-to/secure-the-bus.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ..errors import UnsignedMessageError
from .natsconfig import NatsConfig

SIGNATURE = "A2a-Signature"
REPLY_TO = "A2a-Reply-To"
"""A request's signed header: where its answer goes."""
ANSWERS = "A2a-Answers"
"""An answer's signed header: the nonce of the request it answers."""
VERSION = "1"
MAX_SKEW = 30.0
"""Seconds a signed message is good for, either side of the receiver's clock."""
MIN_KEY_BYTES = 32
PLACEHOLDER = b"replace-me"
"""What the shipped manifest's key says until someone replaces it: refused."""
MAX_NONCES = 100_000
"""Nonces remembered (for ``2 * MAX_SKEW``); past this the oldest are let go first."""


def read_key(path: str) -> bytes:
    """The cluster key in the file ``path`` (surrounding blanks dropped).

    Raises:
        ValueError: It cannot be read, or is shorter than ``MIN_KEY_BYTES``.
    """
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cluster key file {path} cannot be read: {exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"cluster key file {path} holds {len(key)} bytes; a key is at least "
            f"{MIN_KEY_BYTES} (e.g. openssl rand -hex 32 > {path})"
        )
    if PLACEHOLDER in key.lower():
        raise ValueError(
            f"cluster key file {path} still holds the example's placeholder; put a secret "
            f"of your own there (openssl rand -hex 32 > {path})"
        )
    return key


def signer_for(config: NatsConfig) -> Signer:
    """The signer ``config`` asks for (its ``key`` or ``key_file``, and ``trust_bus``).

    Raises:
        ValueError: The key file cannot be read or is too short, or there is
            neither a key nor ``trust_bus``.
    """
    key = config.key
    if key is None and config.key_file:
        key = read_key(config.key_file)
    if key is not None and len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the cluster key is {len(key)} bytes; at least {MIN_KEY_BYTES}")
    return Signer(key, trust_bus=config.trust_bus)


class Signer:
    """Signs what this instance sends on the bus, and checks what it receives.

    Args:
        key: The cluster's shared key (None: nothing is signed).
        trust_bus: Accept unsigned messages (and, without a key, join at all).

    Raises:
        ValueError: Neither a key nor ``trust_bus``.
    """

    def __init__(self, key: bytes | None, *, trust_bus: bool = False) -> None:
        if key is None and not trust_bus:
            raise ValueError(
                "cluster mode needs the cluster's shared key (nats_key_file: the same secret "
                "file on every instance) so that a client of the NATS bus cannot act as an "
                "instance; or nats_trust_bus = true if NATS permissions already keep every "
                "other client off the a2a.ctl subjects (see docs/how-to/secure-the-bus.md)"
            )
        self._key, self._trust = key, trust_bus
        self._seen: OrderedDict[str, float] = OrderedDict()
        """Nonces received, with the time each was signed, oldest first."""
        self._floor = time.time()
        """Signed at or before this, refused: this run's start (it saw no nonce before),
        then, past ``MAX_NONCES``, the time of the newest nonce let go."""
        self._started = self._floor

    def derive(self, purpose: bytes) -> bytes:
        """A key for ``purpose`` every instance of the cluster derives alike.

        From the cluster key; without one (``trust_bus``), from a constant: a
        key bound to its use, but not a secret.
        """
        key = self._key if self._key is not None else b"a2a-grpc-server: no cluster key"
        return hmac.new(key, b"a2a-grpc-server derive\0" + purpose, hashlib.sha256).digest()

    @property
    def signing(self) -> bool:
        """Whether this instance signs (it holds the cluster key)."""
        return self._key is not None

    def sign(self, subject: str, headers: MutableMapping[str, str], payload: bytes) -> str:
        """Add the signature header to ``headers`` (nothing without a key).

        Returns:
            Its nonce ("" without a key): what the answer to it names.
        """
        if self._key is None:
            return ""
        stamp, nonce = f"{time.time():.3f}", secrets.token_hex(12)
        mac = self._mac(subject, stamp, nonce, headers, payload)
        headers[SIGNATURE] = f"{VERSION}:{stamp}:{nonce}:{mac}"
        return nonce

    def check(
        self, subject: str, headers: Mapping[str, str], payload: bytes, *, answer: bool = False
    ) -> str:
        """Accept a message received on ``subject``, or refuse it.

        An ``answer`` (to a request of this process's) is not held to the
        floor (signed after this process started, or after the oldest nonce it
        let go): its asker takes only the answer naming its own request's nonce,
        so an older one cannot be meant for it, and a clock a little behind
        this one must not make a real answer look like a timeout.

        Returns:
            Its nonce ("" if it is unsigned and the bus is trusted).

        Raises:
            UnsignedMessageError: Unsigned (without ``trust_bus``), badly
                signed, out of its time window, or seen before.
        """
        signature = headers.get(SIGNATURE)
        if signature is None:
            if self._trust:
                return ""
            raise UnsignedMessageError("a routed message without the cluster's signature")
        if self._key is None:
            return ""  # (trusting the bus, without a key to check it with)
        version, _, rest = signature.partition(":")
        stamp, _, rest = rest.partition(":")
        nonce, _, mac = rest.partition(":")
        try:
            sent = float(stamp)
        except ValueError:
            sent = float("nan")
        if version != VERSION or not nonce or not mac:
            raise UnsignedMessageError(f"a routed message signed in an unknown way ({version!r})")
        now = time.time()
        if not abs(now - sent) <= MAX_SKEW:
            raise UnsignedMessageError(
                "a routed message signed outside its time window (a replay, or clocks "
                f"more than {MAX_SKEW:.0f} s apart)"
            )
        if sent <= self._floor and not answer:
            why = (
                "this instance started"
                if self._floor == self._started
                else "the oldest nonce it remembers"
            )
            raise UnsignedMessageError(
                f"a routed message signed before {why} (a replay, or a clock behind this one)"
            )
        unsigned = {k: v for k, v in headers.items() if k != SIGNATURE}
        expected = self._mac(subject, stamp, nonce, unsigned, payload)
        if not hmac.compare_digest(mac.encode(errors="replace"), expected.encode()):
            raise UnsignedMessageError("a routed message not signed with the cluster's key")
        self._remember(nonce, sent, now)
        return nonce

    def _remember(self, nonce: str, sent: float, now: float) -> None:
        seen = self._seen
        if nonce in seen:
            raise UnsignedMessageError("a routed message received twice (a replay)")
        while seen:
            oldest = next(iter(seen.values()))
            if oldest < now - 2 * MAX_SKEW:
                seen.popitem(last=False)  # out of every window: nothing to remember
            elif len(seen) >= MAX_NONCES:
                seen.popitem(last=False)
                self._floor = max(self._floor, oldest)  # (older ones are refused from now on)
            else:
                break
        seen[nonce] = sent

    def _mac(
        self, subject: str, stamp: str, nonce: str, headers: Mapping[str, str], payload: bytes
    ) -> str:
        assert self._key is not None
        signed = {k: v for k, v in headers.items() if k != SIGNATURE}
        head = json.dumps([VERSION, subject, stamp, nonce, sorted(signed.items())])
        return hmac.new(self._key, head.encode() + b"\n" + payload, hashlib.sha256).hexdigest()

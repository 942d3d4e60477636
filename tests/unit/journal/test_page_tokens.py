"""Page tokens: sealed with AES-GCM under a key named by its id, bound to the journal kind
and the caller's scope; a token under an older key opens while that key is configured; a
changed token, another scope's, an unknown key's or an unknown version's is refused."""

from __future__ import annotations

import base64
import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from a2a_grpc_server._internal.journal import InvalidPageTokenError, PageTokens

OLD, NEW = os.urandom(32), os.urandom(32)


def raw(token: str) -> bytearray:
    return bytearray(base64.urlsafe_b64decode(token))


def text(data: bytes | bytearray) -> str:
    return base64.urlsafe_b64encode(bytes(data)).decode()


def test_a_token_opens_for_its_scope_and_kind_on_every_instance_with_the_key() -> None:
    token = PageTokens(NEW).encode(12345, "r", "alice")
    assert PageTokens(NEW).decode(token, "r", "alice") == 12345
    assert token != PageTokens(NEW).encode(12345, "r", "alice"), "a fresh nonce each time"
    for mark, scope in (("r", "bob"), ("r", ""), ("n", "alice"), ("r", "alice\0")):
        with pytest.raises(InvalidPageTokenError, match="not issued by this server"):
            PageTokens(NEW).decode(token, mark, scope)


def test_the_token_is_aes_gcm_under_the_key_its_id_names() -> None:
    tokens = PageTokens(NEW)
    data = raw(tokens.encode(7, "r", "alice"))
    version, key_id, nonce, sealed = data[0], data[1], bytes(data[2:14]), bytes(data[14:])
    assert version == PageTokens.VERSION == 2
    assert key_id == PageTokens.key_id(NEW)
    assert len(nonce) == 12 and len(sealed) == 8 + 16
    opened = AESGCM(NEW).decrypt(nonce, sealed, PageTokens.bound(bytes(data[:2]), "r", "alice"))
    assert int.from_bytes(opened, "big") == 7
    assert PageTokens.key_id(NEW) == PageTokens.key_id(bytes(NEW)), "every instance agrees"


def test_every_changed_byte_is_refused() -> None:
    token = PageTokens(NEW).encode(99, "r", "alice")
    data = raw(token)
    for i in range(len(data)):
        changed = bytearray(data)
        changed[i] ^= 0x01
        with pytest.raises(InvalidPageTokenError):
            PageTokens(NEW).decode(text(changed), "r", "alice")
    for cut in (data[:-1], data + b"\0", b"", data[:2]):
        with pytest.raises(InvalidPageTokenError):
            PageTokens(NEW).decode(text(cut), "r", "alice")


def test_a_token_under_an_older_key_opens_while_that_key_is_configured() -> None:
    before = PageTokens(OLD).encode(41, "r", "alice")
    rotated = PageTokens(NEW, previous=[OLD])
    assert rotated.decode(before, "r", "alice") == 41
    after = rotated.encode(42, "r", "alice")
    assert raw(after)[1] == PageTokens.key_id(NEW), "new tokens: the current key"
    assert PageTokens(NEW).decode(after, "r", "alice") == 42
    with pytest.raises(InvalidPageTokenError, match="key this server no longer holds"):
        PageTokens(NEW).decode(before, "r", "alice")  # the old key let go


def test_keys_whose_ids_collide_are_each_tried() -> None:
    keys = [os.urandom(32) for _ in range(4000)]  # (none colliding: p < 1e-6)
    first = next(k for k in keys[1:] if PageTokens.key_id(k) == PageTokens.key_id(keys[0]))
    token = PageTokens(keys[0]).encode(5, "r", "alice")
    assert PageTokens(first, previous=[keys[0]]).decode(token, "r", "alice") == 5


def test_a_token_of_an_unknown_version_is_refused() -> None:
    data = raw(PageTokens(NEW).encode(3, "r", "alice"))
    for version in (0, 1, 3, 255):
        data[0] = version
        with pytest.raises(InvalidPageTokenError, match="not issued by this server"):
            PageTokens(NEW).decode(text(data), "r", "alice")


def test_a_key_that_is_not_256_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        PageTokens(b"short")
    with pytest.raises(ValueError, match="32 bytes"):
        PageTokens(NEW, previous=[b"short"])

"""NATS URLs are logged and put in errors without the credentials they may carry."""

from __future__ import annotations

import pytest

from a2a_grpc_server._internal.jetstream.conn import _why_not
from a2a_grpc_server._internal.jetstream.natsconfig import NatsConfig, without_userinfo


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://alice:s3cretpw@127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("tls://tok3nvalue@[::1]:4222", "tls://[::1]:4222"),
        ("nats://u:a://b@h:1", "nats://h:1"),
        ("127.0.0.1:4222", "127.0.0.1:4222"),
        ("user:pw@127.0.0.1", "127.0.0.1"),
    ],
)
def test_a_url_is_shown_without_its_credentials(url: str, shown: str) -> None:
    assert without_userinfo(url) == shown


@pytest.mark.parametrize(
    "error",
    [
        OSError("Connection refused"),
        PermissionError("nats: 'Authorization Violation'"),
        OSError("[SSL: CERTIFICATE_VERIFY_FAILED]"),
    ],
)
def test_why_a_first_connect_failed_names_no_password_or_token(error: Exception) -> None:
    config = NatsConfig(
        servers=["nats://alice:s3cretpw@127.0.0.1:1", "nats://tok3nvalue@127.0.0.1:2"]
    )
    said = _why_not(config, [error])
    assert "s3cretpw" not in said and "tok3nvalue" not in said and "alice" not in said
    assert "127.0.0.1:1" in said and "127.0.0.1:2" in said

"""What a new user meets before anything runs: messages that name a setting the way it was
typed (flag, variable or key), a warning for a card that would advertise ``localhost``, one
for an agent without a card, the max_payload note at its right level, and a plain ``--help``."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from a2a_grpc_server import A2AService, ServerConfig
from a2a_grpc_server._internal.app import cli, settings
from a2a_grpc_server._internal.app.cli import (
    AgentLoadError,
    build_parser,
    load_agent,
    prepare,
    resolve,
)
from a2a_grpc_server._internal.app.settings import SettingError, spell_settings, spelled
from a2a_grpc_server.agents.echo import EchoAgent
from tests.support import cluster_key_file
from tests.support.fakecluster import FakeCluster, FakeHub


def values(*argv: str) -> dict[str, tuple[Any, str]]:
    """The settings ``serve argv`` resolves to (no environment, no file)."""
    return resolve(build_parser().parse_args(["serve", *argv]), {})


def refused(*argv: str) -> str:
    """What ``serve argv`` is refused with, before anything is bound."""
    with pytest.raises((SettingError, AgentLoadError)) as caught:
        prepare(values(*argv))
    return str(caught.value)


def test_a_setting_is_spelled_as_its_flag_its_variable_and_its_key() -> None:
    assert spelled("tls_cert") == "--tls-cert / A2A_GRPC_SERVER_TLS_CERT (tls_cert)"
    assert spelled("nats") == "--nats / A2A_GRPC_SERVER_NATS (nats)"
    assert spelled("lease", 0.0) == "--lease / A2A_GRPC_SERVER_LEASE (lease = 0.0)"
    for s in settings.SETTINGS:
        assert spelled(s.name) == f"{s.flags[0]} / {s.env} ({s.name})"


def test_a_message_from_below_gets_its_settings_spelled_once_each() -> None:
    said = spell_settings("max_message_bytes (9) must be at most half of max_task_bytes (10)")
    assert said == (
        "--max-message-bytes / A2A_GRPC_SERVER_MAX_MESSAGE_BYTES (max_message_bytes = 9) "
        "must be at most half of --max-task-bytes / A2A_GRPC_SERVER_MAX_TASK_BYTES "
        "(max_task_bytes = 10)"
    )
    # Plain words that are also settings' names stay words; spelled text is not respelled.
    assert spell_settings("push and host") == "push and host"
    assert spell_settings(spelled("tls_cert")) == spelled("tls_cert")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--cancel-timeout", "0"], ["cancel_timeout"]),
        (["--max-message-bytes", "4000000"], ["max_message_bytes", "max_task_bytes"]),
        (["--tls-cert", "/nonexistent"], ["tls_cert", "tls_key"]),
        (["--tls-cert", "/nonexistent", "--tls-key", "/nonexistent"], ["tls_cert"]),
        (["--auth-mtls"], ["auth_mtls", "tls_client_ca"]),
        (["--auth-mtls", "--auth-trusted-header", "x-p"], ["auth_mtls", "auth_jwt_jwks"]),
        (["--auth-tokens", "/nonexistent"], ["auth_tokens"]),
        (["--extended-card", "/nonexistent"], ["extended_card", "auth_tokens"]),
        (["--advertise", "0.0.0.0:50051"], ["advertise"]),
        (["--nats", "nats://127.0.0.1:1"], ["nats_key_file", "nats_trust_bus"]),
        (["--nats", "nats://127.0.0.1:1", "--nats-key-file", "/nonexistent"], ["nats_key_file"]),
        (["--nats", "nats://127.0.0.1:1", "--nats-trust-bus", "--lease", "0"], ["lease"]),
        (["--nats", "nats://127.0.0.1:1", "--nats-trust-bus", "--nats-user", "u"], ["nats_user"]),
        (
            ["--nats", "nats://127.0.0.1:1", "--nats-trust-bus", "--nats-creds-file", "/nope"],
            ["nats_creds_file"],
        ),
        (
            ["--nats", "nats://127.0.0.1:1", "--nats-trust-bus", "--nats-routed-in-flight", "0"],
            ["nats_routed_in_flight"],
        ),
    ],
)
def test_a_refusal_names_the_flag_and_the_variable_beside_the_key(
    argv: list[str], names: list[str]
) -> None:
    said = refused(*argv)
    for name in names:
        s = settings.BY_NAME[name]
        assert f"{s.flags[0]} / {s.env} ({name}" in said, said


def test_a_wildcard_bind_warns_when_the_card_would_advertise_a_loopback_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # (socket.getfqdn is the machine's answer; set it, to see each answer's outcome here)
    for name, warned in (
        ("localhost", True),
        ("localhost.localdomain", True),
        ("127.0.0.1", True),
        ("a2a-0.a2a.default.svc.cluster.local", False),
    ):
        monkeypatch.setattr(socket, "getfqdn", lambda name=name: name)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="a2a_grpc_server"):
            prepare(values("--host", "0.0.0.0"))
            prepare(values("--host", "0.0.0.0", "--advertise", "a2a:50051"))
            prepare(values("--host", "127.0.0.1"))
        said = [r.getMessage() for r in caplog.records if "--advertise" in r.getMessage()]
        assert len(said) == (1 if warned else 0), (name, said)
        if warned:
            assert f"clients {name}," in said[0]
            assert said[0].startswith("--host / A2A_GRPC_SERVER_HOST (host = 0.0.0.0) binds")
            assert "A2A_GRPC_SERVER_ADVERTISE" in said[0]


def test_a_module_without_agent_card_is_served_with_a_warning_saying_how_to_add_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="a2a_grpc_server"):
        _, card = load_agent("tests.support.agents:instance")
    assert card is None
    [warning] = [r for r in caplog.records if "agent_card" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert "generic card" in warning.getMessage()
    assert "define agent_card" in warning.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="a2a_grpc_server"):
        _, card = load_agent("a2a_grpc_server.agents.echo:EchoAgent")
    assert card is not None and card.name == "Echo"
    assert not caplog.records, "a module with a card: nothing to say"


def test_an_agent_card_that_is_not_a_card_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "dict_card_agent.py").write_text(
        "from a2a_grpc_server.agents.echo import EchoAgent\nagent_card = {'name': 'mine'}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(AgentLoadError, match="agent_card is a dict, not an AgentCard"):
            load_agent("dict_card_agent:EchoAgent")
    finally:
        sys.modules.pop("dict_card_agent", None)


def test_the_help_is_plain_text() -> None:
    shown = build_parser().format_help()
    assert "``" not in shown
    assert cli.DESCRIPTION in shown


class SmallMessages(FakeCluster):
    """A cluster whose NATS servers carry messages of nats-server's default max_payload."""

    @property
    def max_record_bytes(self) -> int | None:
        return 1024 * 1024 - 64 * 1024


@pytest.mark.parametrize(
    ("config", "level"),
    [
        (ServerConfig(), logging.INFO),
        (ServerConfig(max_task_bytes=2_000_000, max_message_bytes=1_000_000), logging.WARNING),
    ],
)
def test_sizes_lowered_to_nats_max_payload_are_info_at_the_defaults_and_a_warning_when_set(
    config: ServerConfig, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="a2a_grpc_server"):
        service = A2AService(EchoAgent(), config=config, cluster=SmallMessages(FakeHub(), "a"))
    assert service.config.max_task_bytes == 1024 * 1024 - 64 * 1024
    [said] = [r for r in caplog.records if "max_payload" in r.getMessage()]
    assert said.levelno == level
    assert "raise max_payload in the nats-server configuration" in said.getMessage()


def test_the_cluster_key_check_comes_before_any_connection() -> None:
    ok = values("--nats", "nats://127.0.0.1:1", "--nats-key-file", str(cluster_key_file()))
    assert settings.nats_config(ok) is not None  # (nothing is reached at this stage)

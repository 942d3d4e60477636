"""Every setting from a flag, the environment or a TOML file, in that order of precedence;
``check-config`` prints the effective configuration or names the bad value; the table of
docs/reference/configuration.md is the declaration's."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.app import settings
from a2a_grpc_server._internal.app.cli import build_parser, resolve
from a2a_grpc_server._internal.app.settings import SETTINGS, SettingError
from tests.support import ROOT

# (setting, flag value, env value, file value, parsed flag, parsed env, parsed file)
CASES: list[tuple[str, str, str, Any, Any, Any, Any]] = [
    ("cancel_timeout", "7", "6", 5, 7.0, 6.0, 5.0),
    ("quota_streams", "70", "60", 50, 70, 60, 50),
    ("push_allow_private", "", "true", False, True, True, False),
    ("push_allow_hosts", "a.x,b.x", "c.x", ["d.x"], ["a.x", "b.x"], ["c.x"], ["d.x"]),
    ("log_level", "debug", "warning", "ERROR", "DEBUG", "WARNING", "ERROR"),
    ("nats", "nats://h1", "nats://h2", ["nats://h3"], ["nats://h1"], ["nats://h2"], ["nats://h3"]),
    ("nats_retry_for", "9", "8", 7.5, 9.0, 8.0, 7.5),
]


CHECK = [sys.executable, "-m", "a2a_grpc_server.cli", "check-config"]
CHOSEN = [
    *("--quota-streams", "5", "--push-allow-hosts", "a.x,b.x"),
    *("--nats", "nats://h:4222", "--nats-trust-bus"),
]


def effective(argv: list[str], env: dict[str, str]) -> dict[str, tuple[Any, str]]:
    return resolve(build_parser().parse_args(["check-config", *argv]), env)


def check_config(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``a2a-grpc-server check-config`` run as a user runs it (bounded at 30 s)."""
    return subprocess.run(
        [*CHECK, *argv],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(("name", "flag", "env", "file", "by_flag", "by_env", "by_file"), CASES)
def test_a_flag_beats_the_environment_which_beats_the_file(
    tmp_path: Path,
    name: str,
    flag: str,
    env: str,
    file: Any,
    by_flag: Any,
    by_env: Any,
    by_file: Any,
) -> None:
    setting = settings.BY_NAME[name]
    config = tmp_path / "a2a.toml"
    config.write_text(f"{name} = {settings._toml(file)}\n")
    argv = [setting.flags[0], *([flag] if flag else [])]
    environ = {setting.env: env}
    with_file = ["--config", str(config)]
    assert effective([*argv, *with_file], environ)[name] == (by_flag, f"flag {setting.flags[0]}")
    assert effective(with_file, environ)[name] == (by_env, f"env {setting.env}")
    assert effective(with_file, {})[name] == (by_file, f"file {config}")
    assert effective([], {})[name] == (setting.default, "default")
    # The file can also come from the environment.
    assert effective([], {settings.CONFIG_ENV: str(config)})[name][0] == by_file


def test_every_setting_has_a_flag_a_variable_and_a_description() -> None:
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    flags = [f for s in SETTINGS for f in s.flags]
    assert len(flags) == len(set(flags))
    assert all(s.help for s in SETTINGS), [s.name for s in SETTINGS if not s.help]
    fields = {s.field for s in SETTINGS if s.group == "server"}
    assert fields == set(ServerConfig.__dataclass_fields__)


@pytest.mark.parametrize(
    ("argv", "env", "file", "says"),
    [
        (
            [],
            {"A2A_GRPC_SERVER_CANCEL_TIMEOUT": "soon"},
            "",
            "A2A_GRPC_SERVER_CANCEL_TIMEOUT='soon'",
        ),
        ([], {"A2A_GRPC_SERVER_PUSH": "maybe"}, "", "expected true or false"),
        ([], {}, 'quota_streams = "many"', "quota_streams = 'many': not an integer"),
        (
            [],
            {},
            "cancel_timout = 3",
            "cancel_timout (did you mean cancel_timeout?) is not a setting",
        ),  # a typo is not ignored
        ([], {}, "log_format = 'xml'", "choose one of text, json"),
        ([], {}, "port = ", "not TOML"),
        (["--cancel-timeout", "0"], {}, "", "(cancel_timeout) must be positive"),
        (["--max-message-bytes", "4000000"], {}, "", "at most half of --max-task-bytes"),
        (["--nats", "nats://127.0.0.1:1", "--lease", "0"], {}, "", "(lease = 0.0): must be > 0"),
        # Combinations and files: the checks serve makes before it starts.
        (["--auth-mtls", "--auth-trusted-header", "x-p"], {}, "", "choose one of"),
        (["--extended-card", "/nonexistent"], {}, "", "is for authenticated callers"),
        (["--tls-cert", "/nonexistent"], {}, "", "(tls_cert) and --tls-key / "),
        (["--agent", "no_such_module:Agent"], {}, "", "cannot import 'no_such_module'"),
        (
            [],
            {"A2A_GRPC_SERVER_CANCEL_TIMOUT": "3"},
            "",
            "A2A_GRPC_SERVER_CANCEL_TIMOUT (did you mean A2A_GRPC_SERVER_CANCEL_TIMEOUT?) "
            "is not a setting",
        ),
    ],
)
def test_check_config_names_the_bad_value(
    tmp_path: Path, argv: list[str], env: dict[str, str], file: str, says: str
) -> None:
    config = tmp_path / "a2a.toml"
    config.write_text(file)
    done = check_config(["--config", str(config), *argv], env)
    assert done.returncode == 2, done.stdout
    assert says in done.stderr, done.stderr


def test_check_config_prints_a_file_that_reads_back_the_same(tmp_path: Path) -> None:
    done = check_config(CHOSEN, {"A2A_GRPC_SERVER_LEASE": "12.5"})
    assert done.returncode == 0, done.stderr
    printed = tomllib.loads(done.stdout)
    assert (printed["quota_streams"], printed["lease"]) == (5, 12.5)
    assert "quota_streams = 5  # flag --quota-streams" in done.stdout
    assert "lease = 12.5  # env A2A_GRPC_SERVER_LEASE" in done.stdout
    config = tmp_path / "printed.toml"
    config.write_text(done.stdout)
    again = effective(["--config", str(config)], {})
    flags = effective([*CHOSEN, "--lease", "12.5"], {})
    assert {k: v for k, (v, _) in again.items()} == {k: v for k, (v, _) in flags.items()}


def test_the_configuration_page_table_is_the_declaration() -> None:
    readme = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    begin, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    table = readme[readme.index(begin) + len(begin) : readme.index(end)]
    assert table.strip() == settings.markdown().strip(), (
        "docs/reference/configuration.md's settings table is stale: run scripts/settings_table"
    )


def test_a_setting_error_is_a_value_error() -> None:
    assert issubclass(SettingError, ValueError)  # (main reports both as a usage error)


@pytest.mark.parametrize(
    ("argv", "env", "file"),
    [
        (["--no-nats-coalesce-writes"], {}, ""),
        (["--nats-coalesce-writes"], {}, ""),
        ([], {"A2A_GRPC_SERVER_NATS_COALESCE_WRITES": "false"}, ""),
        ([], {}, "nats_coalesce_writes = false"),
    ],
)
def test_a_retired_setting_still_starts_with_a_warning(
    tmp_path: Path, argv: list[str], env: dict[str, str], file: str
) -> None:
    # A configuration written for an older version keeps starting: the setting does
    # nothing, and the log says so and how to stop it saying so.
    config = tmp_path / "a2a.toml"
    config.write_text(file)
    done = check_config(["--config", str(config), *CHOSEN, *argv], env)
    assert done.returncode == 0, done.stderr
    assert "(nats_coalesce_writes), given by " in done.stderr, done.stderr
    assert "does nothing now: Retired:" in done.stderr
    assert "Remove it from the configuration" in done.stderr
    assert "coalesce" not in done.stdout  # (the effective configuration does not name it)


def test_a_retired_setting_not_given_says_nothing() -> None:
    done = check_config(CHOSEN, {})
    assert done.returncode == 0, done.stderr
    assert "does nothing now" not in done.stderr, done.stderr

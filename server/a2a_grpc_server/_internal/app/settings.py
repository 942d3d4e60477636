"""Every setting of ``serve``, declared once: from flags, the environment, or a TOML file.

``SETTINGS`` is the one declaration. ``ServerConfig``'s fields and
``NatsConfig``'s are read from the dataclasses (type, default, and the
description in their docstrings); the settings of the process itself
(addresses, TLS, authentication, logging) are listed in ``SERVE``. From each
setting come its flag (``--cancel-timeout``), its environment variable
(``A2A_GRPC_SERVER_CANCEL_TIMEOUT``), its key in the TOML file
(``cancel_timeout``) and its row in the table of docs/reference/configuration.md (``markdown()``).

Precedence: a flag, else the environment, else the file (``--config FILE``
or ``A2A_GRPC_SERVER_CONFIG``), else the default. A value that does not
parse, and a key the file should not have, raise ``SettingError`` naming
the setting and where the value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ServerConfig
from ..jetstream.natsconfig import MAX_EVENT_STREAMS, NatsConfig
from ..jetstream.signing import signer_for

ENV_PREFIX = "A2A_GRPC_SERVER_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
Kind = type  # int, float, bool, str, or list (of str)
_ENTRY = re.compile(r"^ {4}(\w+): (.*)$")


class SettingError(ValueError):
    """A value that cannot be used, saying which setting and where it came from."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting.

    Attributes:
        name: Its name: the TOML key, and (upper-cased, prefixed) its
            environment variable.
        kind: ``int``, ``float``, ``bool``, ``str`` or ``list`` (of strings;
            comma-separated in a flag or variable).
        default: Its value when nothing sets it (None: not set).
        help: What it does.
        group: ``serve`` (the process), ``server`` (``ServerConfig``),
            ``cluster`` (``NatsConfig``) or ``retired`` (does nothing: ``RETIRED``).
        flags: Its flags; the first is the one documented.
        field: The dataclass field it sets ("" for ``serve`` settings).
        choices: The values it may take (empty: any).
        metavar: How the flag's value is shown.
        bounds: The least and most an int setting may be (None: any).
    """

    name: str
    kind: Kind
    default: Any
    help: str
    group: str
    flags: tuple[str, ...]
    field: str = ""
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    bounds: tuple[int, int] | None = None
    """The least and most an int setting may be (None: any)."""

    @property
    def env(self) -> str:
        """Its environment variable."""
        return ENV_PREFIX + self.name.upper()


def _serve(
    name: str,
    kind: Kind,
    default: Any,
    text: str,
    *,
    flag: str = "",
    choices: tuple[str, ...] = (),
    metavar: str | None = None,
    bounds: tuple[int, int] | None = None,
) -> Setting:
    return Setting(
        name,
        kind,
        default,
        text,
        "serve",
        (flag or "--" + name.replace("_", "-"),),
        choices=choices,
        metavar=metavar,
        bounds=bounds,
    )


PORT = (0, 65535)
"""A port: 1 to 65535, or 0 for any free one."""


SERVE = (
    _serve(
        "agent",
        str,
        "a2a_grpc_server.agents.echo:EchoAgent",
        "module:attr of the AgentExecutor (an instance, a subclass or a factory); the "
        "module may define agent_card",
        metavar="MODULE:ATTR",
    ),
    _serve("host", str, "127.0.0.1", "address both ports bind"),
    _serve("port", int, 50051, "gRPC port (0: any free port)", bounds=PORT),
    _serve(
        "http_port", int, 8080, "agent card and metrics HTTP port (0: any free port)", bounds=PORT
    ),
    _serve(
        "advertise",
        str,
        None,
        "the gRPC address clients should use, HOST:PORT, put in the agent card (default: "
        "the bind address; when that is a wildcard such as 0.0.0.0, this host's name and "
        "the port)",
        metavar="HOST:PORT",
    ),
    _serve(
        "loop",
        str,
        "auto",
        "event loop; auto: uvloop if installed (a dependency on Linux and macOS), else asyncio",
        choices=("auto", "asyncio", "uvloop"),
    ),
    _serve("log_level", str, "INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    _serve(
        "log_format",
        str,
        "text",
        "text, or json: one object per line with time, level, message, and task id, "
        "context id, principal, instance and trace id when known",
        choices=("text", "json"),
    ),
    _serve(
        "tls_cert",
        str,
        None,
        "serve TLS on both ports with this certificate chain (re-read when it changes)",
        metavar="PEM",
    ),
    _serve("tls_key", str, None, "the certificate's private key", metavar="PEM"),
    _serve(
        "tls_client_ca",
        str,
        None,
        "require client certificates signed by these CAs (mTLS)",
        metavar="PEM",
    ),
    _serve(
        "auth_tokens",
        str,
        None,
        "require bearer tokens: one 'principal:token' per line (# comments); re-read "
        "when it changes",
        metavar="FILE",
    ),
    _serve(
        "auth_mtls",
        bool,
        False,
        "the caller is its client certificate's SPIFFE ID or common name (needs tls_client_ca)",
    ),
    _serve(
        "auth_trusted_header",
        str,
        None,
        "the caller is this header's value, set by a proxy that authenticated it; only "
        "behind that proxy",
        metavar="NAME",
    ),
    _serve(
        "auth_jwt_jwks",
        str,
        None,
        "require JWT bearer tokens signed by a key of this JWKS (with auth_jwt_issuer "
        "and auth_jwt_audience)",
        metavar="FILE_OR_URL",
    ),
    _serve("auth_jwt_issuer", str, None, "the 'iss' JWTs must carry", metavar="ISS"),
    _serve("auth_jwt_audience", str, None, "the 'aud' JWTs must carry", metavar="AUD"),
    _serve("auth_jwt_claim", str, "sub", "the JWT claim naming the caller", metavar="CLAIM"),
    _serve(
        "auth_jwt_allow_http_loopback",
        bool,
        False,
        "accept an http:// auth_jwt_jwks URL to a loopback host (otherwise https is required)",
    ),
    _serve(
        "admin",
        bool,
        False,
        "also serve gRPC channelz (grpc.channelz.v1.Channelz) for debugging connections; "
        "authenticated like the A2A service; needs pip install '.[admin]'",
    ),
    _serve(
        "extended_card",
        str,
        None,
        "give authenticated callers this card (JSON AgentCard) from GetExtendedAgentCard",
        metavar="FILE",
    ),
)
"""The settings of the process itself (not of ``ServerConfig`` or ``NatsConfig``)."""

CLUSTER_NAMES = {
    "servers": ("nats", "--nats"),
    "instance_id": ("instance_id", "--instance-id"),
    "replicas": ("nats_replicas", "--nats-replicas"),
    "lease": ("lease", "--lease"),
}
"""``NatsConfig`` fields whose settings keep the names they had before (others: ``nats_*``)."""
NOT_SETTINGS = frozenset({"key"})
"""Fields set only in code (``NatsConfig.key``: a secret is read from a file, never a flag)."""


def descriptions(cls: type) -> dict[str, str]:
    """Each attribute's description, from the ``Attributes:`` section of ``cls``'s docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    found: dict[str, str] = {}
    name = ""
    in_attributes = False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            in_attributes = True
            continue
        if not in_attributes:
            continue
        entry = _ENTRY.match(line)
        if entry:
            name = entry.group(1)
            found[name] = entry.group(2)
        elif name and line.startswith(" " * 8):
            found[name] += " " + line.strip()
    return {key: text.replace("``", "`") for key, text in found.items()}


def _from_dataclass(cls: type, group: str) -> list[Setting]:
    text = descriptions(cls)
    made = []
    for f in dataclasses.fields(cls):
        if f.name in NOT_SETTINGS:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if group == "cluster":
            name, flag = CLUSTER_NAMES.get(f.name, ("nats_" + f.name, ""))
            if f.name == "servers":
                default = []  # not set: no cluster
        else:
            name, flag = f.name, ""
        kind: Kind = list if isinstance(default, list | tuple) else type(default)
        if default is None:
            kind = str  # (instance_id: made per process when not set)
        made.append(
            Setting(
                name,
                kind,
                list(default) if isinstance(default, tuple) else default,
                text.get(f.name, ""),
                group,
                (flag or "--" + name.replace("_", "-"),),
                field=f.name,
            )
        )
    return made


RETIRED: tuple[Setting, ...] = (
    Setting(
        "nats_coalesce_writes",
        bool,
        None,
        "Retired: writes to NATS are nats-py's own (decision 0002). Still accepted, with "
        "a WARNING, so configurations that name it keep starting; a later version refuses "
        "it. Remove it from the configuration.",
        "retired",
        ("--nats-coalesce-writes",),
    ),
)
"""Settings that do nothing any more: accepted, each with a WARNING when given
(``retired``), until a later version refuses them as it does any unknown name."""

SETTINGS: tuple[Setting, ...] = (
    *SERVE,
    *_from_dataclass(ServerConfig, "server"),
    *_from_dataclass(NatsConfig, "cluster"),
    *RETIRED,
)
BY_NAME = {s.name: s for s in SETTINGS}
BY_FIELD = {s.field: s for s in SETTINGS if s.group == "cluster"}
"""The cluster settings by ``NatsConfig`` field."""


def spelled(name: str, value: object = None) -> str:
    """A setting as the user may have given it: ``--flag / ENV_VAR (key)``.

    Error messages name settings this way, so whoever typed a flag, set a
    variable or wrote the TOML key finds what they typed.

    Args:
        name: The setting's name (its TOML key).
        value: Its value, shown beside the key (``(key = value)``); None: not shown.
    """
    s = BY_NAME[name]
    shown = name if value is None else f"{name} = {value}"
    return f"{s.flags[0]} / {s.env} ({shown})"


_KEYS = re.compile(
    r"(?<![\w(-])("
    + "|".join(sorted((re.escape(s.name) for s in SETTINGS if "_" in s.name), key=len)[::-1])
    + r")(?![\w-])(?: \(([^()\s]+)\))?"
)
"""Setting names in a message (those with an underscore: ``host`` or ``push`` could be
plain words), each with the ``(value)`` that may follow it; not one in parentheses, as
``spelled`` leaves it."""


def spell_settings(message: str) -> str:
    """``message`` with every setting it names spelled as ``spelled`` does.

    For the messages of the layers below (``ServerConfig``, the cluster's
    signer), which know the settings only by their keys.
    """
    return _KEYS.sub(lambda m: spelled(m.group(1), m.group(2)), message)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add every setting's flag (unset flags leave no attribute: see ``resolve``)."""
    groups = {
        "serve": parser,
        "server": parser.add_argument_group("server limits and behaviour (ServerConfig)"),
        "cluster": parser.add_argument_group(
            "cluster mode (NATS JetStream; pip install '.[cluster]')"
        ),
        "retired": parser,
    }
    for s in SETTINGS:
        options: dict[str, Any] = {
            "dest": s.name,
            "default": argparse.SUPPRESS,
            "help": f"{s.help} (default: {_shown(s.default)}; env {s.env})".replace("%", "%%"),
        }
        if s.group == "retired":
            options["help"] = argparse.SUPPRESS
        if s.kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = _flag_type(s)
            options["metavar"] = s.metavar or _metavar(s)
        groups[s.group].add_argument(*s.flags, **options)


def _flag_type(s: Setting) -> Any:
    """The flag's ``type``: our parse, its errors as argparse's (the message is ours)."""

    def parse(text: str) -> Any:
        try:
            return _parse(s, text, s.flags[0])
        except SettingError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def resolve(
    given: Mapping[str, Any], environ: Mapping[str, str], path: Path | None
) -> dict[str, tuple[Any, str]]:
    """Every setting's value and where it came from (``flag``, ``env``, the file, ``default``).

    Args:
        given: The flags given (``vars`` of a namespace ``add_flags`` filled).
        environ: The environment.
        path: The TOML file (None: none).

    Raises:
        SettingError: A value does not parse or is not allowed, or the file has
            a key that is not a setting (each saying which, and where).
    """
    in_file = _read(path) if path is not None else {}
    known = {s.env for s in SETTINGS} | {CONFIG_ENV}
    environ = {k: v for k, v in environ.items() if not service_link(k, v)}
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        raise SettingError(_not_settings(unknown, sorted(known)))
    values: dict[str, tuple[Any, str]] = {}
    for s in SETTINGS:
        if s.name in given:
            values[s.name] = (given[s.name], "flag " + s.flags[0])
        elif s.env in environ:
            values[s.name] = (_parse(s, environ[s.env], s.env), "env " + s.env)
        elif s.name in in_file:
            values[s.name] = (_check(s, in_file[s.name], f"{path}: {s.name}"), f"file {path}")
        else:
            values[s.name] = (s.default, "default")
    return values


def server_config(values: Mapping[str, tuple[Any, str]]) -> ServerConfig:
    """The ``ServerConfig`` the values make.

    Raises:
        SettingError: The values do not make a valid ``ServerConfig``.
    """
    kwargs = {s.field: _value(values, s) for s in SETTINGS if s.group == "server"}
    kwargs["push_allow_hosts"] = tuple(kwargs["push_allow_hosts"])
    try:
        return ServerConfig(**kwargs)
    except ValueError as exc:
        raise SettingError(spell_settings(str(exc))) from None


def nats_config(values: Mapping[str, tuple[Any, str]]) -> NatsConfig | None:
    """The ``NatsConfig`` the values make (None: ``nats`` is not set, no cluster).

    Raises:
        SettingError: A value is out of range.
    """
    if not values["nats"][0]:
        return None
    kwargs = {s.field: _value(values, s) for s in SETTINGS if s.group == "cluster"}
    if not kwargs["instance_id"]:
        del kwargs["instance_id"]  # a new one per process
    if kwargs["lease"] <= 0:
        raise SettingError(f"{spelled('lease', kwargs['lease'])}: must be > 0")
    if kwargs["replicas"] < 1:
        raise SettingError(f"{spelled('nats_replicas', kwargs['replicas'])}: must be >= 1")
    if not 1 <= kwargs["event_streams"] <= MAX_EVENT_STREAMS:
        streams = spelled("nats_event_streams", kwargs["event_streams"])
        raise SettingError(f"{streams}: must be 1 to {MAX_EVENT_STREAMS}")
    if kwargs["routed_in_flight"] < 1:
        in_flight = spelled("nats_routed_in_flight", kwargs["routed_in_flight"])
        raise SettingError(f"{in_flight}: must be positive")
    if kwargs["user"] and not kwargs["password_file"]:
        raise SettingError(f"{spelled('nats_user')} needs {spelled('nats_password_file')}")
    if bool(kwargs["tls_cert"]) != bool(kwargs["tls_key"]):
        raise SettingError(f"{spelled('nats_tls_cert')} and {spelled('nats_tls_key')} go together")
    _check_cluster_key(kwargs["key_file"], kwargs["trust_bus"])
    for field in NATS_FILES:
        if kwargs[field]:
            _check_readable(BY_FIELD[field].name, kwargs[field])
    config = NatsConfig(**kwargs)
    try:
        signer_for(config)
    except ValueError as exc:
        raise SettingError(f"{spelled('nats_key_file')}: {exc}") from None
    return config


NATS_FILES = (
    "creds_file",
    "nkey_seed_file",
    "token_file",
    "password_file",
    "tls_ca",
    "tls_cert",
    "tls_key",
)
"""``NatsConfig`` fields naming files read when the instance connects: checked at start."""


def _check_readable(name: str, path: str) -> None:
    """Refuse a file setting whose file cannot be read, naming the setting.

    Raises:
        SettingError: The file cannot be opened.
    """
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise SettingError(f"{spelled(name)}: {path} cannot be read: {exc}") from None


def _check_cluster_key(key_file: str | None, trust_bus: bool) -> None:
    """Refuse cluster mode with neither a key nor a trusted bus (see ``jetstream.signing``).

    Raises:
        SettingError: Naming both settings, and how to make a key.
    """
    if key_file or trust_bus:
        return
    raise SettingError(
        f"cluster mode needs the cluster's shared key: {spelled('nats_key_file')} names a "
        "file holding the same secret on every instance (openssl rand -hex 32 > FILE), so "
        "that a client of the NATS bus cannot act as an instance; or, if NATS permissions "
        f"already keep every other client off the a2a.ctl subjects, {spelled('nats_trust_bus')}"
        " (see docs/how-to/secure-the-bus.md)"
    )


def retired(values: Mapping[str, tuple[Any, str]]) -> list[str]:
    """A WARNING's text for each retired setting ``values`` give (see ``RETIRED``)."""
    return [
        f"{spelled(s.name)}, given by {values[s.name][1]}, does nothing now: {s.help}"
        for s in RETIRED
        if values[s.name][1] != "default"
    ]


def render(values: Mapping[str, tuple[Any, str]]) -> str:
    """The effective configuration as a TOML file, each value's source in a comment."""
    lines = []
    for s in SETTINGS:
        if s.group == "retired":
            continue
        value, source = values[s.name]
        if value is None:
            lines.append(f"# {s.name} = (not set)")
        else:
            lines.append(f"{s.name} = {_toml(value)}  # {source}")
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The table of every setting (docs/reference/configuration.md)."""
    rows = [
        "| setting (TOML key) | flag | environment variable | default | what it does |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flag = " / ".join(f"`{f}`" for f in s.flags)
        if s.kind is bool:
            flag = f"`{s.flags[0]}` / `--no-{s.flags[0][2:]}`"
        text = s.help.replace("|", "\\|")
        rows.append(f"| `{s.name}` | {flag} | `{s.env}` | {_shown(s.default)} | {text} |")
    return "\n".join(rows) + "\n"


def _value(values: Mapping[str, tuple[Any, str]], s: Setting) -> Any:
    return values[s.name][0]


def _read(path: Path) -> dict[str, Any]:
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SettingError(f"--config {path}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingError(f"--config {path}: not TOML ({exc})") from None
    unknown = sorted(set(document) - set(BY_NAME))
    if unknown:
        raise SettingError(f"{path}: {_not_settings(unknown, sorted(BY_NAME))}")
    return document


_SERVICE_LINK = re.compile(
    ENV_PREFIX
    + r"(\w+_)?(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
    + r"|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)"
)
_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://")


def service_link(name: str, value: str) -> bool:
    """Whether a variable is one Kubernetes injects for a Service named ``a2a-grpc-server``.

    Kubernetes gives every pod, for each Service of its namespace,
    ``<NAME>_SERVICE_HOST``, ``<NAME>_SERVICE_PORT[_<port name>]``,
    ``<NAME>_PORT=tcp://10.…:50051`` and ``<NAME>_PORT_<port>_TCP[_PROTO|_PORT|_ADDR]``
    (unless the pod sets ``enableServiceLinks: false``). For that Service, and
    any whose name starts ``a2a-grpc-server-``, they begin as our settings
    do; they are not settings and are ignored (``<NAME>_PORT`` is recognised
    by its ``tcp://`` value: ``A2A_GRPC_SERVER_PORT`` is a setting too).
    """
    if name.endswith("_PORT") and _LINK_VALUE.match(value):
        return True  # (<NAME>_PORT=tcp://…: no setting takes a URL there)
    return bool(_SERVICE_LINK.fullmatch(name))


def _not_settings(unknown: list[str], known: list[str]) -> str:
    """Which names are not settings, and the setting each one probably meant."""
    named = []
    for name in unknown:
        # (Compared without the prefix every variable shares, which would match anything.)
        prefix = ENV_PREFIX if name.startswith(ENV_PREFIX) else ""
        stems = {k.removeprefix(prefix): k for k in known if k.startswith(prefix)}
        close = difflib.get_close_matches(name.removeprefix(prefix), stems, n=1, cutoff=0.75)
        named.append(f"{name} (did you mean {stems[close[0]]}?)" if close else name)
    verb = "is not a setting" if len(unknown) == 1 else "are not settings"
    return f"{', '.join(named)} {verb} (see `a2a-grpc-server serve --help`)"


def _parse(s: Setting, text: str, where: str) -> Any:
    """``text`` (a flag's or a variable's) as the setting's kind."""
    text = text.strip()
    try:
        if s.kind is bool:
            lowered = text.lower()
            if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError("expected true or false")
            value: Any = lowered in ("1", "true", "yes", "on")
        elif s.kind is int:
            value = int(text)
        elif s.kind is float:
            value = float(text)
        elif s.kind is list:
            value = [part.strip() for part in text.split(",") if part.strip()]
        else:
            value = text
    except ValueError as exc:
        raise SettingError(f"{where}={text!r}: not {_kind_name(s)} ({exc})") from None
    return _check(s, value, where)


def _check(s: Setting, value: Any, where: str) -> Any:
    """``value`` if it is of the setting's kind (an int is a float too) and allowed."""
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        list: isinstance(value, list) and all(isinstance(v, str) for v in value),
        str: isinstance(value, str),
    }[s.kind]
    if not ok:
        raise SettingError(f"{where} = {value!r}: not {_kind_name(s)}")
    if s.kind is float:
        value = float(value)
    if s.bounds is not None and not s.bounds[0] <= value <= s.bounds[1]:
        low, high = s.bounds
        what = "a port: 1 to 65535, or 0 for any free one" if s.bounds == PORT else f"{low}..{high}"
        raise SettingError(f"{where} = {value!r}: not {what}")
    if s.choices:
        chosen = [c for c in s.choices if c.lower() == str(value).lower()]
        if not chosen:
            raise SettingError(f"{where} = {value!r}: choose one of {', '.join(s.choices)}")
        value = chosen[0]
    return value


def _kind_name(s: Setting) -> str:
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        list: "a list of strings",
        str: "a string",
    }[s.kind]


def _metavar(s: Setting) -> str:
    return {int: "N", float: "SECONDS", list: "A[,B...]", str: "TEXT"}.get(s.kind, "VALUE")


def _shown(default: Any) -> str:
    if default is None or default == []:
        return "not set"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Iterable) and not isinstance(value, str):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    # A TOML basic string: JSON's escapes, but characters beyond the BMP as they are
    # (TOML has no surrogate pairs) and DEL escaped (TOML forbids it raw).
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


if __name__ == "__main__":  # the settings table: python -m a2a_grpc_server._internal.app.settings
    print(markdown(), end="")

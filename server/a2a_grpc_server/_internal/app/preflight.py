"""Checks ``serve`` makes before it binds: the advertised address, and the ports.

A wrong address in the agent card, or a port another process holds, is said
once, plainly, naming the setting to change (see ``settings.spelled``),
before anything is bound or a cluster joined.
"""

from __future__ import annotations

import errno
import logging
import socket

from .service import WILDCARDS
from .settings import BY_NAME, SettingError, spelled
from .tls import is_loopback

logger = logging.getLogger("a2a_grpc_server")


def check_advertised(address: str) -> None:
    """Refuse an ``--advertise`` that is not ``HOST:PORT`` (port 1-65535, host not a wildcard).

    Raises:
        SettingError: Saying what is wrong with it.
    """
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    where = spelled("advertise", repr(address))
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise SettingError(f"{where}: not HOST:PORT (a port from 1 to 65535)")
    if host in WILDCARDS:
        raise SettingError(
            f"{where}: {host} is where a server binds, not an address "
            "clients can reach; give this instance's name or its Service's"
        )


LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})
"""Host names that mean this machine (besides ``localhost.*`` and loopback addresses)."""


def warn_if_loopback_advertised(host: str) -> None:
    """Warn when a wildcard bind would put a loopback name in the agent card.

    Bound to every interface without ``--advertise``, the card gives this
    host's name (``socket.getfqdn()``); where that is ``localhost`` (a
    container without a resolvable hostname), clients elsewhere cannot use it.
    """
    if host not in WILDCARDS:
        return
    name = socket.getfqdn()
    if is_loopback(name) or name.startswith("localhost.") or name in LOOPBACK_NAMES:
        logger.warning(
            "%s binds every interface, but the agent card will give clients %s, this "
            "host's name, which only this machine reaches: give the address clients use "
            "with --advertise HOST:PORT (or %s)",
            spelled("host", host),
            name,
            BY_NAME["advertise"].env,
        )


def check_port_free(host: str, port: int, name: str, what: str) -> None:
    """Refuse a port that another socket holds, before the server tries it.

    When gRPC cannot bind, grpc core logs its own error (``add_port.cc``)
    before ours; binding a probe first says it once, plainly, and before a
    cluster is joined. (A port taken between this check and the server's
    bind still fails, with grpc core's line.)

    Args:
        host: The bind address.
        port: The port (0: any free one, nothing to check).
        name: The setting that names the port.
        what: ``gRPC`` or ``HTTP``.

    Raises:
        OSError: The port is in use (the message names the setting).
    """
    if port == 0:
        return
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return  # (the server's own bind says what is wrong with the host)
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    continue  # (e.g. no IPv6 here: the server's own bind decides)
                shown = f"[{host}]" if ":" in host else host
                raise OSError(
                    f"cannot serve {what} on {shown}:{port}: the port is in use (another "
                    f"server?); stop it or choose another port with {spelled(name)}"
                ) from None

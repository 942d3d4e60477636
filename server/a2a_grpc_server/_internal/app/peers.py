"""Who an HTTP connection, or a request, comes from: the share of the bounds it counts in.

An IPv4 address is one share; an IPv6 address counts in its /64 (one host's
addresses). Behind trusted proxies, a request's client is the right-most
``X-Forwarded-For`` entry that is not one of them: the one the nearest proxy
appended, since entries further left are what the client sent.
"""

from __future__ import annotations

import asyncio
import ipaddress

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def host_of(transport: asyncio.BaseTransport) -> str:
    """The host a connection comes from, as its socket names it ("?" if unknown)."""
    peername = transport.get_extra_info("peername")
    return str(peername[0]) if isinstance(peername, tuple) and peername else "?"


def address_of(transport: asyncio.BaseTransport) -> Address | None:
    """The address a connection comes from (an IPv4-mapped one as IPv4), or None."""
    return _parse(host_of(transport).split("%", 1)[0])


def _parse(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def networks(entries: tuple[str, ...] | list[str]) -> tuple[Network, ...]:
    """Addresses and networks (CIDR) as networks, IPv4-mapped ones as IPv4.

    Connections and ``X-Forwarded-For`` entries from ``::ffff:a.b.c.d`` are
    read as ``a.b.c.d`` (``address_of``), so a proxy listed that way is too.

    Raises:
        ValueError: An entry is not an address or a network.
    """
    found: list[Network] = []
    for entry in entries:
        net = ipaddress.ip_network(entry, strict=False)
        mapped = ipaddress.IPv6Network("::ffff:0:0/96")
        if isinstance(net, ipaddress.IPv6Network) and net.subnet_of(mapped):
            low = net.network_address.ipv4_mapped
            assert low is not None  # (inside ::ffff:0:0/96)
            net = ipaddress.ip_network(f"{low}/{max(net.prefixlen - 96, 0)}", strict=False)
        found.append(net)
    return tuple(found)


def share_of(address: Address) -> str:
    """Whose share an address counts in: an IPv4 address, or an IPv6 address's /64."""
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def forwarded_client(values: list[str], trusted: tuple[Network, ...]) -> str | None:
    """The client ``X-Forwarded-For`` names: its right-most entry that is not a trusted proxy.

    Returns:
        Its share's name (``share_of``), or the entry as written (at most 64
        characters) if it is not an address; None without the header, or if
        every entry is a trusted proxy (the request is the proxy's own).
    """
    entries = [entry.strip() for value in values for entry in value.split(",")]
    for entry in reversed(entries):
        if not entry:
            continue  # ("a,,b": an empty entry names nobody)
        address = _parse(_without_port(entry))
        if address is None:
            return entry[:64]
        if not any(address in net for net in trusted):
            return share_of(address)
    return None


def _without_port(entry: str) -> str:
    """``[2001:db8::1]:80`` and ``192.0.2.1:80`` without their ports (some proxies add them)."""
    if entry.startswith("["):
        return entry[1:].partition("]")[0]
    host, colon, port = entry.rpartition(":")
    return host if colon and "." in host and ":" not in host and port.isdigit() else entry

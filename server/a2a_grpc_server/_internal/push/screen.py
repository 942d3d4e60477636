"""Which webhook URLs and addresses push may reach (server-side request forgery).

A webhook URL comes from a client, so the server must not let it reach what
only the server can: its own loopback, the private network around it, cloud
metadata endpoints. Two checks, one policy (``Screen``):

* ``Screen.url`` when a config is created: the scheme (https only), no user
  info in the URL, the length, and, for a literal IP host, the address. A
  refused URL answers INVALID_ARGUMENT naming the field.
* ``Screen.resolve`` each time a delivery connects: the host is resolved and
  every address checked; the request then goes to the checked address itself
  (TLS still verifies the host name), so a name that resolved to a public
  address at creation and to 127.0.0.1 at delivery (DNS rebinding) reaches
  nothing it should not.

Refused addresses: anything not globally routable (loopback, private,
link-local, including the 169.254.169.254 metadata endpoint, carrier-grade
NAT, unspecified, reserved, documentation ranges), multicast, and IPv6
addresses that embed a refused IPv4 one (IPv4-mapped, 6to4, NAT64, Teredo).
``allow_private`` lifts all of this and allows http (tests, webhooks inside
the same mesh); ``allow_hosts`` trusts named hosts whatever they resolve to.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from ..errors import quote

MAX_URL_CHARS = 2048
"""Longest webhook URL accepted."""

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

NAT64 = ipaddress.ip_network("64:ff9b::/96")
GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
"""The only IPv6 addresses push may reach (public unicast); the rest are local, translated
(IPv4-compatible, SIIT, local-use NAT64) or unassigned."""
IPV6_REFUSED = (ipaddress.ip_network("3fff::/20"),)
"""Inside ``GLOBAL_UNICAST`` but not public (documentation, RFC 9637)."""
MAX_HOST_CHARS = 253
_NUMBER = re.compile(r"0x[0-9a-f]*|[0-9]+", re.IGNORECASE)
MAX_LABEL_CHARS = 63


class RefusedTargetError(Exception):
    """A webhook URL or the address it resolves to is not one push may reach."""


def refused_address(address: Address) -> str | None:
    """Why push may not connect to ``address`` (None: it may).

    Args:
        address: A resolved or literal IP address.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address.teredo is not None:
            embedded = address.teredo[1]
        if embedded is None and address in NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            why = refused_address(embedded)
            return f"it embeds {embedded}, {why}" if why else None
        if address not in GLOBAL_UNICAST or any(address in net for net in IPV6_REFUSED):
            return "not a public IPv6 address (local, translated or unassigned range)"
    if address.is_multicast:
        return "a multicast address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address (cloud metadata endpoints live there)"
    if address.is_unspecified:
        return "the unspecified address"
    if not address.is_global or address.is_reserved:
        return "not a public address (private, shared or reserved range)"
    return None


@dataclass(frozen=True, slots=True)
class Target:
    """Where one delivery connects.

    Attributes:
        url: The URL to request: the webhook's, with the host replaced by the
            checked address.
        host: The ``Host`` header (the webhook's own host and port).
        server_name: The name TLS verifies (None for http).
        address: The checked address connected to.
        port: The port connected to.
        path: The request target: the URL's path ("/" if none) and query.
    """

    url: str
    host: str
    server_name: str | None
    address: str
    port: int
    path: str


@dataclass(frozen=True, slots=True)
class Screen:
    """The push target policy (see the module docstring).

    Attributes:
        allow_private: Allow http and every address (tests, same-mesh webhooks).
        allow_hosts: Host names trusted whatever they resolve to (still https
            unless ``allow_private``); ``*.example.com`` matches its subdomains.
    """

    allow_private: bool = False
    allow_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A list (the library API takes any sequence) would make the screen unhashable,
        # and every delivery's cached check fail.
        object.__setattr__(self, "allow_hosts", tuple(self.allow_hosts))

    def url(self, url: str) -> SplitResult:
        """Check a webhook URL as a config is created.

        Returns:
            The URL, split.

        Raises:
            RefusedTargetError: Saying what is wrong and what is accepted.
        """
        if len(url) > MAX_URL_CHARS:
            raise RefusedTargetError(f"is {len(url)} characters; at most {MAX_URL_CHARS}")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise RefusedTargetError(f"{quote(url)} is not a URL ({exc})") from None
        if port == 0:
            raise RefusedTargetError(f"{quote(url)} names port 0 (no server listens there)")
        schemes = ("https", "http") if self.allow_private else ("https",)
        if parts.scheme not in schemes:
            raise RefusedTargetError(
                f"{quote(url)} is not an https URL"
                + ("" if self.allow_private else " (http needs serve --push-allow-private)")
            )
        if not parts.hostname:
            raise RefusedTargetError(f"{quote(url)} has no host")
        if parts.username is not None or parts.password is not None:
            raise RefusedTargetError(
                f"{quote(url)} carries user info; put credentials in the config's authentication"
            )
        if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
            raise RefusedTargetError(
                f"{quote(url)} contains whitespace, a control character or non-ASCII text "
                "(write an internationalized host in its xn-- form, and percent-encode paths)"
            )
        host = parts.hostname.rstrip(".")
        if len(host) > MAX_HOST_CHARS or any(
            not 0 < len(label) <= MAX_LABEL_CHARS for label in host.split(".")
        ):
            raise RefusedTargetError(f"{quote(url)} has a malformed host name")
        literal = _literal(parts.hostname)
        if literal is None and _numeric(host):
            literal = _legacy_ipv4(url, host)
        if literal is not None and not self._trusted(parts.hostname):
            why = refused_address(literal)
            if why is not None and not self.allow_private:
                raise RefusedTargetError(f"{quote(url)} points at {why}")
        return parts

    def checked(self, url: str) -> SplitResult:
        """``url(url)``, worked out once per URL and policy (1,024 kept).

        Raises:
            RefusedTargetError: As ``url`` (a refusal is not kept).
        """
        return _checked_url(self, url)

    async def resolve(self, url: str) -> Target:
        """Resolve the webhook's host and pick an address push may connect to.

        Raises:
            RefusedTargetError: The host resolved to no address push may reach.
            OSError: The name could not be resolved (worth retrying).
        """
        literal_target = _literal_target(self, url)  # (checked once per URL, then cached)
        if literal_target is not None:
            return literal_target
        parts = _checked_url(self, url)
        host = parts.hostname
        assert host is not None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        return self._target(parts, addresses)

    def _target(self, parts: SplitResult, addresses: list[Address]) -> Target:
        """The target of a checked URL among ``addresses``, the first push may reach.

        Raises:
            RefusedTargetError: None of them may be reached.
        """
        host = parts.hostname
        assert host is not None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        trusted = self.allow_private or self._trusted(host)
        allowed = [a for a in addresses if trusted or refused_address(a) is None]
        if not allowed:
            why = refused_address(addresses[0]) if addresses else "no address"
            raise RefusedTargetError(f"{quote(host)} resolves to {addresses[0]}, {why}")
        address = allowed[0]
        shown = f"[{address}]" if address.version == 6 else str(address)
        netloc = f"{shown}:{port}"
        target = parts._replace(netloc=netloc).geturl()
        return Target(
            url=target,
            host=parts.netloc.rpartition("@")[2],
            server_name=host if parts.scheme == "https" else None,
            address=str(address),
            port=port,
            path=(parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
        )

    def _trusted(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for allowed in self.allow_hosts:
            allowed = allowed.lower().rstrip(".")
            if allowed.startswith("*."):
                if host.endswith(allowed[1:]):
                    return True
            elif host == allowed:
                return True
        return False


CACHED_URLS = 1024
"""URLs whose checks (and targets, for an IP host) a screen keeps, the most recent."""


@functools.lru_cache(maxsize=CACHED_URLS)
def _checked_url(screen: Screen, url: str) -> SplitResult:
    """``screen.url(url)``, worked out once per URL and policy (a delivery parses nothing).

    Raises:
        RefusedTargetError: As ``Screen.url`` (a refusal is not cached).
    """
    return screen.url(url)


@functools.lru_cache(maxsize=CACHED_URLS)
def _literal_target(screen: Screen, url: str) -> Target | None:
    """The target of a URL whose host is an IP address (None: a name, resolved per delivery).

    Nothing in it can change between deliveries, so it is worked out once per
    URL and policy.

    Raises:
        RefusedTargetError: The URL or its address is refused (not cached).
    """
    parts = _checked_url(screen, url)
    host = parts.hostname
    assert host is not None
    literal = _literal(host)
    if literal is None and _numeric(host):
        literal = _legacy_ipv4(url, host)
    return None if literal is None else screen._target(parts, [literal])


def _numeric(host: str) -> bool:
    """Whether every label of ``host`` is a number (decimal, octal or 0x hex): no DNS name.

    Such a host is an IPv4 address in one of the forms ``inet_aton`` (and so
    the resolver, and every HTTP client) reads: ``2130706433``, ``0x7f.1``,
    ``127.1``, ``0177.0.0.1`` are all 127.0.0.1.
    """
    labels = host.rstrip(".").split(".")
    return all(_NUMBER.fullmatch(label) for label in labels)


def _legacy_ipv4(url: str, host: str) -> Address:
    """The IPv4 address a numeric host stands for.

    Raises:
        RefusedTargetError: It stands for none (``999.1``, a number too large).
    """
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host.rstrip(".")))
    except OSError:
        raise RefusedTargetError(f"{quote(url)} has a numeric host that is no address") from None


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None

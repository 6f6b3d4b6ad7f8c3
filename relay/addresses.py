"""Addresses in the configuration: listeners, the admin port, the management upstream, the
routing domains. Pure parsing, no I/O (nothing is resolved here: a name that does not resolve
fails when relay binds it, ``relay.startup.binding``)."""

from __future__ import annotations

import ipaddress
import re

# A DNS label as a Host can carry it (RFC 1123 §2.1; "_" tolerated, as resolvers do).
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\Z")


def is_dns_name(domain: str) -> bool:
    """A routing domain a Host can end with: ASCII labels, in any case, one root dot allowed.

    Anything else (a port, a ``*.`` wildcard, a scheme, an empty name) matched no Host, and
    relay answered every Host-form request 404 "No sandbox in the request" (found by review).
    """
    name = domain.lower().removesuffix(".")
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split("."))


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` → (host, port); None for anything else."""
    host, sep, port = address.rpartition(":")
    # isascii: str.isdigit() also accepts digits int() refuses ("²"); at most 5 digits, as
    # int() refuses strings past 4,300 digits with a ValueError (found by review).
    if (
        not sep
        or not (port.isascii() and port.isdigit() and len(port) <= 5)
        or not 0 <= int(port) <= 65535
    ):
        return None
    if not host:
        return None
    # The host must be one: an IPv6 address in brackets, an IPv4 address or a DNS name.
    # Anything else failed only at bind time, exit 1 "Unknown error -2", while check-config
    # passed it (found by review). An IPv6 address without brackets is refused, as nginx's
    # `listen` refuses it and RFC 3986 §3.2.2 writes it: "fd00::1:2" is both fd00::1 port 2
    # and fd00::1:2 without a port, and relay used to bind the first silently.
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
        host = host[1:-1]
    elif not is_dns_name(host):  # an unbracketed IPv6 address too: ":" is in no label
        return None
    return host, int(port)


def authority(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 address in brackets (RFC 3986 §3.2.2), so that
    ``::1:8080`` is not read as one address without a port."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ipv4_mapped(host: str) -> str | None:
    """The IPv4 address an IPv4-mapped IPv6 host (``::ffff:10.0.0.1``) stands for, else None.
    relay's IPv6 listeners are v6-only (asyncio and uvloop set ``IPV6_V6ONLY``), so the kernel
    refuses to bind one (EINVAL)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped) if mapped is not None else None


def parse_http_url(url: str) -> tuple[str, int] | None:
    """``http://host[:port]`` (no path) → (host, port); the management upstream's form."""
    if not url.startswith("http://"):
        return None
    rest = url[len("http://") :].rstrip("/")
    # No userinfo and no blank: "http://user:pass@h:80" was taken as the host "user:pass@h",
    # which no request could reach, and check-config printed the password (found by review).
    if "/" in rest or not rest or "@" in rest or any(c.isspace() for c in rest):
        return None
    if rest.count(":") == 0 or (rest.startswith("[") and rest.endswith("]")):
        host, port = rest, 80
    else:
        parsed = split_address(rest)
        if parsed is None or parsed[1] == 0:  # port 0 is for listening, never for dialling
            return None
        host, port = rest.rpartition(":")[0], parsed[1]
    # The host as written must be one (RFC 3986 §3.2.2): an IPv6 address in brackets, an IPv4
    # address or a DNS name. "user:pw@10.0.0.1" was dialled as a name (every API request 502)
    # and check-config printed its password (found by review).
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
        return host[1:-1], port
    return (host, port) if is_dns_name(host) else None


def overlap(a: str, b: str) -> bool:
    """Whether two listeners' hosts would claim the same addresses on one port: equal, or one
    a wildcard of the other's family (an IPv6 listener is v6-only, so ``::`` and ``0.0.0.0``
    do not)."""
    try:
        ips = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()  # host names: only the same name is known to clash
    if ips[0].version != ips[1].version:
        return False
    return ips[0] == ips[1] or ips[0].is_unspecified or ips[1].is_unspecified


def family_mismatch(source: str | None, address: str) -> str | None:
    """Why a dial from ``source`` (``upstream.source_address``) failed when ``address`` is of
    the other family: the kernel says only EINVAL or EAFNOSUPPORT, and the access log gave no
    more (found by review). relay.upstreams asks after a failure only, so a dial that succeeds
    pays nothing."""
    if not source:
        return None
    try:
        ips = ipaddress.ip_address(source), ipaddress.ip_address(address)
    except ValueError:
        return None  # a management upstream's name
    if ips[0].version == ips[1].version:
        return None
    return (
        f"the source address {source} is IPv{ips[0].version}, "
        f"the upstream {address} is IPv{ips[1].version}"
    )

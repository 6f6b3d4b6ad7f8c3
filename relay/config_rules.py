"""The configuration's value rules beyond types (SPEC §6): listeners and their addresses,
networks, ports, timeouts, the upstream's source address, the process. Each failure raises a
:class:`~relay.config.ConfigError` naming its key; ``check-config`` and a SIGHUP reload refuse
the file as a start would.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math

from relay.addresses import ipv4_mapped, is_dns_name, overlap, parse_http_url, split_address
from relay.config import MAX_WORKERS, SECTIONS, Config, ConfigError, check
from relay.config_redis import check_redis_options, check_redis_secrets


def validate(config: Config) -> None:
    """Value rules beyond types; each failure names its key."""
    listen, up, routes = config.listen, config.upstream, config.routes
    check(bool(listen.addresses), "listen.address", "at least one address")
    for i, addr in enumerate(listen.addresses):
        check(split_address(addr) is not None, f"listen.address[{i}]", _bad_address(addr))
    check(
        bool(listen.tls_cert) == bool(listen.tls_key),
        "listen.tls_key",
        "tls_cert and tls_key are set together",
    )
    for name, cls in SECTIONS.items():
        section = getattr(config, name)
        for f in dataclasses.fields(cls):
            value = getattr(section, f.name)
            if isinstance(value, float):
                check(math.isfinite(value), f"{name}.{f.name}", "must be a finite number")
    check(listen.header_timeout_s > 0, "listen.header_timeout_s", "must be > 0")
    check(listen.idle_timeout_s > 0, "listen.idle_timeout_s", "must be > 0")
    # A poll interval of 0 would stat the routes file in a busy loop, a core at 100%.
    check(routes.poll_interval_s >= 0.01, "routes.poll_interval_s", "must be >= 0.01")
    check(up.idle_timeout_s > 0, "upstream.idle_timeout_s", "must be > 0")
    check(up.max_idle_per_upstream >= 0, "upstream.max_idle_per_upstream", "must be >= 0")
    check(config.process.drain_timeout_s >= 0, "process.drain_timeout_s", "must be >= 0")
    check(listen.max_header_bytes >= 1024, "listen.max_header_bytes", "must be >= 1024")
    check(listen.max_connections >= 1, "listen.max_connections", "must be >= 1")
    for key, cidrs in (
        ("listen.trusted_proxies", listen.trusted_proxies),
        ("listen.allowed_clients", listen.allowed_clients),
        ("upstream.allowed_cidrs", up.allowed_cidrs),
    ):
        for i, cidr in enumerate(cidrs):
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ConfigError(f"{key}[{i}]: not a CIDR: {cidr!r}") from None
    admin = config.admin.address
    check(split_address(admin) is not None, "admin.address", _bad_address(admin))
    _check_distinct_addresses(config)
    _check_not_mapped(config)
    check(bool(config.routing.domains), "routing.domains", "at least one domain")
    for i, domain in enumerate(config.routing.domains):
        check(
            is_dns_name(domain),
            f"routing.domains[{i}]",
            f"not a DNS name: {domain!r} (no scheme, port or wildcard)",
        )
    check(routes.source in ("file", "redis"), "routes.source", 'must be "file" or "redis"')
    if routes.source == "redis":
        check(
            routes.redis_url.startswith(("redis://", "rediss://", "unix://")),
            "routes.redis_url",
            "must be a redis://, rediss:// or unix:// URL",
        )
        check_redis_secrets(routes)
        check_redis_options(routes.redis_url)
    check(routes.max_stale_s > 0, "routes.max_stale_s", "must be > 0")
    check(up.credentials in ("strip", "forward"), "upstream.credentials", '"strip" or "forward"')
    check(1 <= up.envd_port <= 65535, "upstream.envd_port", "must be a port number")
    for i, port in enumerate(up.denied_ports):
        check(
            1 <= port <= 65535,
            f"upstream.denied_ports[{i}]",
            f"must be a port number (1-65535), got {port}",
        )
    check(up.connect_timeout_s > 0, "upstream.connect_timeout_s", "must be > 0")
    check(
        not (up.source_address and up.source_interface),
        "upstream.source_interface",
        "set source_address or source_interface, not both",
    )
    if up.source_address:
        try:
            ipaddress.ip_address(up.source_address)
        except ValueError:
            raise ConfigError("upstream.source_address: not an IP address") from None
    _check_source_family(config)
    if config.management.upstream:
        check(
            parse_http_url(config.management.upstream) is not None,
            "management.upstream",
            "must be http://host:port",
        )
    # Each worker is a Python interpreter (tens of MB); past this a typo exhausts the host
    # (2**63-1 was a list of workers grown until the OOM killer came, found by review).
    check(
        1 <= config.process.workers <= MAX_WORKERS,
        "process.workers",
        f"must be between 1 and {MAX_WORKERS}",
    )
    check(config.process.drain_timeout_s >= 0, "process.drain_timeout_s", "must be >= 0")


def _check_source_family(config: Config) -> None:
    """A socket bound to ``upstream.source_address`` dials only its own family, and
    ``source_interface`` gives an IPv4 address (relay.netlink). With no network of that family
    in ``upstream.allowed_cidrs`` no route could ever be dialled, nor a management upstream
    written as an address of the other family: relay started, and every request was 502 with
    the reason ``dial: Invalid argument`` (found by review). Names are not checked: they may
    resolve to both families."""
    up = config.upstream
    if up.source_address:
        key, version = "upstream.source_address", ipaddress.ip_address(up.source_address).version
        what = f"{up.source_address} is IPv{version}"
    elif up.source_interface:
        key, version, what = "upstream.source_interface", 4, "gives an IPv4 address"
    else:
        return
    check(
        any(net.version == version for net in config.allowed_cidrs()),
        key,
        f"{what}, and upstream.allowed_cidrs has no IPv{version} network: no route could be "
        "dialled",
    )
    parsed = parse_http_url(config.management.upstream) if config.management.upstream else None
    try:
        management = ipaddress.ip_address(parsed[0]) if parsed else None
    except ValueError:
        management = None  # a name
    check(
        management is None or management.version == version,
        key,
        f"{what}, and cannot dial management.upstream {management}",
    )


def _bad_address(address: str) -> str:
    return f"bad address {address!r}: write host:port, an IPv6 host in brackets ([::1]:8080)"


def _check_not_mapped(config: Config) -> None:
    """No listener on an IPv4-mapped address: serve stopped at bind with "Invalid argument",
    exit 1, which Restart=on-failure repeats, and check-config passed it (found by review)."""
    named = [(f"listen.address[{i}]", a) for i, a in enumerate(config.listen.addresses)]
    for key, address in [*named, ("admin.address", config.admin.address)]:
        host, port = split_address(address) or ("", 0)
        mapped = ipv4_mapped(host)
        check(
            mapped is None,
            key,
            f"{address} is an IPv4-mapped IPv6 address, which a v6-only listener cannot bind: "
            f"write {mapped}:{port}",
        )


def _check_distinct_addresses(config: Config) -> None:
    """No two listeners on one address: relay bound the first, then stopped on its own port
    ("Address already in use", exit 1, so Restart=on-failure looped) and check-config passed
    it (found by review). A wildcard holds its port for every address of its family; an IPv6
    listener is v6-only, so ``[::]`` and ``0.0.0.0`` may share one. Port 0 is never shared."""
    seen: list[tuple[str, str]] = []
    named = [(f"listen.address[{i}]", a) for i, a in enumerate(config.listen.addresses)]
    for key, address in [*named, ("admin.address", config.admin.address)]:
        parsed = split_address(address)
        assert parsed is not None  # checked before
        host, port = parsed
        for other_key, other in seen:
            other_host, other_port = split_address(other) or ("", 0)
            check(
                port == 0 or port != other_port or not overlap(host, other_host),
                key,
                f"{address} is {other_key} already",
            )
        seen.append((key, address))

"""Strict TOML configuration (SPEC §6): an unknown key or a wrong type names the key.

Each table maps onto a frozen dataclass; the dataclass fields *are* the schema, so a key is
known iff a field of that name exists, and its annotation gives the type checked. Secrets
(TLS key, Redis password) are paths or environment variable names, never inline values.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import tomllib
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from relay.addresses import ipv4_mapped, is_dns_name, overlap, parse_http_url, split_address
from relay.core.decide import Settings
from relay.core.routes import Network

MAX_WORKERS = 1024


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Listen:
    address: str | list[str] = "127.0.0.1:8080"
    tls_cert: str = ""
    tls_key: str = ""
    header_timeout_s: float = 10.0
    max_header_bytes: int = 16384
    max_connections: int = 10000
    trusted_proxies: list[str] = field(default_factory=list)
    allowed_clients: list[str] = field(default_factory=list)
    idle_timeout_s: float = 630.0

    @property
    def addresses(self) -> list[str]:
        return [self.address] if isinstance(self.address, str) else list(self.address)


@dataclass(frozen=True, slots=True, kw_only=True)
class Admin:
    address: str = "127.0.0.1:9090"


@dataclass(frozen=True, slots=True, kw_only=True)
class Routing:
    domains: list[str] = field(default_factory=lambda: ["sandbox.localhost"])


@dataclass(frozen=True, slots=True, kw_only=True)
class Routes:
    source: str = "file"
    file: str = "routes.json"  # relative paths resolve from the config file's folder
    # Not in repr: a password written into the URL is accepted (redact_url shows it safely).
    redis_url: str = field(default="", repr=False)
    redis_prefix: str = "relay:"
    redis_username: str = ""
    redis_password_file: str = ""
    redis_password_env: str = ""
    redis_ca_file: str = ""
    max_stale_s: float = 30.0
    poll_interval_s: float = 0.25


@dataclass(frozen=True, slots=True, kw_only=True)
class Upstream:
    envd_port: int = 49983
    credentials: str = "strip"
    denied_ports: list[int] = field(default_factory=lambda: [50090])
    allowed_cidrs: list[str] = field(
        default_factory=lambda: [
            "127.0.0.0/8",
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "fc00::/7",
        ]
    )
    source_address: str = ""
    source_interface: str = ""
    connect_timeout_s: float = 5.0
    idle_timeout_s: float = 630.0
    # Idle connections kept per (sandbox, generation, address, port). Past it a finished
    # exchange closes its connection and the next request dials again: with 64 (nginx's
    # `keepalive 64`) a burst of 200 concurrent requests to one port cost relay a dial on
    # most of them (11k vs 21-25k req/s at c200 in bench/), so the default covers a burst.
    max_idle_per_upstream: int = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class Management:
    upstream: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Process:
    workers: int = 1
    drain_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    listen: Listen = field(default_factory=Listen)
    admin: Admin = field(default_factory=Admin)
    routing: Routing = field(default_factory=Routing)
    routes: Routes = field(default_factory=Routes)
    upstream: Upstream = field(default_factory=Upstream)
    management: Management = field(default_factory=Management)
    process: Process = field(default_factory=Process)
    # Where relative paths in the file are resolved from (the config file's folder).
    base_dir: Path = field(default=Path(), compare=False)
    # The file it was loaded from (SIGHUP reads it again); None when built in memory.
    source: Path | None = field(default=None, compare=False)

    def path(self, value: str) -> Path:
        p = Path(value)
        return p if p.is_absolute() else self.base_dir / p

    def settings(self) -> Settings:
        return Settings(
            domains=tuple(self.routing.domains),
            envd_port=self.upstream.envd_port,
            denied_ports=frozenset(self.upstream.denied_ports),
            strip=self.upstream.credentials == "strip",
            management=bool(self.management.upstream),
            management_host=self.management.upstream.removeprefix("http://")
            .rstrip("/")
            .encode("latin-1"),
            trusted_proxies=networks(self.listen.trusted_proxies),
        )

    def allowed_cidrs(self) -> tuple[Network, ...]:
        return networks(self.upstream.allowed_cidrs)


def networks(cidrs: list[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def in_networks(peer: str, nets: tuple[Network, ...]) -> bool:
    """``peer`` (an address as the socket reports it) is in one of ``nets``."""
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(ip in net for net in nets)


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Return the value converted to ``annotation`` or raise naming ``key``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if isinstance(value, list):
            # A list for ``str | list[str]`` (listen.address): the list's own check, whose
            # error names the bad element; the union's named only the key, "expected str |
            # list[str], got list" for a list with one bad element (found by review).
            for option in options:
                if typing.get_origin(option) is list:
                    return _check_type(key, value, option)
        for option in options:
            try:
                return _check_type(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {type(value).__name__}")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{key}: number out of range") from None
    if annotation is int and isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got a boolean")
    if not isinstance(value, annotation):
        raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {type(value).__name__}")
    return value


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def _section(name: str, cls: type[Any], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a table")
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key")
        values[key] = _check_type(f"{name}.{key}", value, hints[key])
    return cls(**values)


_SECTIONS: dict[str, type[Any]] = {
    "listen": Listen,
    "admin": Admin,
    "routing": Routing,
    "routes": Routes,
    "upstream": Upstream,
    "management": Management,
    "process": Process,
}


def parse(data: dict[str, Any], base_dir: Path = Path()) -> Config:
    sections: dict[str, Any] = {}
    for name, raw in data.items():
        cls = _SECTIONS.get(name)
        if cls is None:
            raise ConfigError(f"{name}: unknown section")
        sections[name] = _section(name, cls, raw)
    config = Config(**sections, base_dir=base_dir)
    validate(config)
    return config


def config_sections(config: Config) -> dict[str, dict[str, Any]]:
    """The configuration as the tables of its file (``parse`` reads them back)."""
    return {name: dataclasses.asdict(getattr(config, name)) for name in _SECTIONS}


def load(path: str | os.PathLike[str]) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 (byte {exc.start}); TOML files are UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid TOML: nested too deeply") from None
    # Absolute, its links left to each open: a folder swapped by a link (a Kubernetes
    # ConfigMap's "..data", a release symlink) is followed by SIGHUP and by the routes file's
    # polls. Resolved here, relay kept reading the folder of its start, deleted by the
    # update: every reload failed and the routes of that start stayed (found by review).
    p = p.absolute()
    return dataclasses.replace(parse(data, p.parent), source=p)


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def validate(config: Config) -> None:
    """Value rules beyond types; each failure names its key."""
    listen, up, routes = config.listen, config.upstream, config.routes
    _check(bool(listen.addresses), "listen.address", "at least one address")
    for i, addr in enumerate(listen.addresses):
        _check(split_address(addr) is not None, f"listen.address[{i}]", _bad_address(addr))
    _check(
        bool(listen.tls_cert) == bool(listen.tls_key),
        "listen.tls_key",
        "tls_cert and tls_key are set together",
    )
    for name, cls in _SECTIONS.items():
        section = getattr(config, name)
        for f in dataclasses.fields(cls):
            value = getattr(section, f.name)
            if isinstance(value, float):
                _check(math.isfinite(value), f"{name}.{f.name}", "must be a finite number")
    _check(listen.header_timeout_s > 0, "listen.header_timeout_s", "must be > 0")
    _check(listen.idle_timeout_s > 0, "listen.idle_timeout_s", "must be > 0")
    # A poll interval of 0 would stat the routes file in a busy loop, a core at 100%.
    _check(routes.poll_interval_s >= 0.01, "routes.poll_interval_s", "must be >= 0.01")
    _check(up.idle_timeout_s > 0, "upstream.idle_timeout_s", "must be > 0")
    _check(up.max_idle_per_upstream >= 0, "upstream.max_idle_per_upstream", "must be >= 0")
    _check(config.process.drain_timeout_s >= 0, "process.drain_timeout_s", "must be >= 0")
    _check(listen.max_header_bytes >= 1024, "listen.max_header_bytes", "must be >= 1024")
    _check(listen.max_connections >= 1, "listen.max_connections", "must be >= 1")
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
    _check(split_address(admin) is not None, "admin.address", _bad_address(admin))
    _check_distinct_addresses(config)
    _check_not_mapped(config)
    _check(bool(config.routing.domains), "routing.domains", "at least one domain")
    for i, domain in enumerate(config.routing.domains):
        _check(
            is_dns_name(domain),
            f"routing.domains[{i}]",
            f"not a DNS name: {domain!r} (no scheme, port or wildcard)",
        )
    _check(routes.source in ("file", "redis"), "routes.source", 'must be "file" or "redis"')
    if routes.source == "redis":
        _check(
            routes.redis_url.startswith(("redis://", "rediss://", "unix://")),
            "routes.redis_url",
            "must be a redis://, rediss:// or unix:// URL",
        )
        _check_redis_secrets(routes)
        _check_redis_options(routes.redis_url)
    _check(routes.max_stale_s > 0, "routes.max_stale_s", "must be > 0")
    _check(up.credentials in ("strip", "forward"), "upstream.credentials", '"strip" or "forward"')
    _check(1 <= up.envd_port <= 65535, "upstream.envd_port", "must be a port number")
    for i, port in enumerate(up.denied_ports):
        _check(
            1 <= port <= 65535,
            f"upstream.denied_ports[{i}]",
            f"must be a port number (1-65535), got {port}",
        )
    _check(up.connect_timeout_s > 0, "upstream.connect_timeout_s", "must be > 0")
    _check(
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
        _check(
            parse_http_url(config.management.upstream) is not None,
            "management.upstream",
            "must be http://host:port",
        )
    # Each worker is a Python interpreter (tens of MB); past this a typo exhausts the host
    # (2**63-1 was a list of workers grown until the OOM killer came, found by review).
    _check(
        1 <= config.process.workers <= MAX_WORKERS,
        "process.workers",
        f"must be between 1 and {MAX_WORKERS}",
    )
    _check(config.process.drain_timeout_s >= 0, "process.drain_timeout_s", "must be >= 0")


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
    _check(
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
    _check(
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
        _check(
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
            _check(
                port == 0 or port != other_port or not overlap(host, other_host),
                key,
                f"{address} is {other_key} already",
            )
        seen.append((key, address))


def url_password(url: str) -> str | None:
    """A password written into a Redis URL: the userinfo's, or a non-empty ``password``
    query parameter, which redis-py's ``from_url`` also reads (and prefers over its
    argument; it ignores an empty one)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        return parts.password
    values = urllib.parse.parse_qs(parts.query).get("password")
    return values[0] if values else None


def redact_url(url: str) -> str:
    """``url`` with any password in it (userinfo or query) replaced by ``<redacted>``, and
    otherwise exactly as written (``check-config``'s output may be copied back)."""
    if url_password(url) is None:
        return url
    # urlsplit, and redis-py through it, drop tabs and line ends anywhere in a URL (WHATWG):
    # the password they read may be spelled with them in the file, where the replacements
    # below would not find it (found by review: check-config printed it). Shown without them.
    url = url.translate(_DROPPED_BY_URLSPLIT)
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        url = url.replace(f":{parts.password}@", ":<redacted>@", 1)
    if parts.query:
        pieces = [
            # The key as parse_qs (url_password, redis-py) reads it: "pass%77ord" is one too
            # (found by review: check-config printed its value).
            "password=<redacted>"
            if urllib.parse.unquote_plus(piece.partition("=")[0]) == "password"
            else piece
            for piece in parts.query.split("&")
        ]
        url = url.replace(f"?{parts.query}", "?" + "&".join(pieces), 1)
    return url


_DROPPED_BY_URLSPLIT = dict.fromkeys(map(ord, "\t\r\n"))
_URL_ERRORS = (("Port", "invalid port"), ("IPv6", "invalid IPv6 address"))


def _check_redis_secrets(routes: Routes) -> None:
    """Where the Redis identity comes from must be unambiguous.

    The password belongs in ``redis_password_file`` or ``redis_password_env`` (SPEC §6); a
    password inside ``redis_url`` is still accepted (``check-config`` redacts it, the feed
    logs a warning) but not together with those keys, because redis-py would silently
    prefer the URL's.
    """
    try:
        urllib.parse.urlsplit(routes.redis_url).port  # noqa: B018 - it raises what is wrong
    except ValueError as exc:  # "Invalid IPv6 URL" for redis://[::1:6379/0 (found by review)
        # Never urllib's text, which quotes what it could not parse: in "redis://user:secret"
        # (the @ forgotten) the "port" is the password, and its netloc check quotes the whole
        # netloc, password included (found by review, twice).
        text = str(exc)
        why = next((w for k, w in _URL_ERRORS if k in text), "not a valid URL")
        raise ConfigError(f"routes.redis_url: {why}") from None
    _check(
        not (routes.redis_password_file and routes.redis_password_env),
        "routes.redis_password_env",
        "set redis_password_file or redis_password_env, not both",
    )
    _check(
        url_password(routes.redis_url) is None
        or not (routes.redis_password_file or routes.redis_password_env),
        "routes.redis_url",
        "holds a password while redis_password_file or redis_password_env is set",
    )
    _check(
        not (urllib.parse.urlsplit(routes.redis_url).username and routes.redis_username),
        "routes.redis_username",
        "redis_url names a user already",
    )
    _check(
        not routes.redis_ca_file or routes.redis_url.startswith("rediss://"),
        "routes.redis_ca_file",
        "needs a rediss:// URL",
    )


def _check_redis_options(url: str) -> None:
    """The URL's options as redis-py takes them when the feed connects (``?socket_timeout=``,
    ``?protocol=``, an option it does not know...): refused there, the feed task died with a
    traceback and relay stayed "not ready" for ever, or the feed failed with a traceback at
    every retry (found by review). A client and a connection object are made here as the
    feed makes them, without I/O; redis-py's messages name the option."""
    from redis.asyncio import Redis  # noqa: PLC0415 - only for source = redis
    from redis.exceptions import RedisError  # noqa: PLC0415

    try:
        pool = Redis.from_url(url, protocol=2).connection_pool
        pool.make_connection()  # type: ignore[no-untyped-call]  # (redis-py leaves it untyped)
    except (ValueError, TypeError, RedisError) as exc:
        raise ConfigError(f"routes.redis_url: redis-py refuses it: {exc}") from None
    except Exception as exc:  # ?retry=x: AttributeError, whatever redis-py trips on
        raise ConfigError(
            f"routes.redis_url: redis-py cannot use it ({type(exc).__name__})"
        ) from None

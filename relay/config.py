"""Strict TOML configuration (SPEC §6): the tables, their keys and defaults.

Each table maps onto a frozen dataclass; the dataclass fields *are* the schema, so a key is
known iff a field of that name exists, and its annotation gives the type checked. Secrets
(TLS key, Redis password) are paths or environment variable names, never inline values.

Reading a file against this schema is :mod:`relay.config_parse`; the value rules beyond types
are :mod:`relay.config_rules`, those of the ``routes.redis_*`` keys :mod:`relay.config_redis`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.core.decide import Settings
from relay.core.routes import Network

MAX_WORKERS = 1024


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


def check(condition: bool, key: str, message: str) -> None:
    """Raise a :class:`ConfigError` naming ``key`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{key}: {message}")


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


# The file's tables: what relay.config_parse reads, and config_sections writes back.
SECTIONS: dict[str, type[Any]] = {
    "listen": Listen,
    "admin": Admin,
    "routing": Routing,
    "routes": Routes,
    "upstream": Upstream,
    "management": Management,
    "process": Process,
}

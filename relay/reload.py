"""SIGHUP: re-read the configuration file and the TLS pair without dropping connections.

Which keys a reload applies is an allow-list (:data:`RELOADABLE`), so a key added later is
restart-only until someone decides otherwise. What a reload cannot apply (listeners, the
admin port, the route source, the source address, the worker count, turning TLS on or off)
is logged as needing a restart and keeps its running value; the rest of the file applies.

The TLS pair is re-read on every SIGHUP, even when its paths did not change (a renewed
certificate is usually written over the old files). A new pair is checked
(:mod:`relay.tlscheck`) before it replaces the old one; a bad one keeps the old and says why.
A new ``routing.domains`` whose wildcards the served certificate would not cover is not
applied either: every TLS handshake for it would fail.

Settings apply to what starts after the reload: new connections, new requests, new
upstream dials. Open connections and streams keep running, with one exception: a client
whose address is no longer in a non-empty ``listen.allowed_clients`` is disconnected, since
that list is an access control.

:func:`plan` is pure (old and new configuration in, the effective one and what changed out).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay.addresses import parse_http_url
from relay.config import Config, ConfigError, networks
from relay.config_parse import load
from relay.core.routes import outside_allowed
from relay.tlscheck import uncovered_domains

if TYPE_CHECKING:
    from relay.runtime import Relay

log = logging.getLogger("relay")

RELOADABLE = frozenset(
    {
        "listen.tls_cert",  # only while TLS stays on (see plan)
        "listen.tls_key",
        "listen.header_timeout_s",
        "listen.max_header_bytes",
        "listen.max_connections",
        "listen.idle_timeout_s",
        "listen.trusted_proxies",
        "listen.allowed_clients",
        "routing.domains",
        "routes.max_stale_s",
        "upstream.envd_port",
        "upstream.credentials",
        "upstream.denied_ports",
        "upstream.allowed_cidrs",
        "upstream.connect_timeout_s",
        "upstream.idle_timeout_s",
        "upstream.max_idle_per_upstream",
        "management.upstream",
        "process.drain_timeout_s",
    }
)
_NOT_SECTIONS = frozenset({"base_dir", "source"})


def flatten(config: Config) -> dict[str, Any]:
    """``{"section.key": value}`` for every key of the configuration."""
    out: dict[str, Any] = {}
    for section in dataclasses.fields(config):
        if section.name in _NOT_SECTIONS:
            continue
        values = getattr(config, section.name)
        for item in dataclasses.fields(values):
            out[f"{section.name}.{item.name}"] = getattr(values, item.name)
    return out


@dataclass(frozen=True, slots=True)
class Plan:
    config: Config  # the configuration to run with
    applied: tuple[str, ...]  # keys whose new value is taken
    restart_needed: tuple[str, ...]  # keys that changed in the file but keep their value


def plan(old: Config, new: Config) -> Plan:
    before, after = flatten(old), flatten(new)
    changed = [key for key in after if before.get(key) != after[key]]
    tls_toggled = bool(old.listen.tls_cert) != bool(new.listen.tls_cert)
    applied = [
        key
        for key in changed
        if key in RELOADABLE and not (tls_toggled and key.startswith("listen.tls_"))
    ]
    return Plan(
        config=with_keys(old, new, applied),
        applied=tuple(applied),
        restart_needed=tuple(k for k in changed if k not in applied),
    )


def with_keys(base: Config, source: Config, keys: list[str] | tuple[str, ...]) -> Config:
    """``base`` with the values of ``keys`` taken from ``source``."""
    by_section: dict[str, dict[str, Any]] = {}
    for key in keys:
        section, _, name = key.partition(".")
        by_section.setdefault(section, {})[name] = getattr(getattr(source, section), name)
    sections = {
        section: dataclasses.replace(getattr(base, section), **values)
        for section, values in by_section.items()
    }
    return dataclasses.replace(base, **sections)


def reload_settings(relay: Relay) -> bool:
    """Re-read the configuration file and the TLS pair; True when everything applied."""
    ok = True
    old = relay.config
    new = old
    if old.source is not None:
        try:
            loaded = load(old.source)
        except ConfigError as exc:
            log.error("config reload failed, keeping the running configuration: %s", exc)
            ok = False
        except Exception:  # a bug in relay's own checks: still a failed reload, not a crash
            log.exception("config reload failed, keeping the running configuration")
            ok = False
        else:
            result = plan(old, loaded)
            if result.restart_needed:
                log.warning(
                    "config reload: %s changed but take(s) effect only on restart",
                    ", ".join(result.restart_needed),
                )
            new = result.config
    if relay.tls is not None:
        new, tls_ok = _reload_tls(relay, old, new)
        ok = ok and tls_ok
    if new is not old:
        applied = [k for k, v in flatten(new).items() if flatten(old)[k] != v]
        apply(relay, new)
        if applied:
            log.info("config reloaded: %s", ", ".join(applied))
    relay.observer.reloads["ok" if ok else "error"] += 1
    return ok


def _reload_tls(relay: Relay, old: Config, new: Config) -> tuple[Config, bool]:
    tls = relay.tls
    assert tls is not None
    cert = str(new.path(new.listen.tls_cert))
    key = str(new.path(new.listen.tls_key))
    try:
        info = tls.reload(new.routing.domains, cert, key)
    except (ConfigError, ssl.SSLError, OSError, ValueError) as exc:
        relay.observer.tls_reloads["error"] += 1
        log.error("TLS reload failed, keeping the current certificate: %s", exc)
        # The files were not taken: keep running with the old paths, and with the old
        # domains if the certificate still served would not cover the new ones.
        kept = ["listen.tls_cert", "listen.tls_key"]
        missing = uncovered_domains(tls.info.dns_names, new.routing.domains)
        if missing and new.routing.domains != old.routing.domains:
            log.error(
                "routing.domains not changed: the served certificate does not cover %s",
                ", ".join(f"*.{d}" for d in missing),
            )
            kept.append("routing.domains")
        return with_keys(new, old, kept), False
    relay.observer.tls_reloads["ok"] += 1
    log.info(
        "TLS certificate loaded: subject=%s serial=%x not_after=%s",
        info.subject,
        info.serial,
        info.not_after.isoformat(),
    )
    return new, True


def apply(relay: Relay, config: Config) -> None:
    """Make ``config`` the running configuration (only reloadable keys may differ)."""
    old, old_cidrs = relay.config, relay.allowed_cidrs
    relay.config = config
    relay.settings = config.settings()
    relay.allowed_cidrs = config.allowed_cidrs()
    relay.feed.allowed = relay.allowed_cidrs  # routes are re-validated by the next load
    if relay.allowed_cidrs != old_cidrs:
        _drop_routes_outside(relay)
    relay.allowed_clients = networks(config.listen.allowed_clients)
    relay.timers.header_timeout_s = config.listen.header_timeout_s
    relay.timers.idle_timeout_s = config.listen.idle_timeout_s
    pool = relay.pool
    pool.connect_timeout_s = config.upstream.connect_timeout_s
    pool.idle_timeout_s = config.upstream.idle_timeout_s
    pool.max_idle_per_key = config.upstream.max_idle_per_upstream
    address = parse_http_url(config.management.upstream) if config.management.upstream else None
    relay.management_address = address or ("", 0)
    if relay.allowed_clients:
        for conn in list(relay.connections):
            if not relay.allowed(conn.peer):
                conn.abort()
    if config.routes.max_stale_s != old.routes.max_stale_s:
        relay.feed.max_stale_s = config.routes.max_stale_s  # a hung Redis: its read timeout
        relay.refresh_feed_state()  # a feed already down may be stale under the new value


def _drop_routes_outside(relay: Relay) -> None:
    """``upstream.allowed_cidrs`` changed: routes now outside it go at once, revoked (SPEC §3:
    a route's address is inside it). Not left to the feed's next load, which keeps the old
    table when the routes file does not parse or Redis is down (found by review)."""
    allowed = relay.allowed_cidrs
    outside = [
        sandbox_id
        for sandbox_id, route in relay.table.routes.items()
        if outside_allowed(ipaddress.ip_address(route.address), allowed) is not None
    ]
    if outside:
        log.warning("%d route(s) outside upstream.allowed_cidrs removed", len(outside))
        relay.apply_routes((), outside, "reload")

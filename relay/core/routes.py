"""Route validation and the route table (SPEC §3).

A route source (file, Redis) hands over parsed JSON; every route is validated on its own, so
one bad route is rejected with its reason while the others apply. The table is an immutable
snapshot: a feed builds a new one and swaps it in, so a request never sees a half-applied
update, and the swap reports which sandboxes were revoked.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from relay.core.model import Route
from relay.core.target import valid_sandbox_id

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_FIELDS = frozenset(
    {
        "sandbox_id",
        "address",
        "envd_token",
        "traffic_token",
        "generation",
        "insecure",
        "max_connections",
    }
)
# 1-512 printable ASCII (SPEC §3), spaces included but not at either end: a field value's
# leading and trailing spaces are not part of it (RFC 9110 §5.5), so no client could send
# such a token (a space inside was refused, found by review).
_TOKEN = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,510}[\x21-\x7e])?")
MAX_GENERATION = 1 << 64


@dataclass(frozen=True, slots=True)
class RouteError:
    """Why one route was rejected; ``sandbox_id`` when it could be read at all."""

    sandbox_id: str | None
    reason: str


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def outside_allowed(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allowed: tuple[Network, ...]
) -> str | None:
    """Why a route may not point at ``ip`` (SPEC §3: inside ``upstream.allowed_cidrs``), or
    None. The feeds and a reload that narrows the CIDRs (relay.reload) ask the same."""
    if not any(ip in net for net in allowed):
        return "address is outside upstream.allowed_cidrs"
    # An IPv4-mapped address (RFC 4291 §2.5.5.2) is dialled on an IPv6 socket that reaches the
    # IPv4 address inside it: "::ffff:169.254.169.254" was inside "::/0", and relay dialled the
    # metadata endpoint (found by review). What it reaches must be allowed too.
    reached = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    if reached is not None and not any(reached in net for net in allowed):
        return f"address reaches {reached}, outside upstream.allowed_cidrs"
    return None


def parse_route(obj: object, allowed: tuple[Network, ...]) -> Route | RouteError:
    """Validate one route object. Unknown fields or a field breaking its rule reject it."""
    if not isinstance(obj, dict):
        return RouteError(None, "a route must be a JSON object")
    raw_id = obj.get("sandbox_id")
    sandbox_id = raw_id if isinstance(raw_id, str) and valid_sandbox_id(raw_id) else None
    if sandbox_id is None:
        return RouteError(None, "sandbox_id must match ^[a-z0-9]{1,64}$")

    def bad(reason: str) -> RouteError:
        return RouteError(sandbox_id, reason)

    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        return bad(f"unknown field(s): {', '.join(map(str, unknown))}")
    address = obj.get("address")
    if not isinstance(address, str):
        return bad("address must be an IPv4 or IPv6 literal")
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return bad("address must be an IPv4 or IPv6 literal")
    if getattr(ip, "scope_id", None) is not None:
        # "fd00::1%<zone>": ipaddress takes any zone text and ``in`` ignores it, and a zone
        # that getaddrinfo cannot encode failed every dial (found by review).
        return bad("address must be an IPv4 or IPv6 literal without a zone (%)")
    outside = outside_allowed(ip, allowed)
    if outside is not None:
        return bad(outside)
    insecure = obj.get("insecure", False)
    if not isinstance(insecure, bool):
        return bad("insecure must be a boolean")
    envd_token = obj.get("envd_token")
    if envd_token is None and not insecure:
        return bad("envd_token is required unless insecure is true")
    for name in ("envd_token", "traffic_token"):
        value = obj.get(name)
        if value is not None and (not isinstance(value, str) or _TOKEN.fullmatch(value) is None):
            return bad(f"{name} must be 1-512 printable ASCII characters")
    traffic_token = obj.get("traffic_token")
    generation = obj.get("generation", 0)
    # SPEC §3 bounds it below only; relay bounds it to an unsigned 64-bit counter (anything a
    # Go, Rust or SQL control plane holds), so that a hostile value of thousands of digits is
    # refused rather than hashed into every pool key and printed in /routes (found by review).
    if not _is_int(generation) or not 0 <= generation < MAX_GENERATION:
        return bad("generation must be an integer from 0 to 2^64-1")
    max_connections = obj.get("max_connections", 0)
    if not _is_int(max_connections) or max_connections < 0:
        return bad("max_connections must be an integer >= 0")
    return Route(
        sandbox_id=sandbox_id,
        address=str(ip),
        envd_token=envd_token,
        traffic_token=traffic_token,
        generation=generation,
        insecure=insecure,
        max_connections=max_connections,
    )


def parse_routes(
    items: Iterable[object],
    allowed: tuple[Network, ...],
    known: Mapping[str, Route] | None = None,
) -> tuple[dict[str, Route], list[RouteError]]:
    """Validate many routes; a later route for the same id replaces an earlier one.

    ``known``: routes validated against the same ``allowed`` before (the routes file's last
    load). An item that says exactly what its id's known route says is that route, without
    parsing its address again: a routes file is read whole at every change, and validating
    100,000 routes afresh took 1.35 s of the event loop, every request waiting and a delete's
    revocation past SPEC §3's 1 s (found by review)."""
    routes: dict[str, Route] = {}
    errors: list[RouteError] = []
    for item in items:
        if known and type(item) is dict and type(sandbox_id := item.get("sandbox_id")) is str:
            same = known.get(sandbox_id)
            if same is not None and _says(item, same):
                routes[same.sandbox_id] = same
                continue
        parsed = parse_route(item, allowed)
        if isinstance(parsed, RouteError):
            errors.append(parsed)
        else:
            routes[parsed.sandbox_id] = parsed
    return routes, errors


def _says(obj: dict[Any, Any], route: Route) -> bool:
    """``parse_route(obj)`` would give ``route``, which it gave for an item like ``obj`` with the
    same ``allowed``: the same fields and values, of the same JSON types (``True`` is not ``1``,
    ``1.0`` not ``1``), the address already in its normal form."""
    return (
        obj.keys() <= _FIELDS
        and obj.get("address") == route.address
        and obj.get("envd_token") == route.envd_token
        and obj.get("traffic_token") == route.traffic_token
        and obj.get("insecure", False) is route.insecure
        and _same_int(obj.get("generation", 0), route.generation)
        and _same_int(obj.get("max_connections", 0), route.max_connections)
    )


def _same_int(value: object, expected: int) -> bool:
    return type(value) is int and value == expected


def revokes(old: Route, new: Route | None) -> bool:
    """Whether replacing ``old`` by ``new`` must end the sandbox's live exchanges.

    SPEC §3 names address, generation and both tokens. ``insecure`` is included too: a
    sandbox turning secure must not keep streams opened without a credential. Only
    ``max_connections`` may change without a revocation.
    """
    if new is None:
        return True
    return (
        old.address != new.address
        or old.generation != new.generation
        or old.envd_token != new.envd_token
        or old.traffic_token != new.traffic_token
        or old.insecure != new.insecure
    )


@dataclass(frozen=True, slots=True)
class RouteTable:
    """An immutable snapshot of all routes, keyed by sandbox id."""

    routes: Mapping[str, Route] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, routes: Mapping[str, Route]) -> RouteTable:
        return cls(MappingProxyType(dict(routes)))

    def get(self, sandbox_id: str) -> Route | None:
        return self.routes.get(sandbox_id)

    def __len__(self) -> int:
        return len(self.routes)

    def replace(self, new: Mapping[str, Route]) -> tuple[RouteTable, frozenset[str]]:
        """The table holding exactly ``new``, and the ids whose exchanges must end."""
        revoked = frozenset(sid for sid, old in self.routes.items() if revokes(old, new.get(sid)))
        return RouteTable.of(new), revoked

    def apply(
        self, puts: Iterable[Route] = (), deletes: Iterable[str] = ()
    ) -> tuple[RouteTable, frozenset[str]]:
        """The table after a batch of puts and deletes (applied in that order).

        Only the touched ids are compared, so a feed applying a few updates to a table of
        100,000 routes pays for one dict copy, not a full diff.
        """
        updated = dict(self.routes)
        touched: set[str] = set()
        for route in puts:
            updated[route.sandbox_id] = route
            touched.add(route.sandbox_id)
        for sid in deletes:
            updated.pop(sid, None)
            touched.add(sid)
        revoked = frozenset(
            sid
            for sid in touched
            if (old := self.routes.get(sid)) is not None and revokes(old, updated.get(sid))
        )
        return RouteTable(MappingProxyType(updated)), revoked


def public_view(route: Route) -> dict[str, Any]:
    """What the admin API and ``relay routes list`` may show: no token, ever."""
    return {
        "sandbox_id": route.sandbox_id,
        "address": route.address,
        "generation": route.generation,
        "insecure": route.insecure,
        "max_connections": route.max_connections,
        "has_traffic_token": route.traffic_token is not None,
    }

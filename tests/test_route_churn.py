"""Replacing every route, again and again, keeps no old route alive.

bench/route_feed.py saw relay's RSS rise from ~120 to ~170-180 MiB after every one of 100,000
routes was replaced and stay there. This test tells a leak from the allocator: it traces the
Python heap (tracemalloc) while a relay applies full replacements in feed-sized batches, as the
Redis feed does, and requires the live heap to stay flat from one round to the next. A route
(or anything keyed by one: decision memory, revocation bookkeeping) kept per replacement would
add several MiB per round here.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

from relay.config_parse import parse
from relay.core.model import Route
from relay.core.routes import RouteError, parse_route
from relay.runtime import Relay

ROUTES = 5_000
BATCH = 500  # routes per feed batch, as bench/route_feed.py publishes them


def _routes(relay: Relay, generation: int) -> list[Route]:
    out = []
    for i in range(ROUTES):
        route = parse_route(
            {
                "sandbox_id": f"m{i:08d}",
                "address": f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}",
                "envd_token": f"envd-{generation}-{i:032d}",
                "traffic_token": f"traffic-{generation}-{i:032d}",
                "generation": generation,
            },
            relay.allowed_cidrs,
        )
        assert not isinstance(route, RouteError)
        out.append(route)
    return out


def _replace_all(relay: Relay, generation: int) -> None:
    routes = _routes(relay, generation)
    for start in range(0, ROUTES, BATCH):
        relay.apply_routes(routes[start : start + BATCH], (), "test")


def test_full_replacements_keep_the_live_heap_flat(tmp_path: Path) -> None:
    (tmp_path / "routes.json").write_text('{"routes": []}')
    config = parse(
        {"routing": {"domains": ["sandbox.localhost"]}, "routes": {"file": "routes.json"}},
        tmp_path,
    )
    relay = Relay(config)
    relay.install_routes({r.sandbox_id: r for r in _routes(relay, 1)}, "test")
    tracemalloc.start()
    try:
        _replace_all(relay, 2)  # the first round may settle caches sized by the table
        gc.collect()
        after_first = tracemalloc.get_traced_memory()[0]
        for generation in (3, 4, 5):
            _replace_all(relay, generation)
        gc.collect()
        after_more = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(relay.table) == ROUTES
    route = relay.table.get("m00000007")
    assert route is not None
    assert route.generation == 5
    # One round's routes are a few MiB (5,000 routes with two tokens each): a leak of the
    # replaced routes would show three times that. Allow 0.5 MiB for interpreter noise.
    assert after_more - after_first < 512 * 1024, (after_first, after_more)

"""Admin endpoints added to the relay's admin app: ``/metrics`` and ``/routes`` (SPEC §7).

``/healthz`` and ``/readyz`` stay in :mod:`relay.runtime`. ``/routes`` shows what
:func:`relay.core.routes.public_view` allows (ids, addresses, generations; never a token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from relay import metrics
from relay.core.routes import public_view

if TYPE_CHECKING:
    from relay.runtime import Relay


def add_routes(app: web.Application, relay: Relay) -> None:
    registry = metrics.registry_for(metrics.RelayCollector(relay))

    async def metrics_handler(_request: web.Request) -> web.Response:
        body = metrics.exposition(registry)
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    async def routes_handler(_request: web.Request) -> web.Response:
        table = relay.table
        routes = [public_view(table.routes[sid]) for sid in sorted(table.routes)]
        return web.json_response({"count": len(routes), "routes": routes})

    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/routes", routes_handler)

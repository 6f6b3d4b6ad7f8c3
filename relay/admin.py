"""Admin endpoints (SPEC §7): a relay's ``/metrics`` and ``/routes``, and the supervisor's.

A single relay (or a worker) adds ``/metrics`` and ``/routes`` here; its ``/healthz`` and
``/readyz`` stay in :mod:`relay.runtime`. ``/routes`` shows what
:func:`relay.core.routes.public_view` allows (ids, addresses, generations; never a token).

With ``process.workers > 1`` the supervisor (``relay.workers``) answers on the admin port:
``/readyz`` asks every worker's ``/readyz`` over its Unix socket and is 200 only when every
running worker is ready; ``/routes`` is the first answering worker's (all follow the same
feed); ``/metrics`` merges the workers' snapshot files and adds the supervisor's own families.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from relay import metrics
from relay.core.routes import public_view
from relay.lifecycle import admin_socket

if TYPE_CHECKING:
    from relay.runtime import Relay
    from relay.worker_processes import Worker
    from relay.workers import Supervisor

ADMIN_QUERY_TIMEOUT_S = 1.0  # the supervisor's wait for one worker's admin answer
Handler = Callable[[web.Request], Awaitable[web.Response]]


class _MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse at ERROR with a traceback whose exception quotes
    the offending line: a credential in it (an ``Authorization`` line with a space before its
    colon, a token in a bad request line) reached the log (SPEC §2: never in a log line;
    found by review). Such a request is the client's error, told 400 already: one line at
    INFO, as nginx's "client sent invalid request", naming only the exception's kind."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "admin: malformed request from %s refused: %d %s"
            record.args = (peer, exc.code, type(exc).__name__)
            record.exc_info = record.exc_text = None
            if record.levelno > logging.INFO:  # (aiohttp's DEBUG for a bad method stays)
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


SERVER_LOG = logging.getLogger("relay.admin")
SERVER_LOG.addFilter(_MalformedRequests())


def runner(app: web.Application) -> web.AppRunner:
    """The admin port's server: no access log, no signal handlers, parse errors quiet."""
    return web.AppRunner(app, access_log=None, handle_signals=False, logger=SERVER_LOG)


def add_routes(app: web.Application, relay: Relay) -> None:
    registry = metrics.registry_for(metrics.RelayCollector(relay))

    async def routes_handler(_request: web.Request) -> web.Response:
        table = relay.table
        routes = [public_view(table.routes[sid]) for sid in sorted(table.routes)]
        return web.json_response({"count": len(routes), "routes": routes})

    app.router.add_get("/metrics", _metrics_handler(registry))
    app.router.add_get("/routes", routes_handler)


def _metrics_handler(registry: CollectorRegistry) -> Handler:
    async def handler(_request: web.Request) -> web.Response:
        try:
            body = metrics.exposition(registry)
        except OSError as exc:
            # The supervisor's merge reads the workers' snapshot files; at its descriptor
            # limit (EMFILE) aiohttp logged a traceback per scrape and answered 500. A failed
            # scrape, not a partial one: sums without a worker go backwards.
            SERVER_LOG.warning("/metrics: cannot read the workers' metrics: %s", exc.strerror)
            message = f"cannot read the workers' metrics: {exc.strerror}"
            return web.json_response({"code": 503, "message": message}, status=503)
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    return handler


# -- the supervisor's admin port ----------------------------------------------------------------
def add_supervisor_routes(app: web.Application, supervisor: Supervisor) -> None:
    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        workers = supervisor.workers
        answers = await asyncio.gather(*(_ask(supervisor, w, "/readyz") for w in workers))
        states = [
            {
                "index": w.index,
                "pid": w.pid,
                "ready": answer is not None and answer[0] == 200,
                "restarts": w.restarts,
            }
            for w, answer in zip(workers, answers, strict=True)
        ]
        # A worker waiting to be restarted holds no listening socket, so it takes no traffic:
        # the relay is ready when every running worker is (and one at least runs).
        running = [w for w in states if w["pid"] is not None]
        draining = supervisor.draining
        ready = not draining and bool(running) and all(w["ready"] for w in running)
        body = {"ready": ready, "draining": draining, "workers": states}
        return web.json_response(body, status=200 if ready else 503)

    async def routes(_request: web.Request) -> web.Response:
        for worker in supervisor.workers:
            answer = await _ask(supervisor, worker, "/routes")
            if answer is not None and answer[0] == 200:
                return web.Response(body=answer[1], content_type="application/json")
        return web.json_response({"code": 503, "message": "no worker answered"}, status=503)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/routes", routes)
    app.router.add_get("/metrics", _metrics_handler(metrics.registry_for(Merged(supervisor))))


async def _ask(supervisor: Supervisor, worker: Worker, path: str) -> tuple[int, bytes] | None:
    """GET ``path`` from a worker's admin socket; None when it does not answer."""
    if worker.pid is None:
        return None
    connector = aiohttp.UnixConnector(path=str(admin_socket(supervisor.run_dir, worker.index)))
    timeout = aiohttp.ClientTimeout(total=ADMIN_QUERY_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.get(f"http://worker{path}") as response,
        ):
            return response.status, await response.read()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None


class Merged(Collector):
    """relay_* over all workers' snapshot files, plus the supervisor's own families."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        sup = self.supervisor
        snaps = metrics.read_snapshots(sup.run_dir / "metrics")
        live = sup.live_pids()
        yield from metrics.families(
            list(snaps.values()), [s for p, s in snaps.items() if p in live]
        )
        workers = GaugeMetricFamily("relay_workers", "Worker processes, by state", labels=["state"])
        workers.add_metric(["configured"], len(sup.workers))
        workers.add_metric(["running"], len(live))
        workers.add_metric(["ready"], sum(1 for w in sup.workers if w.ready))
        yield workers
        restarts = CounterMetricFamily("relay_worker_restarts", "Workers restarted after dying")
        restarts.add_metric([], sum(w.restarts for w in sup.workers))
        yield restarts

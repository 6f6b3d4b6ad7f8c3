"""The running relay: listeners, admin endpoints, start and stop; a worker's relay.

``serve → start → (signals) → drain → stop`` reads top to bottom in :func:`serve`.
:class:`Relay` is the hub the adapters share: its base :class:`relay.hub.Hub` owns the route
table snapshot and the feed's freshness, hands ``decide`` its inputs, and keeps an index of
live exchanges and WebSocket splices per sandbox (``relay.inflight``) so that a revoked route
ends them at once (SPEC §3). This module adds what starts and stops it: the data listeners
(plain or TLS), the admin app with ``/healthz`` and ``/readyz``, the periodic sweep, SIGHUP's
reload, and the stop. :class:`WorkerRelay` is a supervisor's worker's relay (``relay.workers``),
whose ``max_connections`` counts the exchanges of every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from aiohttp import web

from relay import admin, netlink
from relay.accesslog import ACCESS_LOG
from relay.addresses import authority, split_address
from relay.config import Config
from relay.core.model import Forward, Reason, Route
from relay.handshake import TlsAccept
from relay.hub import Hub
from relay.inflight import Live, SharedInflight
from relay.reload import reload_settings
from relay.room import descriptor_mark, soft_limit
from relay.server import ClientConnection
from relay.sharedcount import FILE_NAME, SharedCounts
from relay.startup import binding, check_parsers
from relay.systemd import start_loop_threads
from relay.tls import ReloadableContext
from relay.upstream_conn import keep_alive_probes

log = logging.getLogger("relay")

SWEEP_INTERVAL_S = 0.25  # header timeouts, idle upstreams, and the access-log buffer


class Relay(Hub):
    """A relay as it runs: :class:`relay.hub.Hub`'s state, started and stopped here."""

    # -- the periodic sweep -----------------------------------------------------------------------
    async def _sweeper(self) -> None:
        # Each step guarded: a bug that raises in one is logged and the next sweep runs. The
        # task ending stopped every client deadline and the pool's sweep in the worker for
        # good (found by review; relay.timers guards each connection's deadline too).
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            for step in (self.timers.sweep, self.pool.sweep, ACCESS_LOG.flush):
                try:
                    step()
                except Exception:
                    log.exception("internal error in the periodic sweep")

    # -- start and stop ---------------------------------------------------------------------------
    async def start(self) -> None:
        check_parsers()
        loop = asyncio.get_running_loop()
        self.outbox.bind(loop.call_soon)
        listen = self.config.listen
        # Checked over netlink: a wrong source address stops relay here (relay.netlink).
        self.pool.source_address = await netlink.resolve_source_async(self.config.upstream)
        self.room_mark = descriptor_mark(soft_limit())
        if listen.tls_cert:
            initial, self.initial_tls = self.initial_tls, None
            try:
                self.tls = ReloadableContext(
                    str(self.config.path(listen.tls_cert)),
                    str(self.config.path(listen.tls_key)),
                    self.config.routing.domains,  # checked by relay.tlscheck
                    load_from=initial,
                )
            finally:
                for path in initial or ():
                    path.unlink(missing_ok=True)
        # On a TLS listener the handshake runs after admission, from the protocol (relay.handshake).
        factory: Callable[[], asyncio.Protocol] = (
            (lambda: TlsAccept(self)) if self.tls else (lambda: ClientConnection(self, tls=False))
        )
        for address in listen.addresses:
            parsed = split_address(address)
            assert parsed is not None
            host, port = parsed
            with binding("listen.address", host, port):
                server = await loop.create_server(
                    factory,
                    host,
                    port,
                    reuse_address=True,
                    reuse_port=self.config.process.workers > 1,
                    backlog=4096,
                )
            self._servers.append(server)
            for sock in server.sockets:
                keep_alive_probes(sock)  # inherited by each accepted connection
                name = sock.getsockname()
                self.bound.append((name[0], name[1]))
        self.spawn(self.feed.run())
        self.spawn(self._sweeper())
        await self._start_admin()
        admin = self.admin_bound
        log.info(
            "relay listening on %s (admin %s)",
            ", ".join(authority(h, p) for h, p in self.bound),
            authority(*admin) if admin else "through the supervisor",
        )

    async def _start_admin(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        admin.add_routes(app, self)  # /metrics, /routes
        runner = admin.runner(app)
        await runner.setup()
        self._admin = runner
        if self.admin_socket is not None:  # a worker: its supervisor owns admin.address
            await web.UnixSite(runner, self.admin_socket).start()
            return
        parsed = split_address(self.config.admin.address)
        assert parsed is not None
        site = web.TCPSite(runner, parsed[0], parsed[1], reuse_address=True)
        with binding("admin.address", parsed[0], parsed[1]):
            await site.start()
        server = site._server
        if server is not None and server.sockets:  # type: ignore[attr-defined]
            name = server.sockets[0].getsockname()  # type: ignore[attr-defined]
            self.admin_bound = (name[0], name[1])

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def ready(self) -> bool:
        return self.feed_state.ready and not self.feed_state.stale and not self.draining

    async def _readyz(self, _request: web.Request) -> web.Response:
        body = {
            "ready": self.ready(),
            "routes": len(self.table),
            "stale": self.feed_state.stale,
            "draining": self.draining,
        }
        return web.json_response(body, status=200 if self.ready() else 503)

    def reload(self) -> None:
        """SIGHUP: the configuration, the TLS certificate (both in ``relay.reload``) and the
        routes file, without dropping connections."""
        log.info("reload requested")
        try:
            reload_settings(self)
        finally:
            self.feed.load()  # SPEC §7: the routes file too, whatever became of the config

    def stop_accepting(self) -> None:
        """Close the data listeners (drain); accepted connections keep running."""
        for server in self._servers:
            server.close()

    async def stop(self) -> None:
        # uvloop may have accepted sockets whose connection_made is still queued: closing the
        # listeners does not cancel those calls, so they see this flag (review of 39856e1).
        self.stopped = True
        ACCESS_LOG.flush()
        for server in self._servers:
            server.close()
        for item in [i for items in self.live.values() for i in items]:
            item.revoke(Reason.DRAINING)
        for handshake in list(self.handshakes):
            handshake.abort()
        for conn in list(self.connections):
            conn.close_now()
        self.pool.close_all()
        self.outbox.unbind()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._admin is not None:
            await self._admin.cleanup()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        # Blocks the loop for at most accesslog.EXIT_WAIT_S, with nothing left to serve: a
        # stalled standard output does not keep relay from exiting (relay.accesswriter).
        ACCESS_LOG.finish()


class WorkerRelay(Relay):
    """A supervisor's worker (``process.workers > 1``): a route's ``max_connections`` counts
    the exchanges of every worker, through the supervisor's shared table (SPEC §5a; each
    worker counted only its own, found by review). A class of its own so that a single
    relay's register and unregister, on every request's path, stay exactly as they are (one
    more attribute on Relay also slowed every attribute read of it: CPython shares an
    instance's keys only up to 30 of them)."""

    inflight: SharedInflight

    def __init__(
        self,
        config: Config,
        shared: SharedCounts,
        *,
        initial_tls: tuple[Path, Path] | None = None,
    ) -> None:
        super().__init__(config, initial_tls=initial_tls)
        self.inflight = SharedInflight(self.live, shared)

    # Relay's two, and the shared count (a worker's cost only: one more call per exchange).
    def register(self, item: Live) -> None:
        super().register(item)
        decision = item.decision
        # Only exchanges to a sandbox with a limit touch the shared table.
        if isinstance(decision, Forward) and decision.target is not None:
            route = decision.route
            if route is not None and route.max_connections:
                self.inflight.count(item, decision.target.sandbox_id)

    def unregister(self, item: Live) -> None:
        super().unregister(item)
        if self.inflight.counted:
            self.inflight.release(item)  # what register counted, and only that

    # A route's max_connections may change without a revocation (relay.core.routes.revokes):
    # the exchanges a sandbox had in flight while it had no limit are in this worker's live
    # index, which is what it counts itself, but were not in the shared table, and the other
    # workers let `limit` more through on top of them (found by review). They are counted
    # once the route has a limit: a table change is no request's path.
    def install_routes(self, routes: dict[str, Route], source: str) -> None:
        super().install_routes(routes, source)
        self._count_limited(list(self.live))

    def apply_routes(self, puts: Iterable[Route], deletes: Iterable[str], source: str) -> None:
        puts = list(puts)
        super().apply_routes(puts, deletes, source)
        self._count_limited([route.sandbox_id for route in puts])

    def _count_limited(self, sandbox_ids: Iterable[str]) -> None:
        table, live, inflight = self.table, self.live, self.inflight
        for sandbox_id in sandbox_ids:
            items = live.get(sandbox_id)
            route = table.get(sandbox_id) if items else None
            if route is not None and route.max_connections:
                for item in list(items or ()):
                    inflight.count(item, sandbox_id)


async def serve(config: Config, tls_files: tuple[Path, Path] | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain; SIGHUP reloads (``relay.lifecycle``).
    ``tls_files``: a restarted worker's copy of the pair its siblings serve, loaded instead
    of the configured files and then deleted (``relay.worker_config``)."""
    from relay.lifecycle import Lifecycle  # noqa: PLC0415 - lifecycle builds on this module

    await start_loop_threads(asyncio.get_running_loop())  # first: relay.systemd says why
    await Lifecycle(_relay(config, tls_files, os.environ)).run()


def _relay(config: Config, tls_files: tuple[Path, Path] | None, env: Mapping[str, str]) -> Relay:
    """A single relay's Relay, or a worker's WorkerRelay on its supervisor's shared table."""
    from relay.lifecycle import WorkerEnv  # noqa: PLC0415 - lifecycle builds on this module

    worker = WorkerEnv.from_env(env)
    if worker is None:
        return Relay(config, initial_tls=tls_files)
    try:
        shared = SharedCounts(worker.run_dir / FILE_NAME, worker.index)
    except (OSError, ValueError) as exc:
        # Not a reason to stop serving (a restarted worker would only loop on it): the
        # limit then holds per worker, as the error says.
        log.error("max_connections is counted in this worker alone: %s", exc)
        return Relay(config, initial_tls=tls_files)
    return WorkerRelay(config, shared, initial_tls=tls_files)

"""The running relay: listeners, route table, live exchanges, revocation, admin endpoints.

``serve → start → (signals) → drain → stop`` reads top to bottom in :func:`serve`. The
:class:`Relay` object is the hub the adapters share: it owns the route table snapshot and the
feed's freshness, hands ``decide`` its inputs, and keeps an index of live exchanges and
WebSocket splices per sandbox so that a revoked route ends them at once (SPEC §3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from relay import admin, netlink
from relay.accesslog import ACCESS_LOG
from relay.addresses import authority, parse_http_url, split_address
from relay.config import Config, in_networks, networks
from relay.core import failures
from relay.core.decide import FeedState, Settings
from relay.core.feed import freshness
from relay.core.model import Decision, Forward, Reason, Reject, RequestHead, Route
from relay.core.routes import RouteError, RouteTable
from relay.decisions import DecisionMemory
from relay.feeds import open_feed
from relay.handshake import TlsAccept
from relay.observe import Observer
from relay.outbox import Outbox
from relay.reload import reload_settings
from relay.room import descriptor_mark, make_room, soft_limit
from relay.server import ClientConnection
from relay.sharedcount import FILE_NAME, SharedCounts
from relay.startup import binding, check_parsers
from relay.timers import Timers
from relay.tls import ReloadableContext
from relay.upstreams import Pool, keep_alive_probes

log = logging.getLogger("relay")

SWEEP_INTERVAL_S = 0.25  # header timeouts, idle upstreams, and the access-log buffer


class Live(Protocol):
    """An exchange or splice that a revocation can end."""

    @property
    def decision(self) -> Decision | None: ...

    def revoke(self, answer: Reason) -> bool:
        """End it now, answering ``answer`` if no response has started; False if it had
        already ended (nothing to count)."""
        ...


class Inflight(Mapping[str, int]):
    """In-flight exchanges per sandbox (SPEC §5a ``max_connections``), read off the live
    index: the count is the size of the sandbox's set, so registering an exchange keeps one
    structure, not a set and a counter."""

    __slots__ = ("_live",)

    def __init__(self, live: dict[str, set[Live]]) -> None:
        self._live = live

    def __getitem__(self, sandbox_id: str) -> int:
        return len(self._live[sandbox_id])

    def get(self, sandbox_id: str, default: int = 0) -> int:  # type: ignore[override]
        items = self._live.get(sandbox_id)
        return default if items is None else len(items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)


class SharedInflight(Inflight):
    """A worker's count for ``decide``: its own exchanges (exact, as in a single relay) plus
    the other workers' (``relay.sharedcount``: an estimate that is never too low). It also
    keeps which live items this worker added to the shared table, with the sandbox each was
    counted for, so that what an item added is what its end takes away."""

    __slots__ = ("_shared", "counted")

    def __init__(self, live: dict[str, set[Live]], shared: SharedCounts) -> None:
        super().__init__(live)
        self._shared = shared
        self.counted: dict[Live, str] = {}

    def __getitem__(self, sandbox_id: str) -> int:
        return self.get(sandbox_id)

    def get(self, sandbox_id: str, default: int = 0) -> int:  # type: ignore[override]
        # decide() asks only about a sandbox whose route has a limit.
        return super().get(sandbox_id, default) + self._shared.others(sandbox_id)

    def count(self, item: Live, sandbox_id: str) -> None:
        """``item``, to a sandbox whose route has a limit, is in flight in this worker."""
        if item not in self.counted:
            self.counted[item] = sandbox_id
            self._shared.add(sandbox_id)

    def release(self, item: Live) -> None:
        sandbox_id = self.counted.pop(item, None)
        if sandbox_id is not None:
            self._shared.take(sandbox_id)


class Relay:
    def __init__(self, config: Config, *, initial_tls: tuple[Path, Path] | None = None) -> None:
        self.config = config
        # A restarted worker's copy of the TLS pair its siblings serve: loaded by start()
        # instead of the configured files, then deleted (relay.worker_config).
        self.initial_tls = initial_tls
        self._decisions = DecisionMemory()
        self._settings = config.settings()
        self.allowed_cidrs = config.allowed_cidrs()
        self.allowed_clients = networks(config.listen.allowed_clients)
        self._table = RouteTable()
        self._feed_state = FeedState(ready=False)
        self.observer = Observer()
        self.outbox = Outbox()  # bound to the loop in start()
        self.pool = Pool(
            outbox=self.outbox,
            connect_timeout_s=config.upstream.connect_timeout_s,
            idle_timeout_s=config.upstream.idle_timeout_s,
            max_idle_per_key=config.upstream.max_idle_per_upstream,
            source_address=config.upstream.source_address or None,
            observer=self.observer,
        )
        self.timers = Timers(config.listen.header_timeout_s, config.listen.idle_timeout_s)
        self.connections: set[ClientConnection] = set()
        # Connections (client, TLS handshake, upstream) from which an accept closes idle
        # ones (relay.room); set from the soft RLIMIT_NOFILE at start.
        self.room_mark = sys.maxsize
        self.handshakes: set[TlsAccept] = set()  # TLS connections still in their handshake
        self.live: dict[str, set[Live]] = {}
        self.inflight: Inflight = Inflight(self.live)
        self.draining = False
        self.stopped = False  # stop() ran: a connection accepted just before is turned away
        self.management_address: tuple[str, int] = ("", 0)
        if config.management.upstream:
            parsed = parse_http_url(config.management.upstream)
            assert parsed is not None  # validated with the config
            self.management_address = parsed
        self.tls: ReloadableContext | None = None
        self._broken_since: float | None = None  # stale clock (see feed_broken)
        self._stale_timer: asyncio.TimerHandle | None = None
        self.feed = open_feed(self, config)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._admin: web.AppRunner | None = None
        self.bound: list[tuple[str, int]] = []  # data listener addresses, once bound
        self.admin_bound: tuple[str, int] | None = None
        self.admin_socket: str | None = None  # a worker's admin app listens here instead

    # -- decisions ----------------------------------------------------------------------------
    # -- the inputs of decide(); changing one forgets every remembered decision ------------
    @property
    def table(self) -> RouteTable:
        return self._table

    @table.setter
    def table(self, table: RouteTable) -> None:
        self._table = table
        self._decisions.forget()

    @property
    def feed_state(self) -> FeedState:
        return self._feed_state

    @feed_state.setter
    def feed_state(self, state: FeedState) -> None:
        self._feed_state = state
        self._decisions.forget()

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self._settings = settings
        self._decisions.forget()

    def decide(self, head: RequestHead) -> Decision:
        """``relay.core.decide`` for this relay, remembered (``relay.decisions``)."""
        shortcut = head.decided  # DecisionMemory's shortcut, checked here without a call
        if shortcut is not None and shortcut[0] is self._decisions.epoch and not self.draining:
            return shortcut[1]
        if self.draining:
            return Reject(reason=Reason.DRAINING, retry_after=failures.DRAINING_RETRY_AFTER_S)
        return self._decisions.decide(
            head, self._table, self._settings, self._feed_state, self.inflight
        )

    def allowed(self, peer: str) -> bool:
        """``listen.allowed_clients`` (empty: everyone)."""
        return not self.allowed_clients or in_networks(peer, self.allowed_clients)

    def admit(self, conn: ClientConnection) -> bool:
        """Admission of a new client connection; False when it was turned away."""
        if self.stopped or not self.allowed(conn.peer):
            assert conn.transport is not None
            conn.transport.abort()
            return False
        # TLS connections still in their handshake count too (relay.handshake).
        busy = len(self.connections) + len(self.handshakes)
        if busy >= self.config.listen.max_connections or self.draining:
            conn.overloaded = True
        self.connections.add(conn)
        if busy + self.pool.opened >= self.room_mark:
            self.make_room()
        return True

    def make_room(self) -> None:
        """Near the open-file limit: close idle keep-alive connections (relay.room)."""
        make_room(self.timers, self.pool, self.observer)

    def release_connection(self, conn: ClientConnection) -> None:
        self.connections.discard(conn)

    # -- live exchanges and revocation ----------------------------------------------------------
    def register(self, item: Live) -> None:
        sandbox_id = _sandbox_of(item)
        if sandbox_id is None:
            return
        # get, not setdefault: no empty set is built per request for a sandbox that has one.
        items = self.live.get(sandbox_id)
        if items is None:
            items = self.live[sandbox_id] = set()
        items.add(item)

    def unregister(self, item: Live) -> None:
        sandbox_id = _sandbox_of(item)
        if sandbox_id is None:
            return
        items = self.live.get(sandbox_id)
        if items is None or item not in items:
            return
        items.discard(item)
        if not items:
            del self.live[sandbox_id]

    def revoke(self, sandbox_ids: frozenset[str]) -> int:
        # Two phases: every revoked sandbox's pool is purged and its live set taken before any
        # item is ended. Ending one can start the next request queued on its client connection
        # (a Connect stream ends cleanly and keeps the connection), which is decided under the
        # new table: it must neither get an idle connection of another revoked sandbox's old
        # route (SPEC §3: "no pooled upstream connection of the old route is reused") nor be
        # ended as if it were in flight under the old route (found by review).
        table = self.table  # the new one: a sandbox still in it had its route changed
        items = [
            (item, Reason.NOT_FOUND if table.get(sandbox_id) is None else Reason.ROUTE_CHANGED)
            for sandbox_id in sandbox_ids
            for item in self.live.get(sandbox_id, ())
        ]
        for sandbox_id in sandbox_ids:
            self.pool.purge(sandbox_id)
        ended = sum(item.revoke(answer) for item, answer in items)
        self.observer.revoked(sandbox_ids, ended)
        return ended

    # -- route feed sink ------------------------------------------------------------------------
    def install_routes(self, routes: dict[str, Route], source: str) -> None:
        table, revoked = self.table.replace(routes)
        self.table = table
        self.observer.routes_installed(source, len(table))
        if not self.feed_state.ready or self.feed_state.stale:
            self.feed_state = FeedState(ready=True, stale=False)
            log.info("route table ready: %d route(s) from %s", len(table), source)
        if revoked:
            self.revoke(revoked)

    def reject_routes(self, errors: list[RouteError], source: str) -> None:
        self.observer.rejected_routes(source, errors)

    def feed_failed(self, source: str, message: str) -> None:
        self.observer.feed_error(source, message)

    def apply_routes(self, puts: Iterable[Route], deletes: Iterable[str], source: str) -> None:
        """A batch of changes from a following feed, swapped in at once (no request sees
        half of it); what it changed is revoked (SPEC §3)."""
        table, revoked = self.table.apply(puts, deletes)
        self.table = table
        if revoked:
            self.revoke(revoked)

    def feed_broken(self, since: float) -> None:
        """The feed lost its source; ``since`` (monotonic) starts the stale clock."""
        if self._broken_since is None:
            self._broken_since = since
        failing = self.observer.feed_failing_since
        if failing is None or since < failing:
            # relay_feed_staleness_seconds counts from the stale clock's start: feed_failed,
            # called first, set it to when the failure was noticed (a hung Redis ~6 s after
            # its last good read), and the gauge lagged the stale flag (found by review).
            self.observer.feed_failing_since = since
        self.refresh_feed_state()

    def feed_restored(self) -> None:
        """The feed is back and resynced (after ``install_routes``): the clock stops."""
        self._broken_since = None
        self.observer.feed_failing_since = None
        self.refresh_feed_state()

    def refresh_feed_state(self) -> None:
        """Recompute ``feed_state`` now and arm a timer for the moment it turns stale."""
        if self._stale_timer is not None:
            self._stale_timer.cancel()
            self._stale_timer = None
        max_stale_s = self.config.routes.max_stale_s
        now = time.monotonic()
        state = freshness(
            ready=self.feed_state.ready,
            broken_since=self._broken_since,
            now=now,
            max_stale_s=max_stale_s,
        )
        if state != self.feed_state:
            if state.stale:
                # "Behind", not "down": the clock also runs while a resync or a catch-up of
                # several reads is under way on a link that works (relay.feeds.redis).
                log.error(
                    "route cache is stale: no up-to-date read from the route feed for over %.0fs",
                    max_stale_s,
                )
            self.feed_state = state
        if self._broken_since is not None and state.ready and not state.stale:
            delay = max(0.0, self._broken_since + max_stale_s - now)
            loop = asyncio.get_running_loop()
            self._stale_timer = loop.call_later(delay, self.refresh_feed_state)

    # -- tasks ----------------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

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


def _sandbox_of(item: Live) -> str | None:
    decision = item.decision
    if isinstance(decision, Forward) and decision.target is not None:
        return decision.target.sandbox_id
    return None


async def serve(config: Config, tls_files: tuple[Path, Path] | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain; SIGHUP reloads (``relay.lifecycle``).
    ``tls_files``: a restarted worker's copy of the pair its siblings serve, loaded instead
    of the configured files and then deleted (``relay.worker_config``)."""
    from relay.lifecycle import Lifecycle  # noqa: PLC0415 - lifecycle builds on this module

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

"""The relay's shared state, and what requests and route feeds call on it.

:class:`Hub` is the base of :class:`relay.runtime.Relay`, the object the adapters share. It
holds the route table snapshot and the feed's freshness and hands ``decide`` its inputs
(remembering decisions until one of them changes, ``relay.decisions``); admits client
connections (``listen.allowed_clients``, ``listen.max_connections``, room below the
descriptor limit); keeps the live index of exchanges and WebSocket splices per sandbox
(``relay.inflight``) so that a revoked route ends them at once (SPEC §3); takes what the route
feed delivers (``relay.feeds.sink``) and runs the stale clock; and runs background tasks.
``relay.runtime`` adds how the relay starts and stops.

``__init__`` sets every field of a relay, those start and stop use too: one place to see that a
relay keeps within the 30 attributes whose keys CPython shares between instances (see
``relay.runtime.WorkerRelay``). Methods here are found through the class's method cache like
the subclass's own: the split costs a request no extra call.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from relay.addresses import parse_http_url
from relay.config import Config, in_networks, networks
from relay.core import failures
from relay.core.decide import FeedState, Settings
from relay.core.feed import freshness
from relay.core.model import Decision, Reason, Reject, RequestHead, Route
from relay.core.routes import RouteError, RouteTable
from relay.decisions import DecisionMemory
from relay.feeds import open_feed
from relay.inflight import Inflight, Live, sandbox_of
from relay.observe import Observer
from relay.outbox import Outbox
from relay.room import make_room
from relay.timers import Timers
from relay.upstreams import Pool

if TYPE_CHECKING:
    from relay.handshake import TlsAccept
    from relay.server import ClientConnection
    from relay.tls import ReloadableContext

log = logging.getLogger("relay")


class Hub:
    """A relay's state and its request and feed side (see the module docstring)."""

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
            if not self.stopped:
                self.observer.connections_reset["not_allowed"] += 1
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
        sandbox_id = sandbox_of(item)
        if sandbox_id is None:
            return
        # get, not setdefault: no empty set is built per request for a sandbox that has one.
        items = self.live.get(sandbox_id)
        if items is None:
            items = self.live[sandbox_id] = set()
        items.add(item)

    def unregister(self, item: Live) -> None:
        sandbox_id = sandbox_of(item)
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

"""Upstream pools: idle keep-alive connections per destination, and the dial of a new one.

relay does not use an HTTP client library upstream. A pooled raw connection
(:class:`relay.upstream_conn.UpstreamConnection`), with the request head written once and the
response framed by llhttp (``httptools``), costs a fraction of the CPU of
``aiohttp.ClientSession`` per request (see ``bench/README.md``); the exchange that owns a
connection (``relay.forward``, reading responses with ``relay.response``) does the HTTP work.
What a dial retries and what its failure means is ``relay.dial``'s.

Pools are keyed by (sandbox id, generation, address, port) as E2B's orchestrator proxy keys
them by sandbox lifecycle id: a guest address reused by another sandbox, or by a new execution
of the same one, never inherits a connection of the old one (SPEC §4).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import resource
import time
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING

from relay.addresses import authority, family_mismatch
from relay.closing import unsent
from relay.core.model import PoolKey
from relay.dial import (
    DESCRIPTORS,
    EXHAUSTED_LOG_S,
    PORTS,
    RETRY_DELAYS_S,
    SOURCE_PORTS,
    DialError,
    shortage,
)
from relay.outbox import Outbox
from relay.sourcebind import BindError, dial_from
from relay.timers import CLOSE_GRACE_S
from relay.upstream_conn import UpstreamConnection

if TYPE_CHECKING:
    from relay.dial import DialObserver

__all__ = ["Pool", "PoolKey"]

log = logging.getLogger("relay.upstream")


def _made(made: list[UpstreamConnection], conn: UpstreamConnection) -> UpstreamConnection:
    made.append(conn)
    return conn


class Pool:
    """Idle keep-alive connections per :class:`PoolKey`, reused last-in first-out."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        idle_timeout_s: float = 630.0,
        max_idle_per_key: int = 256,
        source_address: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: DialObserver | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        self.observer = observer
        self.outbox = outbox or Outbox()  # the relay's, so both sides share one per turn
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_key = max_idle_per_key
        self.source_address = source_address or None
        self._clock = clock
        self._idle: dict[PoolKey, list[UpstreamConnection]] = {}
        # Closed with bytes still queued (UpstreamConnection.close), for the sweep: what was
        # left to take at the close or the upstream's last progress, and when.
        self._closing: dict[UpstreamConnection, tuple[int, float]] = {}
        self.opened = 0  # open upstream connections, idle or in use
        self._shortage_logged: dict[str, float] = {}  # shortage → when it was last logged

    def acquire(self, key: PoolKey, max_idle_s: float = 0.0) -> UpstreamConnection | None:
        """The most recently released live connection for ``key``, or None (dial one).

        ``max_idle_s`` (0: any): a connection idle for longer is closed instead of taken (see
        relay.forward.UNSAFE_REUSE_IDLE_S). It is the newest, so the rest are older still, but
        they stay for requests that may take them; closing the one keeps the pool from growing
        by a connection per such request.
        """
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not idle:
                del self._idle[key]
            transport = conn.transport
            if not conn.closed and transport is not None and not transport.is_closing():
                if max_idle_s and self._clock() - conn.idle_since > max_idle_s:
                    conn.close()
                    return None
                conn.uses += 1
                return conn
            idle = self._idle.get(key)
        return None

    def release(self, conn: UpstreamConnection) -> None:
        """Return a connection whose last exchange ended cleanly."""
        conn.owner = None
        if conn.closed:
            return
        idle = self._idle.get(conn.key)
        if idle is None:  # not setdefault: that builds a list on every release
            idle = self._idle[conn.key] = []
        if len(idle) >= self.max_idle_per_key:
            conn.close()
            return
        conn.idle_since = self._clock()
        if conn.read_paused:
            conn.resume_reading()  # an idle connection must see the upstream's EOF
        idle.append(conn)

    def closing_slowly(self, conn: UpstreamConnection) -> None:
        self._closing[conn] = (unsent(conn.transport), self._clock())

    def forget(self, conn: UpstreamConnection) -> None:
        """The connection is gone (``connection_lost``)."""
        if self._closing:
            self._closing.pop(conn, None)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]

    def purge(self, sandbox_id: str) -> int:
        """Close every idle connection of a sandbox (all generations): it was revoked."""
        keys = [k for k in self._idle if k.sandbox_id == sandbox_id]
        closed = 0
        for key in keys:
            for conn in self._idle.pop(key):
                conn.close()
                closed += 1
        return closed

    def sweep(self) -> None:
        """Close connections idle for longer than the upstream keep-alive timeout; abort
        those still draining their write buffer when the upstream took none of it for
        ``CLOSE_GRACE_S``. Not a grace from the close: an app that reads a WebSocket's last
        frames steadily but slowly lost their tail, its Close frame included (found by review;
        as nginx's ``proxy_send_timeout``, the wait runs between two reads of the peer). What
        is left counts the kernel's queue, where the user-space buffer moves only in bursts."""
        if self._closing:
            now = self._clock()
            for conn, (before, since) in list(self._closing.items()):
                transport = conn.transport
                left = unsent(transport)
                if transport is None:
                    del self._closing[conn]
                elif not left:
                    del self._closing[conn]
                    transport.close()  # all of it reached the upstream: nothing left to lose
                elif left < before:
                    self._closing[conn] = (left, now)
                elif now - since >= CLOSE_GRACE_S:
                    del self._closing[conn]
                    transport.abort()
        cutoff = self._clock() - self.idle_timeout_s
        for key in list(self._idle):
            idle = self._idle[key]
            expired = [c for c in idle if c.idle_since < cutoff]
            for conn in expired:
                idle.remove(conn)
                conn.close()
            if not idle:
                del self._idle[key]

    def close_oldest_idle(self, most: int) -> int:
        """Close up to ``most`` idle connections, the longest idle first, whatever their
        upstream; how many (relay.room: near the open-file limit)."""
        if not self._idle:
            return 0
        idle = [conn for conns in self._idle.values() for conn in conns]
        oldest = heapq.nsmallest(most, idle, key=attrgetter("idle_since"))
        for conn in oldest:
            self.forget(conn)
            conn.close()
        return len(oldest)

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def close_all(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    async def connect(self, key: PoolKey) -> UpstreamConnection:
        """Dial, retrying a refused connect (SPEC §4); raises :class:`DialError`.

        From ``source_address`` when set: relay makes the socket, binds it with
        ``IP_BIND_ADDRESS_NO_PORT`` and lets connect pick the port per destination
        (relay.sourcebind). uvloop's ``create_connection(local_addr=(source, 0))`` took a port
        free towards every destination at once, so all the upstream connections of a host,
        TIME_WAITs included, shared one ``ip_local_port_range`` (found by review). Without a
        source, uvloop's own dial.
        """
        loop = asyncio.get_running_loop()
        source = self.source_address
        attempts = len(RETRY_DELAYS_S) + 1
        observer = self.observer
        made: list[UpstreamConnection] = []  # the protocol create_connection makes, if any
        for attempt in range(attempts):
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    try:
                        if not source:
                            _, conn = await loop.create_connection(
                                lambda: _made(made, UpstreamConnection(self, key)),
                                key.address,
                                key.port,
                            )
                        else:
                            conn = await dial_from(
                                loop,
                                lambda: _made(made, UpstreamConnection(self, key)),
                                key.address,
                                key.port,
                                source,
                            )
                    except BaseException:
                        # Cancelled (the client left, or the timeout) once connection_made
                        # had run but before this task resumed: uvloop's create_connection
                        # closes the socket itself (``tr._close()``) and connection_lost never
                        # comes, so the connection would stay counted open for ever.
                        for orphan in made:
                            orphan.closed = True
                            orphan.uncount()
                        raise
                conn.uses = 1
                if observer is not None:
                    observer.dial_done(time.monotonic() - started)
                return conn
            except ConnectionRefusedError:
                if attempt + 1 == attempts:
                    if observer is not None:
                        observer.dial_failed("refused")
                    raise DialError("connection refused", refused=True) from None
                await asyncio.sleep(RETRY_DELAYS_S[attempt])
            except TimeoutError:
                if observer is not None:
                    observer.dial_failed("timeout")
                raise DialError("connect timed out", refused=False) from None
            except OSError as exc:
                if observer is not None:
                    observer.dial_failed("error")
                message = exc.strerror or type(exc).__name__
                short = shortage(exc.errno, source, at_bind=isinstance(exc, BindError))
                if short is not None:
                    message = self._log_shortage(short, message, key)
                reason = family_mismatch(source, key.address)
                raise DialError(reason or message, refused=False, shortage=short) from None
            except ValueError as exc:  # an address getaddrinfo cannot take (UnicodeError)
                if observer is not None:
                    observer.dial_failed("error")
                raise DialError(type(exc).__name__, refused=False) from None
        raise AssertionError("unreachable")

    def _log_shortage(self, short: str, message: str, key: PoolKey) -> str:
        """The access log's reason for a dial that ``short`` failed; and one warning per
        shortage per :data:`EXHAUSTED_LOG_S` naming it: at the limit every request fails so,
        hundreds of lines a second."""
        source = self.source_address
        if short == DESCRIPTORS:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            why = f"{message.lower()} (descriptor limit {soft})"
        elif short == PORTS:
            why = f"no local port left towards {authority(key.address, key.port)}"
            message = f"{message}: {why}"
        elif short == SOURCE_PORTS:
            towards = authority(key.address, key.port)
            why = f"no local port left on upstream.source_address {source} towards {towards}"
            message = f"{message}: {why}"
        else:
            why = f"upstream.source_address {source} is not assigned to any local interface"
            message = f"{message}: {why}"
        now = time.monotonic()
        if now - self._shortage_logged.get(short, -EXHAUSTED_LOG_S) >= EXHAUSTED_LOG_S:
            self._shortage_logged[short] = now
            log.warning("upstream dials fail: %s; answering 503 until that changes", why)
        return message

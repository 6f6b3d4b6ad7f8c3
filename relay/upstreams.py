"""Upstream connections: a raw asyncio protocol per TCP connection, pooled per destination.

relay does not use an HTTP client library upstream. A pooled raw connection, with the request
head written once and the response framed by llhttp (``httptools``), costs a fraction of the
CPU of ``aiohttp.ClientSession`` per request (see ``bench/README.md``); the exchange that owns a
connection (``relay.forward``, reading responses with ``relay.response``) does the HTTP work.

Pools are keyed by (sandbox id, generation, address, port) as E2B's orchestrator proxy keys
them by sandbox lifecycle id: a guest address reused by another sandbox, or by a new execution
of the same one, never inherits a connection of the old one (SPEC §4).
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import logging
import resource
import socket
import time
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol, cast

from relay.addresses import authority, family_mismatch
from relay.closing import unsent
from relay.core.model import PoolKey
from relay.outbox import Outbox
from relay.sourcebind import BindError, dial_from
from relay.timers import CLOSE_GRACE_S

if TYPE_CHECKING:
    from relay.response import ResponseReader

__all__ = ["DialError", "Pool", "PoolKey", "UpstreamConnection"]

log = logging.getLogger("relay.upstream")

# SPEC §4 / E2B's SandboxProxyRetries: envd's port forwarding can lag the route by up to 1 s.
RETRY_DELAYS_S = (0.1, 0.2, 0.3, 0.4)

# TCP keepalive on every connection relay holds, both sides: probes after 15 s of silence, every
# 15 s, 9 unanswered ones end it (Go's net defaults, so E2B's proxy and envd's own listener do
# the same). SPEC §4 sets no read timeout on an established exchange (commands run for hours),
# so a peer that vanished without a FIN or RST (a guest or a laptop gone, a NAT entry dropped)
# would otherwise hold its exchange, its upstream connection and its sandbox's in-flight slot
# until something is written to it. Probed, it is ended after ~150 s.
KEEPALIVE_OPTIONS = (
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 15),
    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 15),
    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 9),
)


# A socket relay could not make for want of its own resources, not the upstream's: its
# descriptor limit (EMFILE, RLIMIT_NOFILE), the system's (ENFILE), kernel memory. Answered 503
# (relay.core.failures.unreachable), and logged at most once per EXHAUSTED_LOG_S: at the limit
# every request fails so, hundreds of lines a second.
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
EXHAUSTED_LOG_S = 10.0

# What a dial ran short of when it failed for want of relay's own resources (DialError.shortage).
DESCRIPTORS = "descriptors"  # EXHAUSTED
PORTS = "ports"  # no local port left towards this address and port: connect's EADDRNOTAVAIL
SOURCE_PORTS = "source ports"  # none of source_address's left towards it: connect's EADDRNOTAVAIL
SOURCE_GONE = "source address"  # bind(source_address): EADDRNOTAVAIL, no interface has it


def shortage(code: int | None, source: str | None, *, at_bind: bool = False) -> str | None:
    """What relay ran short of, from a failed dial's errno, or None when the failure says
    something about the upstream (refused, unreachable) or the route (a family mismatch).

    A local port or address is relay's host's, not the guest's: nothing was sent to the
    guest, so "port is not open" (502) blamed it wrongly, as for EMFILE. Connect picks a
    port free towards this destination alone, with a source address too (relay.sourcebind
    binds it with IP_BIND_ADDRESS_NO_PORT), and fails with EADDRNOTAVAIL when none is
    (checked in a network namespace with a 4-port range). ``at_bind``: the bind to the source
    address failed (relay.sourcebind.BindError): EADDRNOTAVAIL there means no interface has
    the address; EADDRINUSE, that a kernel without IP_BIND_ADDRESS_NO_PORT (before Linux 4.2)
    found no port of it free towards every destination (TIME_WAIT included).

    =============  ===========  ============  ============
    errno          no source    source: bind  connect
    =============  ===========  ============  ============
    EMFILE, ...    DESCRIPTORS  DESCRIPTORS   DESCRIPTORS
    EADDRNOTAVAIL  PORTS        SOURCE_GONE   SOURCE_PORTS
    EADDRINUSE     None         SOURCE_PORTS  None
    =============  ===========  ============  ============
    """
    if code in EXHAUSTED:
        return DESCRIPTORS
    if not source:
        return PORTS if code == errno.EADDRNOTAVAIL else None
    if at_bind and code == errno.EADDRNOTAVAIL:
        return SOURCE_GONE
    if at_bind and code == errno.EADDRINUSE:
        return SOURCE_PORTS
    return SOURCE_PORTS if code == errno.EADDRNOTAVAIL else None


def keep_alive_probes(sock: socket.socket) -> None:
    """Turn on :data:`KEEPALIVE_OPTIONS`. Set on a listening socket, Linux copies them to every
    connection it accepts (the listener's socket is cloned), so the client side pays nothing
    per connection; tests/test_listeners.py reads them back from accepted ones."""
    for level, option, value in KEEPALIVE_OPTIONS:
        sock.setsockopt(level, option, value)


class Owner(Protocol):
    """What an upstream connection reports to the exchange currently using it."""

    def upstream_data(self, data: bytes) -> None: ...
    def upstream_eof(self) -> None: ...
    def upstream_lost(self, exc: Exception | None) -> None: ...
    def upstream_pause_writing(self) -> None: ...
    def upstream_resume_writing(self) -> None: ...


class DialObserver(Protocol):
    """Metrics hook (``relay.observe.Observer``): connect time and failures."""

    def dial_done(self, seconds: float) -> None: ...
    def dial_failed(self, reason: str) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    __slots__ = (
        "closed",
        "counted",
        "idle_since",
        "key",
        "owner",
        "pool",
        "read_paused",
        "reader",
        "transport",
        "uses",
        "write_paused",
    )

    def __init__(self, pool: Pool, key: PoolKey) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.owner: Owner | None = None
        self.idle_since = 0.0
        self.closed = False
        self.counted = False  # in pool.opened: from connection_made to uncount()
        self.write_paused = False  # the transport's buffer is over its high-water mark
        self.read_paused = False  # pause_reading() was called last (release undoes it)
        self.uses = 0
        # llhttp's reader of this connection's responses, made by its first exchange and
        # handed from one exchange to the next (relay.forward.Exchange._attach): responses on
        # a keep-alive connection are one stream of messages, as llhttp sees them.
        self.reader: ResponseReader | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast("asyncio.Transport", transport)
        transport = self.transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive_probes(sock)
        self.counted = True
        self.pool.opened += 1

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return  # closed with bytes still on their way to it (close): what it sends is dropped
        if self.owner is not None:
            self.owner.upstream_data(data)
        else:
            self.close()  # an idle connection must not talk: it cannot be reused safely

    def eof_received(self) -> bool:
        self.pool.outbox.flush()  # uvloop closes the transport on return: held bytes first
        if self.owner is not None and not self.closed:  # closed: read on only to drop (close)
            self.owner.upstream_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        self.uncount()
        owner, self.owner = self.owner, None
        if owner is not None:
            owner.upstream_lost(exc)
        self.drop_reader()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.owner is not None:
            self.owner.upstream_pause_writing()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.owner is not None:
            self.owner.upstream_resume_writing()

    def uncount(self) -> None:
        """Leave ``pool.opened``, once: from ``connection_lost``, or from a dial cancelled
        after ``connection_made`` (``Pool.connect``), where uvloop never calls it."""
        if self.counted:
            self.counted = False
            self.pool.opened -= 1

    # -- used by exchanges
    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.pool.outbox.write(self.transport, data)

    def writelines(self, parts: list[bytes]) -> None:
        assert self.transport is not None
        self.pool.outbox.writelines(self.transport, parts)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Close once what was written has reached the upstream, or it took none of it for
        ``CLOSE_GRACE_S``.

        ``transport.close()`` waits for the write buffer to drain, for ever if the upstream
        never reads (uvloop has no close timeout): an app that answered without reading its
        request, or hangs, would keep the socket and its buffer. So a close with bytes still
        queued is aborted by the pool's sweep once the upstream took none of them for the grace
        period. Until then the bytes still go out: a WebSocket's last frames, its Close frame
        included. They go out before a half-close (a FIN), and relay goes on reading, and
        dropping, what the upstream sends meanwhile: ``transport.close()`` stops reading, and a
        socket closed with unread bytes is reset, which discards what the kernel had not sent
        yet (RFC 9293 §3.6.1; found by review: an app streaming frames to its client lost the
        client's last frames and its Close frame). The sweep closes it once all of it reached
        the upstream, or the upstream's own close does.
        """
        self.pool.outbox.flush()  # what was written before the close goes out before it
        transport = self.transport
        if transport is not None and not self.closed:
            self.closed = True
            if unsent(transport):
                transport.write_eof()  # sent once the buffer is
                if self.read_paused:
                    self.read_paused = False
                    transport.resume_reading()  # to drop what comes, and see its close
                self.pool.closing_slowly(self)
            else:
                transport.close()
        self.drop_reader()

    def abort(self) -> None:
        self.pool.outbox.flush()
        if self.transport is not None:
            self.closed = True
            self.transport.abort()
        self.drop_reader()

    def drop_reader(self) -> None:
        """No more responses will be read here (closed, or spliced after a 101): break
        reader ↔ parser, so both are freed by reference counting at once."""
        reader, self.reader = self.reader, None
        if reader is not None:
            reader.parser = None


def _made(made: list[UpstreamConnection], conn: UpstreamConnection) -> UpstreamConnection:
    made.append(conn)
    return conn


class DialError(Exception):
    """The upstream could not be reached; ``refused`` when it actively refused; ``shortage``
    (:func:`shortage`) when relay ran out of its own descriptors, ports or source address."""

    def __init__(self, message: str, *, refused: bool, shortage: str | None = None) -> None:
        super().__init__(message)
        self.refused = refused
        self.shortage = shortage

    @property
    def exhausted(self) -> bool:
        """relay's own resources failed it: answered 503 overloaded, not 502 port_closed."""
        return self.shortage is not None


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

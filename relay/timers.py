"""Header, idle and closing deadlines of client connections (SPEC §5a), swept by one task.

``listen.header_timeout_s`` bounds the wait for a request head (slowloris), from the first
byte of each request; ``listen.idle_timeout_s`` closes a kept-alive connection with no
request in flight; a connection relay is closing but whose peer does not read is aborted
after a grace period; a client relay has stopped reading is asked every
:data:`PEER_CHECK_S` whether it is still there (``ClientConnection.check_peer``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("relay.server")

CLOSE_GRACE_S = 5.0
# While relay does not read a client (its upstream takes no more of the body, or a pipelined
# request waits), the event loop does not watch that socket, so a reset goes unnoticed for as
# long as the pause lasts: with no read or write timeout on an exchange (SPEC §4), hours.
PEER_CHECK_S = 2.0


class Waiting(Protocol):
    """What the sweep does to a connection (``relay.server.ClientConnection``)."""

    def head_timed_out(self) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...

    def close_expired(self) -> None: ...

    def check_peer(self) -> None: ...


class Timers:
    """Header and idle deadlines for every client connection, swept by one periodic task.

    Each dict maps a connection to the time its wait *started*, in insertion order, so the
    oldest entries expire first and a sweep stops at the first live one. One task scanning a
    few expired entries costs less than a ``TimerHandle`` per connection.

    The timeout is applied when sweeping, not stored per entry: a SIGHUP that changes
    ``header_timeout_s`` or ``idle_timeout_s`` (relay/reload.py assigns them in place) holds
    for every connection at once, measured from when its wait started — a lowered timeout
    closes the connections that already waited longer at the next sweep, a raised one gives
    the waiting ones the longer time. Storing deadlines instead would break the sweep's
    ordering: after a lowered timeout, new short deadlines would sit behind older long ones
    and be honoured only up to the old timeout later. Nothing is rewritten on a reload and the
    sweep still costs one comparison per expired entry plus one.
    """

    def __init__(
        self,
        header_timeout_s: float,
        idle_timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._head: dict[Waiting, float] = {}
        self._idle: dict[Waiting, float] = {}
        self._closing: dict[Waiting, float] = {}
        self._paused: dict[Waiting, float] = {}

    def expect_head(self, conn: Waiting) -> None:
        self._idle.pop(conn, None)
        self._head.pop(conn, None)
        self._head[conn] = self._clock()

    def busy(self, conn: Waiting) -> None:
        """A whole request head arrived at once: no wait of either kind runs on."""
        self._head.pop(conn, None)
        self._idle.pop(conn, None)

    def head_done(self, conn: Waiting) -> None:
        self._head.pop(conn, None)

    def expect_idle(self, conn: Waiting) -> None:
        self._idle.pop(conn, None)
        self._idle[conn] = self._clock()

    def now(self) -> float:
        """The timers' clock (``time.monotonic``, or a test's)."""
        return self._clock()

    def close_deadline(self, conn: Waiting) -> None:
        """A closing connection whose peer does not read gets aborted after a grace period."""
        self._head.pop(conn, None)
        self._idle.pop(conn, None)
        self._closing.pop(conn, None)  # restarted (a lingering close): to the end of the order
        self._closing[conn] = self._clock()

    def paused(self, conn: Waiting) -> None:
        """relay stopped reading ``conn``: its peer is checked in PEER_CHECK_S."""
        self._paused.pop(conn, None)
        self._paused[conn] = self._clock()

    def resumed(self, conn: Waiting) -> None:
        self._paused.pop(conn, None)

    def close_idle(self, most: int) -> int:
        """Close up to ``most`` connections waiting idle, the longest idle first; how many
        (relay.room: near the open-file limit). Those waiting here have no request in flight,
        no WebSocket (``start_splice`` forgets them) and no head begun (``expect_head``)."""
        idle = list(itertools.islice(self._idle, most))
        for conn in idle:
            del self._idle[conn]
            _guarded(conn, conn.close)
        return len(idle)

    def forget(self, conn: Waiting) -> None:
        self._head.pop(conn, None)
        self._idle.pop(conn, None)
        self._closing.pop(conn, None)
        self._paused.pop(conn, None)

    def sweep(self) -> None:
        now = self._clock()
        for conn in _expired(self._head, now - self.header_timeout_s):
            _guarded(conn, conn.head_timed_out)
        for conn in _expired(self._idle, now - self.idle_timeout_s):
            _guarded(conn, conn.close)
        for conn in _expired(self._closing, now - CLOSE_GRACE_S):
            _guarded(conn, conn.close_expired)
        for conn in _expired(self._paused, now - PEER_CHECK_S):
            _guarded(conn, conn.check_peer)  # which calls paused() again while the pause lasts


def _guarded(conn: Waiting, deadline: Callable[[], None]) -> None:
    """One connection's deadline; a bug in it ends that connection, not the sweep.

    An exception here used to leave ``sweep`` and end the sweeping task: from then on no
    header, idle or closing deadline and no pool sweep ran in that worker (found by review:
    a 408 written after a FIN raised). It is logged as the bug it is, and the connection
    is cut."""
    try:
        deadline()
    except Exception:
        log.exception("internal error in a client connection's deadline")
        with contextlib.suppress(Exception):
            conn.abort()


def _expired(started: dict[Waiting, float], cutoff: float) -> list[Waiting]:
    """Remove and return the entries whose wait started at or before ``cutoff``."""
    out = []
    for conn, start in started.items():
        if start > cutoff:
            break
        out.append(conn)
    for conn in out:
        del started[conn]
    return out

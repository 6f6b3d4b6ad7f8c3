"""Header, idle and closing deadlines of client connections (SPEC §5a), swept by one task.

``listen.header_timeout_s`` bounds the wait for a request head (slowloris), from the first
byte of each request; ``listen.idle_timeout_s`` closes a kept-alive connection with no
request in flight; a connection relay is closing but whose peer does not read is aborted
after a grace period.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay.server import ClientConnection


class Timers:
    """Header and idle deadlines for every client connection, swept by one periodic task.

    Deadlines are kept in insertion-ordered dicts; since every entry of a dict gets the same
    timeout, the oldest entries expire first and a sweep stops at the first live one. One
    task scanning a few expired entries costs less than a ``TimerHandle`` per connection.
    """

    def __init__(self, header_timeout_s: float, idle_timeout_s: float) -> None:
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._head: dict[ClientConnection, float] = {}
        self._idle: dict[ClientConnection, float] = {}
        self._closing: dict[ClientConnection, float] = {}

    def expect_head(self, conn: ClientConnection) -> None:
        self._idle.pop(conn, None)
        self._head.pop(conn, None)
        self._head[conn] = time.monotonic() + self.header_timeout_s

    def head_done(self, conn: ClientConnection) -> None:
        self._head.pop(conn, None)

    def expect_idle(self, conn: ClientConnection) -> None:
        self._idle.pop(conn, None)
        self._idle[conn] = time.monotonic() + self.idle_timeout_s

    def close_deadline(self, conn: ClientConnection) -> None:
        """A closing connection whose peer does not read gets aborted after a grace period."""
        self._head.pop(conn, None)
        self._idle.pop(conn, None)
        self._closing[conn] = time.monotonic() + 5.0

    def forget(self, conn: ClientConnection) -> None:
        self._head.pop(conn, None)
        self._idle.pop(conn, None)
        self._closing.pop(conn, None)

    def sweep(self) -> None:
        now = time.monotonic()
        for conn in _expired(self._head, now):
            conn.head_timed_out()
        for conn in _expired(self._idle, now):
            conn.close()
        for conn in _expired(self._closing, now):
            conn.abort()


def _expired(deadlines: dict[ClientConnection, float], now: float) -> list[ClientConnection]:
    out = []
    for conn, deadline in deadlines.items():
        if deadline > now:
            break
        out.append(conn)
    for conn in out:
        del deadlines[conn]
    return out

"""What the fake envd's RPC services share: the per-call context and envd's keepalive ticker."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from tests.support.connect import JSONDict
from tests.support.sandbox_fs import SandboxUser

# permissions/keepalive.go: defaultKeepAliveInterval.
DEFAULT_KEEPALIVE_S = 90.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One RPC as a service sees it."""

    method: str  # "/process.Process/Start"
    headers: Mapping[str, str]  # case-insensitive view of the request headers
    user: SandboxUser  # from Basic auth, else envd's default user
    timeout_s: float | None  # Connect-Timeout-Ms, None when absent or 0
    keepalive_s: float  # Keepalive-Ping-Interval


Send = Callable[[JSONDict], Awaitable[None]]
# A unary method may be a coroutine function or, for quick synchronous work, a plain function.
UnaryMethod = Callable[[Call, JSONDict], Awaitable[JSONDict] | JSONDict]
StreamMethod = Callable[[Call, JSONDict, Send], Awaitable[None]]


def keepalive_interval(header: str | None) -> float:
    """keepalive.go GetKeepAliveTicker: integer seconds from the header, else 90 s.

    Go's strconv.Atoi accepts a sign ("+5", "-5"); time.NewTicker panics on a non-positive
    interval, which would crash envd. The fake uses the default instead and tests that need
    that edge should not rely on it.
    """
    if header is None or not re.fullmatch(r"[+-]?[0-9]+", header):
        return DEFAULT_KEEPALIVE_S
    seconds = int(header)
    return float(seconds) if seconds > 0 else DEFAULT_KEEPALIVE_S


class KeepaliveTicker:
    """A ticker that fires every ``interval`` and is pushed back by each data event.

    envd sends a keepalive event when its ticker fires and calls ``resetKeepalive()`` after each
    data event it sends (process/start.go, process/connect.go, filesystem/watch.go).
    """

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self._next = self._loop.time() + interval

    def remaining(self) -> float:
        return max(0.0, self._next - self._loop.time())

    def reset(self) -> None:
        self._next = self._loop.time() + self._interval

    def fired(self) -> None:
        # A Go ticker keeps its phase; if the consumer fell behind, missed ticks are dropped.
        self._next += self._interval
        now = self._loop.time()
        if self._next <= now:
            self._next = now + self._interval

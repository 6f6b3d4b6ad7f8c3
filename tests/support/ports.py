"""Free loopback TCP ports for servers that a test starts in another process.

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default). Between that probe socket's close
and the child's own ``bind``, any outgoing connection on the machine (an SDK's, relay's own
upstream dial, another test's) may take the same port as its local port, and the child's
``bind`` then fails with EADDRINUSE: CI saw that once, in the SDK matrix, which starts many
relays at the same time. So ports come from below the ephemeral range, where the kernel never
picks one on its own; each is handed out once per process (threads start relays in parallel),
and one that something already holds is skipped.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from pathlib import Path

_LOCK = threading.Lock()
_GIVEN: set[int] = set()
_SPAN = 12_000  # ports in the pool: more than a whole test run asks for
_DEFAULT_EPHEMERAL = (32768, 60999)
# A start that differs between processes keeps two test runs on one machine apart.
_RANDOM = random.Random(os.getpid())


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    with contextlib.suppress(OSError, ValueError):
        low, high = (int(part) for part in path.read_text().split())
        return low, high
    return _DEFAULT_EPHEMERAL


def pool(ephemeral: tuple[int, int]) -> range:
    """The ports to pick from: below the ephemeral range, else above it."""
    low, high = ephemeral
    if low - _SPAN >= 1024:
        return range(low - _SPAN, low)
    if high + _SPAN <= 65535:
        return range(high + 1, high + 1 + _SPAN)
    return range(1024, 65536)  # the whole range is ephemeral: nothing better to do


def _unused(port: int) -> bool:
    # No SO_REUSEADDR: a port with a TIME_WAIT or a live connection on it is skipped too.
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    candidates = pool(ephemeral_range())
    with _LOCK:
        for _ in range(1000):
            port = _RANDOM.choice(candidates)
            if port not in _GIVEN and _unused(port):
                _GIVEN.add(port)
                return port
    raise RuntimeError(f"no free port in {candidates}")

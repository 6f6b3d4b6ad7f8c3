"""SIGTERM: drain in-flight work, then cut what is left (SPEC §7).

1. ``/readyz`` turns 503 and requests on kept-alive connections are answered 503
   ``draining`` (``Relay.draining``), at once.
2. The listening sockets close, so new connections are refused by the kernel: a load
   balancer's next health check or connect fails fast instead of hanging.
3. Idle kept-alive connections are closed as soon as they are idle (checked every 100 ms);
   in-flight exchanges, streams and WebSockets carry on for up to ``process.drain_timeout_s``.
4. Then each remaining WebSocket gets a 1001 "going away" Close frame both ways
   (``Splice.going_away``) and each remaining exchange is cut: answered 503 if nothing was
   sent yet, else ended the way a revocation ends it (a Connect stream gets its end-of-stream
   frame, any other body is visibly truncated).

A second SIGTERM or SIGINT skips the rest of the wait (step 4 at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from relay.core.model import Reason

if TYPE_CHECKING:
    from relay.runtime import Relay
    from relay.server import ClientConnection

POLL_S = 0.1
FLUSH_S = 1.0  # time given to the last close frames and answers to reach the peers


def busy(conn: ClientConnection) -> bool:
    # A rest of a sliced read (relay.slices) may hold requests relay has not parsed yet; a head
    # llhttp began is a request in flight too, answered (503 "draining") rather than closed
    # under the client (found by review; nginx too closes only connections waiting for a
    # request's first byte). header_timeout_s bounds how long it may take.
    return (
        conn.active is not None
        or conn.splice is not None
        or bool(conn.queue or conn.unparsed)
        or conn.head_begun
    )


def close_idle(relay: Relay) -> int:
    """Close connections with nothing in flight; the number still busy."""
    still = 0
    for conn in list(relay.connections):
        if busy(conn):
            still += 1
        else:
            conn.close()
    return still


def cut_remaining(relay: Relay) -> int:
    """End every WebSocket (1001) and exchange still running; how many were ended. An
    exchange relay already answered (still dropping a refused body) is not counted and keeps
    its reason (found by review; the same path as a revocation's, ``revoke``)."""
    ended = 0
    for conn in list(relay.connections):
        item = conn.splice or conn.active
        if item is not None and item.revoke(Reason.DRAINING):
            ended += 1
        conn.close()
    return ended


async def drain(
    relay: Relay,
    timeout_s: float,
    *,
    force: asyncio.Event | None = None,
    report: Callable[[str], object] = lambda _text: None,
) -> int:
    """Drain ``relay``; returns the number of exchanges and WebSockets that had to be cut."""
    relay.draining = True
    relay.stop_accepting()
    force = force or asyncio.Event()
    deadline = time.monotonic() + timeout_s
    reported = 0.0
    while True:
        still = close_idle(relay)
        remaining = deadline - time.monotonic()
        if not still or remaining <= 0 or force.is_set():
            break
        if time.monotonic() - reported >= 1.0:
            report(f"draining: {still} connection(s) in flight, {remaining:.0f}s left")
            reported = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(force.wait(), min(POLL_S, remaining))
    ended = cut_remaining(relay) if still else 0
    flush_until = time.monotonic() + FLUSH_S
    while relay.connections and time.monotonic() < flush_until:  # noqa: ASYNC110 - no event
        await asyncio.sleep(0.02)
    return ended

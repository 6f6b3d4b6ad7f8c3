"""Room for new connections near the open-file limit: idle keep-alive connections are closed.

A keep-alive client holds its descriptor for up to ``listen.idle_timeout_s`` (hundreds of
seconds) between requests, and an idle pooled upstream connection for up to
``upstream.idle_timeout_s``. At ``RLIMIT_NOFILE`` libuv sheds every new accept (the client
sees a close without an answer) and dials fail with EMFILE (503), while those idle ones keep
the slots (found by review). nginx closes its "reusable" connections then
(``ngx_drain_connections``, up to 32 at a time, when free connections run short); so does
relay, on two events:

* an accept that brings the connections relay holds (clients, TLS handshakes, upstreams)
  to :func:`descriptor_mark` of the soft limit: one integer comparison per accept, and the
  rest only past it (``Relay.admit``, ``TlsAccept``);
* a dial that failed for want of descriptors (``relay.upstream_side``): the limit was lowered, or
  something else holds them.

Each event closes up to :data:`SHED_PER_EVENT` idle clients (the longest idle first: those
``relay.timers`` holds for their idle deadline, with no request in flight, no WebSocket and
no stream) and as many idle pooled upstream connections (oldest first), and counts them in
``relay_idle_connections_shed_total``. A client whose next request crosses the close sees
what an idle timeout gives it (RFC 9112 §9.3.1: a client retries a request on a reused
connection closed before any answer).
"""

from __future__ import annotations

import resource
import sys
from typing import Protocol

# nginx's bound per event (ngx_drain_connections); it is also what a burst may take at once.
SHED_PER_EVENT = 32
# Descriptors kept free below the soft limit: relay's own (listeners, the loop's, libuv's
# spare, the feed's, admin connections, log and snapshot files) and a burst of accepts that
# arrives before the closes free theirs (a close frees its descriptor a loop turn later).
RESERVE = 64


def descriptor_mark(soft: int) -> int:
    """Connections (client, in a TLS handshake, upstream) from which accepts make room:
    ``soft`` less a reserve of a sixteenth (nginx's free-connection threshold) or
    :data:`RESERVE`, whichever is larger, but never below half of it. Read at start: a
    limit lowered later is met by the dial event alone."""
    if soft == resource.RLIM_INFINITY:
        return sys.maxsize
    return max(soft // 2, soft - max(RESERVE, soft // 16))


def soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class IdleClients(Protocol):
    def close_idle(self, most: int) -> int: ...


class IdleUpstreams(Protocol):
    def close_oldest_idle(self, most: int) -> int: ...


class Tally(Protocol):
    def idle_shed(self, clients: int, upstreams: int) -> None: ...


def make_room(clients: IdleClients, upstreams: IdleUpstreams, tally: Tally) -> None:
    """Close up to :data:`SHED_PER_EVENT` idle connections on each side, counted."""
    closed = clients.close_idle(SHED_PER_EVENT)
    dropped = upstreams.close_oldest_idle(SHED_PER_EVENT)
    if closed or dropped:
        tally.idle_shed(closed, dropped)

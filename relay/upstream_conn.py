"""One upstream connection: the raw asyncio protocol of a TCP connection to an upstream.

An :class:`UpstreamConnection` passes what it reads to the exchange using it (its
:class:`Owner`: ``relay.forward.Exchange``, or a WebSocket splice after a 101), writes through
the relay's outbox, and closes without losing what it still has to send. Its pool
(``relay.upstreams``) dials it and keeps it while it is idle; it counts itself in the pool's
open connections from ``connection_made`` until it is lost.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Protocol, cast

from relay.closing import unsent

if TYPE_CHECKING:
    from relay.core.model import PoolKey
    from relay.response import ResponseReader
    from relay.upstreams import Pool

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

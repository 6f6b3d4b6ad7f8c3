"""How a client connection closes: the orderly close (lingering when mid-request), the abort.

:class:`Closing` is the lowest of the bases of :class:`relay.server.ClientConnection` and
declares the fields they all share. Its own methods close a connection: the orderly close
after the last answer, with a lingering close when the client may still be sending (RFC 9112
§9.6), the deadlines of a close whose client reads slowly or not at all, the abort (a reset),
and the end of the exchanges of a client that is gone. Two bases above it hold the rest of how
a connection ends: relay's own answers (refusals, the header timeout, parse errors, bugs) in
:mod:`relay.refusals`, and the client's departure (its FIN, a reset seen while relay was not
reading) in :mod:`relay.departures`. ``relay.server`` and the bases above these keep the rest:
reading requests with llhttp (``relay.request_heads``), starting exchanges in order, flow
control and writes (``relay.pipelining``).

:func:`unsent` counts what a peer has not taken yet (``relay.upstreams`` closes its upstream
connections with it too).

Why base classes and not an object of their own: every half reads and writes the same fields
of the one connection; the annotations below are those fields, and ``ClientConnection`` owns
their slots and sets them (as ``relay.finish.Finish`` does for an exchange). A method is
found through the class's method cache however deep the bases go: the split costs a request
no extra call.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
import time
from collections import deque
from typing import TYPE_CHECKING

import httptools

from relay.core.model import Reject, RequestHead
from relay.flow import PAUSE_UPGRADE

if TYPE_CHECKING:
    from relay.forward import Exchange
    from relay.runtime import Relay
    from relay.websocket import Splice

# Lingering close (Closing.close), as nginx's lingering_time: the wait between two reads is
# the closing grace of relay.timers (CLOSE_GRACE_S, nginx's lingering_timeout).
LINGER_TOTAL_S = 30.0
# A closed connection whose client takes none of relay's last answer for this long is cut off
# (nginx's send_timeout; without a total, as SPEC §4 has none on an exchange).
CLOSE_STALL_S = 60.0
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, zero seconds: close() sends a reset


class Closing:
    """The closing half of a client connection, and the fields of every half (see the module
    docstring)."""

    # The fields the halves share (ClientConnection sets them in __init__ and adds its own).
    __slots__ = (
        "_close_left",
        "_close_moved",
        "_discarding",
        "_fin_progress",
        "_head_raw",
        "_lingering",
        "_mid_message",
        "_paused",
        "_refusal",
        "_refused_head",
        "active",
        "below",
        "client_eof",
        "closing",
        "parser",
        "peer",
        "queue",
        "receiving",
        "relay",
        "transport",
    )

    relay: Relay
    transport: asyncio.Transport | None
    parser: httptools.HttpRequestParser | None
    peer: str
    closing: bool
    active: Exchange | None
    receiving: Exchange | None
    queue: deque[Exchange]
    _refusal: Reject | None
    _refused_head: RequestHead | None  # the head _refusal answers, when it was parsed whole
    _head_raw: int
    _paused: int
    _mid_message: bool
    _in_head: bool
    _headers: list[tuple[bytes, bytes]]  # the request's header fields, as llhttp gave them
    _url: bytes  # the request's target, as llhttp gave it
    splice: Splice | None  # a WebSocket's, once upgraded (relay.slices declares it too)
    _lingering: float
    _close_left: int  # bytes relay still had to write at the close, or at the last progress
    _close_moved: float  # relay.timers.now() then
    below: asyncio.Transport | None  # a TLS connection's TCP transport (relay.handshake)
    _fin_progress: tuple[int, float]  # what a gone WebSocket client's upstream took, and when
    _discarding: bool  # the active request's body is only dropped, on a deadline (discarding)
    client_eof: bool
    tls: bool
    _rest: bytes  # a sliced read's rest, fed in the loop's next turn (relay.slices declares it)

    def write(self, data: bytes) -> None:
        raise NotImplementedError  # Pipelining.write, through the relay's outbox

    if TYPE_CHECKING:
        # What relay.timers calls besides this half's own (its Waiting protocol), from the
        # bases above: declared for the type checker only, so no stub sits in the lookup.
        def head_timed_out(self) -> None: ...  # relay.refusals

        def check_peer(self) -> None: ...  # relay.departures

    def _end_exchanges(self) -> None:
        """The client is gone, or nothing more will be written to it: every exchange ends."""
        for exchange in (self.active, *self.queue):
            if exchange is not None:
                exchange.client_lost()
        self.active = None
        self.queue.clear()

    def exchange_cut(self, exchange: object) -> None:
        """The active exchange ended without a clean end: the client must see it."""
        if exchange is self.active:
            self.active = None
        self.close()

    def close(self) -> None:
        """Close once the answer is written; linger first if the client is mid-request.

        Closing a socket with unread bytes in it makes the kernel send a reset, which can
        destroy the answer before the client reads it (RFC 9112 §9.6): a client that sends
        a whole upload before reading (most do) would see "connection reset" instead of
        the 401 or 413 it was answered. So when relay closes in the middle of a request
        (an early answer, a refused head, a body past the discard limit) it first lingers,
        as nginx's ``lingering_close`` does: it half-closes (FIN after the answer, on plain
        TCP) and keeps reading and dropping what the client sends, for up to ``CLOSE_GRACE_S``
        between reads and LINGER_TOTAL_S in all, until the client closes its side.
        """
        self._close(linger=True)

    def _close(self, *, linger: bool) -> None:
        self.relay.outbox.flush()  # what was written before the close goes out before it
        self.closing = True
        self.parser = None
        transport = self.transport
        if transport is None or transport.is_closing() or self._lingering:
            return  # a lingering close ends when the client closes, or at its deadline
        if (
            linger
            and self._client_may_send()
            and (transport.can_write_eof() or self._body_may_follow())
        ):
            self._mid_message = False
            self._lingering = time.monotonic()
            self._end_exchanges()  # nothing more is written after the answer
            if transport.can_write_eof():
                transport.write_eof()  # the client sees the close at once (a TCP FIN)
            self._paused = 0
            self.relay.timers.resumed(self)
            transport.resume_reading()
        else:
            transport.close()
        self._close_left = self._unwritten(transport)
        self._close_moved = self.relay.timers.now()
        self.relay.timers.close_deadline(self)

    def _client_may_send(self) -> bool:
        """The client may be sending when relay closes: it is mid-request, or a WebSocket's
        (relay ended the splice: revoked, draining, its upstream gone) whose frames flow at any
        time. Found by review: a WebSocket client still sending was reset at the close (its
        frames left unread), and the reset dropped what the kernel had not sent yet, relay's
        1001 Close frame among it, as UpstreamConnection.close found for the upstream side.
        So too a refused handshake's: relay stops reading at the handshake (PAUSE_UPGRADE),
        and a client that sent frames before its 101 was reset after the refusal (found by
        review)."""
        return self._mid_message or self.splice is not None or bool(self._paused & PAUSE_UPGRADE)

    def _body_may_follow(self) -> bool:
        """More of the request may come: its head is unfinished, or it announced a body. Over
        TLS no half-close tells the client to stop (asyncio's TLS transport cannot write an
        EOF), so a lingering close only waits for it to go, up to ``CLOSE_GRACE_S``: a refusal
        of a whole bodiless request (a 503 past listen.max_connections, a 405) kept the
        connection, and its slot, 5 s before a reset (found by review). It closes at once."""
        if self._in_head:
            return True
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                return True
            if lowered == b"content-length" and value.strip(b" \t").lstrip(b"0"):
                return True
        return False

    def close_expired(self) -> None:
        """``CLOSE_GRACE_S`` passed since the close, or since the client last took some of what
        relay still had to write: while it takes some, it waits on (SPEC §4: no write timeout
        on an exchange; found by review: a slow reader of a ``Connection: close`` download
        lost its tail, 5 s after the close, with an orderly end). A client that takes nothing,
        or a lingering one that sends nothing, is cut off."""
        transport = self.transport
        if transport is not None:
            # Lingering too: a WebSocket's client may still be reading what relay sent before
            # its Close frame, slowly, while it sends nothing (the next review of the fix above).
            left = self._unwritten(transport)
            now = self.relay.timers.now()
            if 0 < left < self._close_left:
                self._close_left, self._close_moved = left, now
                self.relay.timers.close_deadline(self)
                return
            if left and now - self._close_moved < CLOSE_STALL_S:
                # A client that stopped reading for a while, as a download's reader may: up to
                # nginx's send_timeout between two of its reads (found by review: cut after 5
                # s, it lost the tail of an answer relay had already sent).
                self.relay.timers.close_deadline(self)
                return
        self.abort()

    def _unwritten(self, transport: asyncio.Transport) -> int:
        """What relay wrote that the client has not taken: over TLS also what the TLS layer
        already encrypted into the TCP transport below, which its own size leaves out (found by
        review: a TLS reader pausing 8 s was cut off at CLOSE_GRACE_S)."""
        # And what the kernel still queues for the client: a TLS connection stays open for its
        # closing handshake, and a plain one while it lingers, and a cut there (an abort)
        # resets what the kernel had not sent yet.
        if self.below is not None:
            return transport.get_write_buffer_size() + unsent(self.below)
        return unsent(transport)

    def close_now(self) -> None:
        """Close without lingering (relay is stopping)."""
        self._lingering = 0.0
        self._mid_message = False
        self._close(linger=False)

    def _still_sending(self) -> None:
        """Lingering: the client is still sending. Wait on, within LINGER_TOTAL_S."""
        if time.monotonic() - self._lingering < LINGER_TOTAL_S:
            self.relay.timers.close_deadline(self)  # restarts the wait (CLOSE_GRACE_S)

    def abort(self) -> None:
        """End the connection abortively: the client must see a reset. uvloop's (and
        asyncio's) abort() only closes without flushing, and the kernel then sends a FIN
        when nothing the client sent is left unread, which ends a close-delimited body (an
        HTTP/1.0 client's) as complete (RFC 9112 §8; found by review: a cut read as the whole
        answer). SO_LINGER zero makes the close a reset (RFC 9293 §3.6.1's abort)."""
        self.relay.outbox.flush()
        self.closing = True
        transport = self.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None and not transport.is_closing():
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            transport.abort()


def unsent(transport: asyncio.Transport | None) -> int:
    """Bytes written to ``transport`` that its peer has not taken: in its buffer, and in the
    kernel's send queue (TIOCOUTQ: unsent or not yet acknowledged). The user-space buffer
    alone moves in bursts, when the kernel's queue has room for a third of it again."""
    if transport is None:
        return 0
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            queued += ioctl_count(sock.fileno(), termios.TIOCOUTQ)
    return queued


def ioctl_count(fd: int, request: int) -> int:
    """A socket's byte count the kernel keeps: FIONREAD (unread), TIOCOUTQ (not yet taken)."""
    count: int = struct.unpack("i", fcntl.ioctl(fd, request, b"\0\0\0\0"))[0]
    return count

"""How a client connection ends: refusals, closes (lingering when mid-request) and aborts.

:class:`Closing` holds the methods of :class:`relay.server.ClientConnection` that end a
connection or answer what cannot be served: relay's own refusal of a request it could not
parse or admit, the orderly close after the last answer (with a lingering close when the
client may still be sending, RFC 9112 §9.6), the abort, the header timeout, the client's
half-close, a reset noticed while relay was not reading (check_peer), and what a parse error
or a bug in a callback leads to. ``relay.server`` keeps
the rest: reading requests with llhttp, starting exchanges in order, flow control and writes.

Why a base class and not an object of its own: both halves read and write the same fields of
the one connection; the annotations below are those fields, and ``ClientConnection`` owns
their slots and sets them (as ``relay.finish.Finish`` does for an exchange).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import select
import socket
import struct
import termios
import time
from collections import deque
from typing import TYPE_CHECKING

import httptools

from relay.answer import http_date
from relay.core.answers import answer_bytes, render
from relay.core.model import Reason, Reject, RequestHead
from relay.flow import PAUSE_CLIENT_FULL, PAUSE_UPGRADE

if TYPE_CHECKING:
    from relay.forward import Exchange
    from relay.runtime import Relay
    from relay.websocket import Splice

log = logging.getLogger("relay.server")

# Lingering close (Closing.close), as nginx's lingering_time: the wait between two reads is
# the closing grace of relay.timers (CLOSE_GRACE_S, nginx's lingering_timeout).
LINGER_TOTAL_S = 30.0
# A WebSocket client gone (its FIN) with frames relay has not read yet, held back by a slow
# upstream: how long the upstream may take none of them before the splice ends anyway.
SPLICE_FIN_WAIT_S = 30.0
# A closed connection whose client takes none of relay's last answer for this long is cut off
# (nginx's send_timeout; without a total, as SPEC §4 has none on an exchange).
CLOSE_STALL_S = 60.0
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, zero seconds: close() sends a reset


class Closing:
    """The ending half of a client connection (see the module docstring)."""

    # The fields both halves use (ClientConnection sets them in __init__ and adds its own).
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
        raise NotImplementedError  # ClientConnection.write, through the relay's outbox

    def _end_exchanges(self) -> None:
        """The client is gone, or nothing more will be written to it: every exchange ends."""
        for exchange in (self.active, *self.queue):
            if exchange is not None:
                exchange.client_lost()
        self.active = None
        self.queue.clear()

    def eof_received(self) -> bool:
        # A client half-close ends the connection once the running response is written;
        # HTTP/1.1 gives a half-closed client no way to send another request.
        # Over TLS asyncio closes the connection at EOF whatever this returns (a half-closed
        # TLS stream cannot carry the rest of a response), so only plain TCP keeps it.
        self.relay.outbox.flush()  # uvloop closes the transport on False: held bytes first
        self._mid_message = False  # the client sends nothing more: no lingering needed
        if self.receiving is not None and not self.closing:
            # RFC 9112 §6.3/§8: a request body cut short by the client's FIN can never be
            # completed; the upstream would wait for the rest for ever.
            self._unparseable(
                Reject(
                    reason=Reason.BAD_REQUEST,
                    detail="Incomplete request body: the client closed its side",
                )
            )
        transport = self.transport
        if self.active is None or self.tls or transport is None or transport.is_closing():
            return False
        if self._lingering:
            return False  # the answer went out before the linger began
        self.client_eof = True
        # Requests already read are still answered, in order (a client may send its last
        # pipelined requests and half-close); then the connection closes. Not a stream
        # (chunked, no end in sight): it is not waited out for a client that has most likely
        # gone. TCP does not tell a close from a half-close, and the stream would hold its
        # upstream until an event's write found the client gone (envd pings a quiet watch
        # every 50 s). The JS SDK over plain HTTP, and a front proxy whose client left, end a
        # stream with a FIN; Go's server and nginx take it as an abort too (README,
        # "Half-closed clients wait"; found by review).
        if self.active.streaming():
            self.active.end_at_fin()  # a reset for an HTTP/1.0 client's (found by review)
            return False
        return True

    def drop_after_fin(self) -> None:
        """The client's FIN ended its stream (relay.finish, end_at_fin): every exchange ends
        now (client_closed), its upstream closed and its in-flight slot freed; the connection
        closes once what relay wrote is flushed, within the close's deadlines. Not at the
        close's end: a client that does not read never takes the rest, and the upstream was
        held until CLOSE_STALL_S (found by review)."""
        self._mid_message = False  # the client sends nothing more: no lingering needed
        self._end_exchanges()
        self.close()

    def exchange_cut(self, exchange: object) -> None:
        """The active exchange ended without a clean end: the client must see it."""
        if exchange is self.active:
            self.active = None
        self.close()

    def refuse(self, reject: Reject, *, head: RequestHead | None = None) -> None:
        """Answer a request relay could not even parse or admit, then close.

        ``head``: the request's, when it was parsed (one past ``listen.max_connections``, a
        head past ``listen.max_header_bytes`` that llhttp read whole): its
        Origin gets CORS and a browser page load the HTML page (SPEC §5), and a HEAD gets no
        content (RFC 9110 §9.3.2), as for every other answer of relay's (found by review: a
        HEAD got the JSON body, a browser's fetch no Access-Control-Allow-Origin)."""
        self.closing = True
        answer = render(reject, head.headers if head is not None else ())
        head_only = head is not None and head.method == b"HEAD"
        sent = 0 if head_only else len(answer.body)
        self.relay.observer.connection_refused(reject, self.peer, head, sent)
        self.write(answer_bytes(answer, close=True, head_only=head_only, date=http_date()))
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

    def check_peer(self) -> None:
        """relay has not read this client for ``PEER_CHECK_S`` (relay.timers): did it reset?

        A paused transport's socket is not watched by the event loop, so a client that gave
        up (a reset, or both directions shut) while its upstream stalled would hold both
        connections for as long as the upstream does. The kernel knows: a zero-timeout
        ``poll`` reports POLLERR or POLLHUP, which are always reported whatever the events
        asked. A FIN alone (POLLRDHUP) is not a departure: a client may half-close once its
        request is sent and still read the answer (eof_received); except during a stream,
        which a FIN ends whether relay reads the client or not (_fin_while_paused).
        """
        transport = self.transport
        if not self._paused or self.closing or transport is None or transport.is_closing():
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            poller = select.poll()
            # A WebSocket's client that half-closed has left too: relay ends a splice at the
            # client's FIN when it reads it (eof_received), but a paused one's FIN went unseen
            # and held the splice, its descriptors and its in-flight count for as long as the
            # upstream stayed silent (found by review). An HTTP client may half-close and
            # still read its answer: only a reset or a hang-up ends it, or a FIN during a
            # stream (eof_received; found by review: a stream with a pipelined request queued
            # behind it, the client paused, held its upstream after the client's FIN).
            poller.register(sock.fileno(), select.POLLRDHUP)
            events = poller.poll(0)
            revents = events[0][1] if events else 0
            if revents & (select.POLLERR | select.POLLHUP) or (
                revents
                and self.splice is not None
                and not self._frames_to_pass(revents, sock.fileno())
            ):
                self.abort()  # connection_lost follows: the exchange and its upstream end
                return
            if revents and self.splice is None and self._fin_while_paused(sock.fileno()):
                return
        self.relay.timers.paused(self)

    def _fin_while_paused(self, fd: int) -> bool:
        """The paused HTTP client sent its FIN (POLLRDHUP), which relay has not read: during a
        stream it ends the exchange now, as eof_received does (README, "Half-closed clients
        wait"); true when it did. Otherwise the half-close keeps its meaning: when nothing the
        client sent is left unread (the FIN is all that remains), the client is marked
        half-closed, so a response that turns out a stream is ended at its head, as for a
        FIN that was read; its requests are answered, and eof_received reads the FIN later."""
        active = self.active
        if active is not None and active.streaming():
            self.client_eof = True
            active.end_at_fin()
            return True
        # (Not over TLS: its EOF ends the connection anyway, and the socket's unread bytes
        # are records; nor with a sliced read's rest still to feed, relay.slices.)
        if not self.tls and not self._rest and not _ioctl_count(fd, termios.FIONREAD):
            self.client_eof = True
        return False

    def _frames_to_pass(self, revents: int, fd: int) -> bool:
        """A WebSocket client that sent its FIN while relay held its frames back (its upstream
        slow) still has them passed on, the Close frame among them, while the upstream takes
        some within SPLICE_FIN_WAIT_S (found by review: cut at the first check, the upstream
        lost the tail). A reset, a hang-up, or nothing left unread ends it at once."""
        splice = self.splice
        if splice is None or revents & (select.POLLERR | select.POLLHUP):
            return False
        if not _ioctl_count(fd, termios.FIONREAD):  # nothing left unread
            return False
        # What the upstream took: what relay passed on, less what still waits in its buffer.
        # (Not what relay passed on alone, which cannot move while the client is paused: the
        # next review found a splice cut while its upstream read steadily.)
        taken = splice.bytes_in - unsent(splice.upstream.transport)
        now = self.relay.timers.now()
        before, since = self._fin_progress
        if taken != before:
            self._fin_progress = (taken, now)
            return True
        return now - since < SPLICE_FIN_WAIT_S

    def discarding(self) -> None:
        """The active request was answered by relay (a refusal, a failed dial) before its body
        ended, and the connection is kept: what is left of the body is only read and dropped.
        The client gets ``listen.header_timeout_s`` to send it, as it gets for a head, then
        ``head_timed_out`` closes. Without a deadline a client that announced a body and never
        sent it held the connection for ever, with no credential and no upstream: the header
        timeout's slowloris bound was sidestepped by one Content-Length (found by review).
        nginx bounds the discarding of a body too (``lingering_timeout``). Not once the
        connection closes (the body was too large to drop): the lingering close has its own
        deadline, and a head deadline there answered 408 after the FIN, a write that raised in
        the timers' sweep and ended it for every connection (found by review)."""
        if not self.closing:
            self._discarding = True  # its end (on_message_complete) ends the deadline
            self.relay.timers.expect_head(self)

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

    def head_timed_out(self) -> None:
        """``listen.header_timeout_s`` passed without a complete request head (slowloris), or
        without the rest of the body of a request relay answered itself (``discarding``)."""
        active = self.active
        if active is not None and active.answered() and not active.request_complete:
            self.close()  # a lingering close, itself bounded (CLOSE_GRACE_S, LINGER_TOTAL_S)
            return
        if self.active is not None or self._paused & PAUSE_CLIENT_FULL:
            # A pipelined head trickling in behind a long response: the response may run
            # for hours (a command stream), so only the head's own wait is restarted. So too
            # while relay itself does not read the client, which has not drained relay's
            # answers yet (found by review: a 408 for a head relay stopped reading).
            self.relay.timers.expect_head(self)
        elif self._head_raw or self._in_head:  # llhttp began a head: bytes were sent
            self.refuse(Reject(reason=Reason.HEADER_TIMEOUT), head=self._head_so_far())
        else:
            self.close()  # nothing was sent: just close

    def internal_error(self, exc: BaseException) -> None:
        """Log a bug with its traceback (never to the client) and end the connection."""
        log.error("internal error on a client connection", exc_info=exc)
        if self.active is None or not self.active.response_started():
            self.refuse(Reject(reason=Reason.INTERNAL))
        else:
            self.abort()

    def _parse_error(self, exc: Exception) -> None:
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, httptools.HttpParserInvalidMethodError):
            detail = "Invalid HTTP method"
        elif isinstance(exc, httptools.HttpParserInvalidURLError):
            detail = "Invalid request target"
        elif detail == "Pause on PRI/Upgrade":
            # llhttp stops at HTTP/2's connection preface (RFC 9113 §3.4, prior knowledge):
            # a version relay does not speak, said as for any other (RFC 9110 §15.6.6), not in
            # llhttp's words (found by review).
            self._unparseable(Reject(reason=Reason.BAD_VERSION))
            return
        reject = Reject(reason=Reason.BAD_REQUEST, detail=f"Malformed request: {detail}")
        self._unparseable(reject, self._head_so_far())

    def _head_so_far(self) -> RequestHead | None:
        """The refused head as far as llhttp read it, once its request line and a field were
        read: its Origin gets CORS, a browser page load the HTML page, and a HEAD no content
        (SPEC §5, RFC 9110 §9.3.2), as for relay's other answers. llhttp's refusals (Content-
        Length with Transfer-Encoding, RFC 9112 §6.1, and the other framing errors), a 431
        before the head's end (a browser's large Cookie) and a 408 went without them: a
        page's fetch could not read why, and a HEAD's client read the JSON body as the next
        response (found by review). llhttp stops at an error, so the fields after it are
        never seen."""
        parser = self.parser
        if parser is None or not self._in_head or not self._headers:
            return None
        return RequestHead(
            method=parser.get_method(),
            target=self._url,
            version=parser.get_http_version(),
            headers=tuple(self._headers),
        )

    def _unparseable(self, reject: Reject, head: RequestHead | None = None) -> None:
        """Nothing more can be parsed from this connection: refuse, in order, then close.

        Responses go out in request order (RFC 9112 §9.3.2): a refusal found while earlier
        pipelined requests are still being answered waits for them, so that it is never taken
        for the answer to one of them. ``head``: the refused request's, when llhttp parsed it
        whole (a 431 past ``max_header_bytes``), for refuse().
        """
        broken, self.receiving = self.receiving, None
        if self.closing:
            return  # already answered (at its head, in this same read) and closing
        active = self.active
        if active is not None and broken is active:
            # The active request's own body is malformed: it cannot be completed.
            if active.answered():
                self.close()  # its answer is written; let it flush
            elif active.response_started():
                self.abort()
            else:
                # The exchange answers (its upstream closed, then the connection): one
                # exchange, counted and logged once with its 400 and its request, and
                # rendered with its head (CORS). refuse() answered for the connection and the
                # exchange then ended as "client_closed" with status 0: two requests in
                # relay_requests, two access-log lines (found by review).
                self.closing = True
                active.cut(reject)
                self.close()
            return
        if broken is not None and broken in self.queue:
            self.queue.remove(broken)  # a queued request's body: it never started
        if active is None:
            self.refuse(reject, head=head)
            return
        self.parser = None
        self._refusal, self._refused_head = reject, head


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
            queued += _ioctl_count(sock.fileno(), termios.TIOCOUTQ)
    return queued


def _ioctl_count(fd: int, request: int) -> int:
    """A socket's byte count the kernel keeps: FIONREAD (unread), TIOCOUTQ (not yet taken)."""
    count: int = struct.unpack("i", fcntl.ioctl(fd, request, b"\0\0\0\0"))[0]
    return count

"""The client side: an HTTP/1.1 server protocol per accepted connection, framed by llhttp.

relay parses requests with ``httptools`` (llhttp, the parser of Node.js) on a plain asyncio
protocol instead of aiohttp's ``web.Server``: the whole request path (parse → decide →
forward) then runs in a handful of callbacks with no task, no ``web.Request`` and no header
multidict per request, and the connection's framing is entirely relay's to police
(SPEC §5a). llhttp is strict by default: Content-Length with Transfer-Encoding, repeated
Content-Length, obs-fold, bare CR/LF, NUL, whitespace before a colon and bad chunk syntax are
all parse errors, answered 400 and the connection closed.

Flow per connection: ``data_received`` → llhttp → ``on_headers_complete`` makes a
:class:`~relay.forward.Exchange` and, when no earlier exchange is still running, starts it.
Pipelined requests (RFC 9112 §9.3.2) wait in a queue, reading is paused meanwhile, and they
are answered in order. This module keeps the accept, the reads (``data_received``: what goes
to llhttp, what is passed on as a body or sliced, and what a read's outcome is), the client's
write backpressure and the end of the connection. Bases, each on the next, hold the rest of the
class: llhttp's request callbacks, a head becoming an exchange,
:class:`relay.request_heads.RequestHeads`; what its exchanges call (writes, reading paused and
resumed, the next exchange started) and the hand-over at an upgrade,
:class:`relay.pipelining.Pipelining`; dense reads fed in slices with turns for the others
between them, :class:`relay.slices.Slices`; a request body passed on without llhttp once its
length is known, :class:`relay.bodies.RequestBodies`; and how a connection ends: the client's
FIN or reset, :class:`relay.departures.Departures`; relay's refusals, timeouts and parse errors,
:class:`relay.refusals.Refusals`; the lingering close and aborts, :class:`relay.closing.Closing`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools

from relay.core.model import Reject, RequestHead
from relay.flow import (
    FLOOD_SLICE,
    PAUSE_CLIENT_FULL,
    PAUSE_UPGRADE,
    REQUEST_EVENTS,
    YIELD_EVENTS,
    flood_ahead,
)
from relay.heads import KNOWN_HEAD_BYTES, REQUESTS, KnownRequest, remember
from relay.request_heads import HEAD_TOO_LARGE, TRAILERS_TOO_LARGE, RequestHeads

if TYPE_CHECKING:
    from relay.forward import Exchange
    from relay.runtime import Relay
    from relay.websocket import Splice

log = logging.getLogger("relay.server")


class ClientConnection(RequestHeads, asyncio.Protocol):
    __slots__ = ("_first_head", "_key", "overloaded", "tls", "write_paused")

    def __init__(self, relay: Relay, *, tls: bool) -> None:
        self.relay = relay
        self.tls = tls
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.parser: httptools.HttpRequestParser | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_raw = 0
        self._in_head = False
        self._reading = b""  # the read llhttp is fed, after a cut head's start (_http_line)
        self._line_from = 0  # where in it the next request line may begin
        self._held = b""  # a cut head's bytes, from where its request line may begin
        self._key: bytes | None = None  # a read that is one whole head: remembered if llhttp agrees
        self._seen: KnownRequest | None = None  # what llhttp reported for it
        self._mid_message = False  # llhttp is inside a request (head or body)
        # llhttp waits for the first byte of a request it will read: not inside one, and not
        # after one that closes the connection (it refuses what follows that). Unlike
        # _mid_message, a refusal's close() does not set it. Replays need it (relay.heads).
        self._at_start = True
        self._keep = True  # the current request lets the connection carry another
        self._body_left = 0  # the rest of a Content-Length body, passed without llhttp
        self._body_seen = 0  # body bytes of the current request so far (relay.bodies)
        self._unlengthed = False  # its fields hold no Content-Length (relay.bodies)
        # The last replayed read, what it is and its RequestHead (immutable): a kept-alive
        # client repeats its request, which is then compared, not hashed, and not built again.
        self._last: tuple[bytes, KnownRequest, RequestHead] | None = None
        self._lingering = 0.0  # time.monotonic() when a lingering close began (close())
        self._close_left = 0
        self._close_moved = 0.0
        self.below: asyncio.Transport | None = None
        self._fin_progress = (-1, 0.0)
        self._moved = False  # llhttp delivered a head, body bytes or an end in this feed
        self._stalled = 0  # bytes fed since llhttp last delivered any of those
        self._pieces: list[bytes] = []
        self._read_pieces = 0
        self._rest = b""  # relay.slices
        self._sliced = False
        self._slicing: tuple[bytes, int] | None = None
        self._dense = False
        self._yielding = False
        self._feeding_rest = False
        self._again = False
        self._paused = 0
        self._refusal: Reject | None = None  # a framing refusal waiting for earlier answers
        self._refused_head: RequestHead | None = None
        self._starting = False  # exchange_finished is starting queued exchanges
        self.client_eof = False  # the client half-closed: close once its requests are answered
        self._discarding = False
        self.write_paused = False
        self.active: Exchange | None = None  # the exchange whose response is being written
        self.receiving: Exchange | None = None  # the exchange whose body is being parsed
        self.queue: deque[Exchange] = deque()
        self.splice: Splice | None = None
        self.closing = False
        self.overloaded = False
        self.requests = 0
        self._first_head: asyncio.TimerHandle | None = None  # first_head_by's deadline

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast("asyncio.Transport", transport)
        transport = self.transport
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else ""
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        relay = self.relay
        if not relay.admit(self):
            return
        self.parser = httptools.HttpRequestParser(self)
        relay.timers.expect_head(self)

    @property
    def head_begun(self) -> bool:
        """llhttp began a request head and has not finished it (relay.drain)."""
        return self._in_head and not self.closing

    def first_head_by(self, deadline: float) -> None:
        """The first request's head is due by ``deadline`` (``time.monotonic()``), earlier than
        the timers' own wait, which began now: a TLS connection's began at accept, and its
        handshake took part of it (relay.handshake)."""
        if self.closing or self.requests:
            return
        self._first_head = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()), self._first_head_due
        )

    def _first_head_due(self) -> None:
        self._first_head = None
        if not self.requests and not self.closing:
            self.head_timed_out()

    def data_received(self, data: bytes) -> None:
        if self._rest and not self.closing:
            self._rest += data  # after the rest of a sliced read, in order (relay.slices)
            return
        if self.splice is not None and not self.closing:
            self.splice.client_data(data)
            return
        parser = self.parser
        if parser is None or self.closing:
            # After an upgrade handshake or a refusal nothing more is parsed; a lingering
            # close reads on (and drops) what the client still sends.
            if self._lingering:
                self._still_sending()
            elif self._paused & PAUSE_UPGRADE and not self.closing:
                # More bytes after a handshake, fed in the same turn (the TLS hand-over's
                # early reads): the WebSocket's too, after the first (found by the property
                # test of relay.slices; they were dropped).
                exchange = self._upgrading()
                if exchange is not None:
                    exchange.client_tail(data)
            return
        if self._body_left:
            self._pass_body(data)
            return
        if (
            len(data) > FLOOD_SLICE
            and self._slicing is None  # (not a slice it feeds: those are fed as they are)
            # A sliced connection's large reads, and a read that begins dense or is dense in
            # one of two windows further on: a client's first dense read was fed whole, ~8 ms
            # of 1-byte chunks or ~30 ms of pipelined tiny requests per 256 KiB
            # (relay.flow.flood_ahead, ~5-10 µs per large read here). Within a
            # body, dense with chunk-size lines, not only line ends: the payload's may be
            # CRLF-dense text (found by review: a chunked CSV upload was sliced read after
            # read, 25 upstream writes each), while a flood in the first read after the head
            # was fed whole on every new connection (found by the next review).
            and (
                self._sliced
                or flood_ahead(data, self._in_head or not self._mid_message, requests=True)
            )
        ):
            self._slices(data)
            return
        if self._in_head or not self._mid_message:
            # A head, or a read that may begin one (also while a response runs); never a
            # body, whether or not an exchange is active (an early answer's body reads on).
            self._head_raw += len(data)
        self._moved = False
        if self._at_start and data[-4:] == b"\r\n\r\n":
            # A read that may be one whole request head without a body (relay.heads).
            last = self._last
            known = last[1] if last is not None and data == last[0] else REQUESTS.get(data)
            if known is not None:
                self._replay(data, known)
                return
            if len(data) <= KNOWN_HEAD_BYTES and data.find(b"\r\n\r\n") == len(data) - 4:
                self._key = data
        if self._in_head:
            # A head begun in an earlier read: its request line is tested whole (_http_line).
            self._reading, self._held = self._held + data, b""
        else:
            self._reading = data
        self._line_from = 0
        self._read_pieces = 0
        requests = self.requests
        try:
            try:
                parser.feed_data(data)
            finally:
                # Before anything else is done with this read (a refusal, an upgrade): the
                # order in which the pieces came (relay.bodies).
                if self._pieces:
                    self._deliver()
            key, seen = self._key, self._seen
            if key is not None and seen is not None and self._at_start:
                # llhttp ended the request with its head and waits for another (a refusal
                # before the body, which closes, leaves _at_start unset: found by review).
                remember(REQUESTS, key, seen, len(seen.headers))
            taken = self.requests - requests
            if len(data) >= FLOOD_SLICE:  # (flow.REQUEST_EVENTS; _head adds their fields)
                taken *= REQUEST_EVENTS
            if self._read_pieces + taken > YIELD_EVENTS:
                self._dense_read()
        except httptools.HttpParserUpgrade as upgrade:
            self.parser = None
            self._mid_message = False  # what follows the handshake is not HTTP
            self._upgrade_requested(data[upgrade.args[0] :] + self._upgrade_tail())
            return
        except httptools.HttpParserCallbackError as exc:
            # One of relay's own callbacks raised: a bug, not a bad request.
            self.internal_error(exc.__context__ or exc)
            return
        except httptools.HttpParserError as exc:
            self._parse_error(exc)
            return
        finally:
            self._key = self._seen = None  # only the read that set them may remember
            # Not kept past the read (an idle connection would pin its last read's buffer).
            reading, self._reading = self._reading, b""
        limit = self.relay.config.listen.max_header_bytes
        if self._in_head:
            # From where its request line may begin (slow path: a head cut by the read's end),
            # within the last 2 * limit bytes: a head that is not refused fits there (its
            # fields and line are within limit; only OWS is not counted), and a head trickled
            # in byte by byte copies at most that per read (as httptools re-joins a field's
            # value on every read).
            self._held = reading[max(self._line_from, len(reading) - 2 * limit) :]
            if self._head_raw > limit:
                # After any earlier pipelined responses, not inside one (RFC 9112 §9.3.2);
                # rendered with the fields read so far (a browser's large Cookie: CORS).
                self._unparseable(HEAD_TOO_LARGE, self._head_so_far())
        elif self._moved:
            self._stalled = 0
            if self._mid_message and self._keep:
                # Inside a body: a Content-Length one goes on without llhttp (relay.bodies;
                # not after a request that closes, whose end llhttp must see).
                self._body_left = self._content_left()
        else:
            # Bytes that are neither a head nor body: a trailer section, chunk extensions,
            # empty lines. llhttp has no limit on them and httptools keeps a field's value in
            # memory (re-concatenated on every read) until its line ends, so bound them as
            # the head is bounded.
            self._stalled += len(data)
            if self._stalled > limit:
                # Between messages they are empty lines before a request line (RFC 9112
                # §2.2), which count as its head: "trailers" named what never began (found
                # by review).
                too_large = TRAILERS_TOO_LARGE if self._mid_message else HEAD_TOO_LARGE
                self._unparseable(too_large)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self._first_head is not None:
            self._first_head.cancel()
            self._first_head = None
        self._rest = b""
        self.relay.timers.forget(self)
        self.relay.release_connection(self)
        if self.splice is not None:
            self.splice.client_lost()
        self._end_exchanges()
        self.parser = None

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.splice is not None:
            self.splice.client_pause_writing()
            return
        if self.active is not None:
            self.active.client_pause_writing()
        self._hold_unread()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._paused & PAUSE_CLIENT_FULL:
            self.resume(PAUSE_CLIENT_FULL)
            if self.active is None and self.splice is None and not self._in_head:
                self.relay.timers.expect_idle(self)  # the idle wait _next_exchange skipped
        if self.splice is not None:
            self.splice.client_resume_writing()
        elif self.active is not None:
            self.active.client_resume_writing()

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
are answered in order. The class has two bases that hold the rest of it: how a connection
ends (refusals, the lingering close, aborts), :class:`relay.closing.Closing`, and a request
body passed on without llhttp once its length is known, :class:`relay.bodies.RequestBodies`,
and dense reads fed in slices with turns for the others between them, :class:`relay.slices.Slices`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools

from relay.core.failures import OVERLOADED_RETRY_AFTER_S
from relay.core.model import Reason, Reject, RequestHead
from relay.flow import (
    FIELDS_PER_EVENT,
    FLOOD_SLICE,
    PAUSE_CLIENT_FULL,
    PAUSE_QUEUE,
    PAUSE_UPGRADE,
    REQUEST_EVENTS,
    YIELD_EVENTS,
    flood_ahead,
)
from relay.forward import Exchange
from relay.heads import KNOWN_HEAD_BYTES, REQUESTS, KnownRequest, remember
from relay.slices import Slices

if TYPE_CHECKING:
    from relay.runtime import Relay
    from relay.websocket import Splice

log = logging.getLogger("relay.server")

HEAD_TOO_LARGE = Reject(reason=Reason.HEADERS_TOO_LARGE)
# A request's trailer section past listen.max_header_bytes (SPEC §5a bounds the head; llhttp
# bounds neither): relay does not forward trailers, and bounds them as it bounds the head.
TRAILERS_TOO_LARGE = Reject(reason=Reason.HEADERS_TOO_LARGE, detail="Request trailers too large")


class ClientConnection(Slices, asyncio.Protocol):
    __slots__ = (
        "_at_start",
        "_first_head",
        "_head_bytes",
        "_in_head",
        "_keep",
        "_key",
        "_last",
        "_seen",
        "_starting",
        "_url",
        "overloaded",
        "requests",
        "splice",
        "tls",
        "write_paused",
    )

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
        limit = self.relay.config.listen.max_header_bytes
        if self._in_head:
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

    def _replay(self, data: bytes, known: KnownRequest) -> None:
        """llhttp's callbacks for a request head it parsed before, in its order (relay.heads):
        the read is exactly that head, the connection is at the start of a message, and the
        request has no body, so it also ends here."""
        self._stalled = 0
        try:
            self._begin()
            # The whole head is here: no head deadline to start and stop, only the idle wait
            # (or the first head's, from accept) to end.
            self.relay.timers.busy(self)
            self._head(known, upgrade=False, read=data)
            self.on_message_complete()
        except Exception as exc:  # what data_received does with a callback's exception
            self.internal_error(exc)

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

    def _hold_unread(self) -> None:
        """While the client does not read relay's answers, relay does not read it either,
        unless a request body is on its way upstream (it flows under its upstream's own
        backpressure). What relay would read next can only be more requests, whose answers
        (relay's own, for requests it refuses, need no upstream) would pile up in a buffer
        the client does not drain: a client pipelining refused requests and never reading
        grew relay's memory without bound (found by review). Checked again whenever the
        active exchange changes or its request ends. Not while closing (a lingering close
        reads on) nor for a WebSocket (full duplex, under the upstream's backpressure)."""
        if self.closing or self.splice is not None:
            return
        active = self.active
        if self.write_paused and (active is None or active.request_complete):
            self.pause(PAUSE_CLIENT_FULL)
        else:
            self.resume(PAUSE_CLIENT_FULL)

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

    # -- llhttp callbacks (request side) ------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.parser is None:
            return  # refused and closing within this read: what follows is not a request
        self._begin()
        if self.requests:
            self.relay.timers.expect_head(self)  # SPEC §5a: from the first byte of a request

    def _begin(self) -> None:
        self._body_seen = 0
        self._unlengthed = False
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._in_head = True
        self._mid_message = True
        self._at_start = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4  # the head's, then its trailers'
        if self._in_head:  # fields after the body are trailers: relay does not forward them
            self._headers.append((name, value))
        else:
            # One callback each, as a body piece is (found by review: 16 pipelined requests
            # with 4,000 tiny trailers each took 12.9 ms of one read, never dense).
            self._read_pieces += 1

    def on_headers_complete(self) -> None:
        parser = self.parser
        if parser is None or self.closing:
            # An earlier request in this same read was refused and the connection is closing
            # (llhttp goes on through the rest of the buffer): this one is never served.
            return
        method = parser.get_method()
        keep_alive = parser.should_keep_alive()
        # SPEC §5a: the limit counts the request line and all header lines.
        size = len(method) + len(self._url) + 12 + self._head_bytes
        self._head_bytes = 0  # from here on, the trailers' (on_message_complete)
        known = KnownRequest(
            method, self._url, parser.get_http_version(), tuple(self._headers), keep_alive, size
        )
        # Not a request that closes: llhttp does not wait for another message after it, so
        # the state it ends in is not the one a replay leaves it in. (An upgrade stops llhttp
        # with an exception, so its head is never remembered either.)
        if self._key is not None and keep_alive:
            self._seen = known
        self._head(known, upgrade=parser.should_upgrade())

    def _head(self, known: KnownRequest, *, upgrade: bool, read: bytes = b"") -> None:
        """A whole request head, from llhttp or remembered (_replay)."""
        method, target, version, headers, keep_alive, size = known
        self._in_head = False
        self._keep = keep_alive
        self.requests += 1
        self._read_pieces += len(headers) // FIELDS_PER_EVENT  # a head of many fields (flow)
        self._moved = True
        # SPEC §5a precedence: CONNECT (405, decide's first answer) before framing (431); a
        # CONNECT head over the limit was answered 431 (found by review). Both close.
        if size > self.relay.config.listen.max_header_bytes and method != b"CONNECT":
            self.relay.timers.head_done(self)
            # In order, as above; answered as the request asks (CORS, HEAD), as it was parsed.
            refused = RequestHead(method=method, target=target, version=version, headers=headers)
            self._unparseable(HEAD_TOO_LARGE, refused)
            return
        last = self._last
        if last is not None and last[1] is known:
            head = last[2]
        else:
            head = RequestHead(
                method=method,
                target=target,
                version=version,
                headers=headers,
                peer=self.peer,
                tls=self.tls,
                upgrade=upgrade,
            )
            if read:  # replayed: the read is that head, whatever connection remembered it
                self._last = (read, known, head)
        if self.overloaded:
            # SPEC §5a: past listen.max_connections relay answers 503 and closes.
            self.relay.timers.head_done(self)
            overloaded = Reject(reason=Reason.OVERLOADED, retry_after=OVERLOADED_RETRY_AFTER_S)
            self.refuse(overloaded, head=head)
            return
        exchange = Exchange(self, head, keep_alive=keep_alive)
        self.receiving = exchange
        if self.active is None:
            self.active = exchange
            exchange.start()
        else:
            self.queue.append(exchange)
            self.pause(PAUSE_QUEUE)
        # After start(), which writes the head upstream: the bookkeeping waits for the write
        # (on an idle core every line before it is latency; bench/README.md, "cold requests").
        # A replayed head started no deadline (_replay); one answered within start() whose body
        # is still to come has had its deadline renewed for that body (discarding).
        if not read and not self._discarding:
            self.relay.timers.head_done(self)

    def on_message_complete(self) -> None:
        # The next head's bytes count from here (the limit and the 408 of a partial head,
        # relay.closing): not from its on_message_begin, which comes after data_received has
        # counted the read that begins it.
        # The body's last pieces first, while the request is still in progress: one that
        # goes past DISCARD_LIMIT closes with a lingering close (found by review). The test
        # inline: every request ends here, most without a body (a call costs ~1 µs cold).
        if self._pieces:
            self._deliver()
        if self._head_bytes and self._trailers_too_large():
            return
        self._head_raw = 0
        self._moved = True
        self._mid_message = False
        self._at_start = self._keep
        receiving, self.receiving = self.receiving, None
        if receiving is not None and not self.closing:
            if self._discarding:  # a flag, not receiving.answered(): every request ends here
                self._discarding = False
                self.relay.timers.head_done(self)  # its body's deadline (discarding) is met
            receiving.request_done()
            if self.write_paused:
                self._hold_unread()  # its body is over

    def _trailers_too_large(self) -> bool:
        """A trailer section past ``max_header_bytes``, ended in this read: refused, as it is
        when a read of it alone makes no progress (data_received, _stalled); before, fed whole
        with the last chunk it was passed, and sliced it was refused (found by review)."""
        if self.parser is None or self._head_bytes <= self.relay.config.listen.max_header_bytes:
            # (parser None: a refusal waits for earlier answers, and llhttp reads on through
            # requests that never began, whose fields this count kept adding up: found by
            # review, a later head rewrote the waiting 431's message)
            return False
        self._unparseable(TRAILERS_TOO_LARGE)
        return True

    # -- flow control -------------------------------------------------------------------------
    def pause(self, reason: int) -> None:
        if not self._paused and self.transport is not None:
            self.transport.pause_reading()
            self.relay.timers.paused(self)  # see check_peer
        self._paused |= reason

    def resume_all(self) -> None:
        self._paused = 0
        self.relay.timers.resumed(self)
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    def resume(self, reason: int) -> None:
        if not self._paused & reason:
            return
        self._paused &= ~reason
        if not self._paused:
            if self._rest and not self.closing:
                # A rest put aside while requests queued or the client did not read
                # (relay.slices): fed next turn, before anything read after it.
                self._yield_turn()
                return
            self.relay.timers.resumed(self)
            if self.transport is not None and not self.closing:
                self.transport.resume_reading()

    # -- called by exchanges --------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.relay.outbox.write(self.transport, data)

    def writelines(self, parts: list[bytes]) -> None:
        if self.transport is not None:
            self.relay.outbox.writelines(self.transport, parts)

    def exchange_finished(self, exchange: object, *, keep_alive: bool) -> None:
        """The response of the active exchange is complete; start the next one or idle."""
        if exchange is not self.active:
            return
        self.active = None
        try:
            self._next_exchange(keep_alive)
        finally:
            if self.write_paused and not self._starting:
                self._hold_unread()  # for the exchange that runs now, if any (review)

    def _next_exchange(self, keep_alive: bool) -> None:
        # No parser and no refusal waiting: llhttp stopped at an upgrade. The connection ends
        # here unless that upgrade request is still queued behind this one (RFC 9112 §9.3.2:
        # pipelined requests are answered in order, a WebSocket handshake among them).
        if (
            not keep_alive
            or self.closing
            or (self.parser is None and self._refusal is None and not self.queue)
        ):
            self.close()
            return
        if self._starting:
            return  # finished within start() below: the loop there starts the next one
        if self.queue:
            # A loop, not a call per queued exchange: an exchange relay answers itself
            # finishes inside its own start(), and thousands of pipelined refusals would
            # otherwise nest start → answer → finish → start ... past the recursion limit.
            self._starting = True
            try:
                while self.queue and self.active is None and not self.closing:
                    self.active = self.queue.popleft()
                    if not self.queue:
                        self.resume(PAUSE_QUEUE)
                    self.active.start()
            finally:
                self._starting = False
            if self.active is not None or self.closing:
                return
        if self._refusal is not None:
            # every earlier request is answered: now the refusal
            self.refuse(self._refusal, head=self._refused_head)
            return
        if self.client_eof:
            self.close()  # every request the client sent before its FIN is answered
            return
        self.resume(PAUSE_QUEUE)
        if not self._in_head and not self.write_paused:
            # Not while relay itself does not read the client (_hold_unread): it may have
            # requests waiting unread; the wait starts once it drained (resume_writing).
            self.relay.timers.expect_idle(self)

    def start_splice(self, splice: Splice) -> None:
        self.splice = splice
        self.active = None
        self.relay.timers.forget(self)

    # -- internals ------------------------------------------------------------------------
    def _upgrading(self) -> Exchange | None:
        """The exchange of the upgrade request llhttp stopped at: the last one read (nothing
        is parsed after it), queued behind earlier ones or running."""
        return self.queue[-1] if self.queue else self.active

    def _upgrade_requested(self, tail: bytes) -> None:
        """llhttp stopped at an upgrade (WebSocket handshake, CONNECT, h2c...).

        The parser cannot go on, so the connection either becomes a WebSocket splice or
        closes after the answer; bytes already sent after the handshake wait for the splice.
        """
        exchange = self._upgrading()
        if exchange is None or exchange.answered():
            if exchange is None:
                self.close()
            self.closing = True
            return
        self.pause(PAUSE_UPGRADE)
        exchange.client_tail(tail)

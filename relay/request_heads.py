"""A client's request heads: llhttp's callbacks, from a request's first byte to its exchange.

:class:`RequestHeads` holds the methods of :class:`relay.server.ClientConnection` that llhttp
calls as it parses a request (``on_message_begin``, ``on_url``, ``on_header``,
``on_headers_complete``, ``on_message_complete``; ``on_body`` is :mod:`relay.bodies`'s), and
``_replay``, which makes the same calls for a read that is a head parsed before
(:mod:`relay.heads`). A whole head is held to ``listen.max_header_bytes`` and to the connection
limit (SPEC §5a: 431, 503) and becomes an :class:`~relay.forward.Exchange`, started at once or
queued behind earlier ones (:mod:`relay.pipelining`); a trailer section is bounded as a head is,
and not forwarded.

Why a base class: as :class:`relay.pipelining.Pipelining` (its base), these methods read and
write the fields of the one connection; the slots of the fields this part sets are declared
here.
"""

from __future__ import annotations

from relay.core.failures import OVERLOADED_RETRY_AFTER_S
from relay.core.model import Reason, Reject, RequestHead
from relay.flow import FIELDS_PER_EVENT, PAUSE_QUEUE
from relay.forward import Exchange
from relay.heads import KnownRequest
from relay.pipelining import Pipelining

HEAD_TOO_LARGE = Reject(reason=Reason.HEADERS_TOO_LARGE)
# A request's trailer section past listen.max_header_bytes (SPEC §5a bounds the head; llhttp
# bounds neither): relay does not forward trailers, and bounds them as it bounds the head.
TRAILERS_TOO_LARGE = Reject(reason=Reason.HEADERS_TOO_LARGE, detail="Request trailers too large")


class RequestHeads(Pipelining):
    """The request-head half of a client connection (see the module docstring)."""

    __slots__ = (
        "_at_start",
        "_head_bytes",
        "_held",
        "_in_head",
        "_keep",
        "_last",
        "_line_from",
        "_reading",
        "_seen",
        "_url",
        "requests",
    )

    _head_bytes: int  # the head's fields so far, then its trailers' (max_header_bytes)
    _reading: bytes  # the read llhttp is fed, after a cut head's start (data_received)
    _line_from: int  # where in it the next request line may begin (_http_line)
    _held: bytes  # a cut head's bytes, from where its request line may begin
    _keep: bool  # the current request lets the connection carry another
    _at_start: bool  # llhttp waits for the first byte of a request it will read
    _key: bytes | None  # a read that is one whole head (data_received): remembered if llhttp agrees
    _seen: KnownRequest | None  # what llhttp reported for it
    _last: tuple[bytes, KnownRequest, RequestHead] | None  # the last replayed read (_head)
    requests: int  # requests read on this connection
    overloaded: bool  # admitted past listen.max_connections or while draining: answered 503

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
        if not self._http_line():
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

    def _http_line(self) -> bool:
        """The request line of the head llhttp just read names HTTP/: else it is refused.

        llhttp reads a request line of "RTSP/" or "ICE/" too (with their methods: PLAY,
        SETUP...; its on_protocol callback is not one httptools sets, nor is the name kept
        anywhere httptools reads), and relay forwarded it as HTTP/1.1. It is no HTTP request
        (RFC 9112 §2.3, §3: HTTP-name is "HTTP", one SP before it), and Go's server, E2B's
        proxy, answers it 400 ("malformed HTTP version"): so does relay, as for llhttp's own
        refusals. One search per head llhttp parses (a remembered head was tested when first
        seen): its line, " " target " HTTP/", in the read from where the last one was found.
        An HTTP line is always found there (the first match is at or before it, so the next
        line is after where the search resumes; a head cut by a read's end is searched in
        its reads joined, data_received). A line of another protocol passes only if the
        client itself wrote that pattern after the last line (in a field, a body), and is
        then forwarded as HTTP/1.1, as before: relay writes its own request line, so nothing
        is misframed.
        """
        at = self._reading.find(b" " + self._url + b" HTTP/", self._line_from)
        if at >= 0:
            self._line_from = at + 1
            return True
        parser = self.parser
        if parser is not None and parser.get_http_version() == "0.9":
            return True  # no protocol at all (HTTP/0.9): answered 505 as before (relay.core)
        head = self._head_so_far()
        self._in_head = False
        self._head_bytes = 0
        self.relay.timers.head_done(self)
        reject = Reject(reason=Reason.BAD_REQUEST, detail="Malformed request: not HTTP")
        self._unparseable(reject, head)
        return False

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
        # relay.refusals): not from its on_message_begin, which comes after data_received has
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

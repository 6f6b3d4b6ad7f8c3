"""Parsing an upstream's response: llhttp's callbacks turned into a few events.

:class:`ResponseCallbacks` is what llhttp is given for the responses on one upstream
connection (the base of :class:`relay.response.ResponseReader`): the state of the response
being read, bound to one exchange at a time, and llhttp's callbacks. These check the head
(relay's limit on a head or trailer section that never ends, the status, the reason phrase),
count interim 1xx responses, and report the head, the body and the end to the exchange
(:class:`Events`), which decides what the client gets (``relay.core.responses`` plans the
head) and when the exchange ends. How each upstream read reaches llhttp (in slices, a
Content-Length body passed on without it, a response seen before replayed without it) is the
stage before this one, ``relay.response``.

Why a base class and not an object of its own: llhttp calls back the object it was made with,
and both stages read and write the same fields on every read; one object per connection keeps
them plain slot reads (as ``relay.finish`` does for an exchange's stages).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol

import httptools

from relay.core.answers import reason_phrase
from relay.heads import KnownResponse

if TYPE_CHECKING:
    from relay.core.model import Headers
    from relay.upstream_conn import UpstreamConnection
    from relay.upstreams import Pool

# llhttp has no limit on a response head or trailer section: relay's own, for upstreams (a
# guest is not trusted to be reasonable). Generous, as a guest's app may set many cookies.
RESPONSE_HEAD_LIMIT = 64 * 1024
# Interim (1xx) responses relayed before a final one. RFC 9110 §15.2 sets no bound, and an
# upstream sending them without end cost ~13 ms per 256 KiB read, every turn (found by review;
# each now counts as a piece of a sliced read too). Go's HTTP client
# stops at 5; this is generous for 100 Continue, 103 Early Hints and a long run of 102
# Processing. Past it the response is malformed: 502, or a cut once the final one started.
MAX_INTERIM = 64
# What RFC 9112 §4 does not allow in a reason phrase: controls but HTAB, and DEL
# (on_headers_complete).
_BAD_REASON = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class Events(Protocol):
    """What a reader reports, from within llhttp's callbacks (``relay.forward.Exchange``)."""

    # The exchange is done with the response (relayed it, or answered itself instead): what
    # the upstream sends from here on comes after the response.
    response_complete: bool
    upstream: UpstreamConnection | None  # closed when the upstream sends bytes out of turn

    def response_interim(self, status: int, reason: bytes, headers: Headers) -> None:
        """A 1xx other than 101; the final response follows."""

    def response_head(self, status: int, reason: bytes, headers: Headers, keep: bool) -> int:
        """The final head (101 included); ``keep``: the upstream connection may be reused.

        Returns the length of the body when the reader may count it down and pass it on
        without llhttp (a Content-Length body relayed as is), else -1.
        """
        ...

    def response_body(self, body: bytes) -> None:
        """Body bytes, to be framed for the client."""

    def response_passed(self, body: bytes) -> None:
        """Content-Length body bytes that did not go through llhttp: write them now."""

    def response_end(self) -> None:
        """The final response is complete."""

    def response_malformed(self, why: str) -> None:
        """The response cannot be relayed; ``why`` is for the access log."""

    def response_upgrade(self, tail: bytes) -> None:
        """llhttp stopped at a 101; ``tail`` is what the upstream sent after its head."""

    def internal_error(self, exc: BaseException) -> None:
        """One of relay's own callbacks raised: a bug."""

    def flush(self) -> None:
        """An upstream read was parsed: write what it produced for the client."""


class _Detached:
    """The owner of a reader between two exchanges: whatever llhttp still reports belongs to
    a response that is over (bytes after it mark the connection unusable, see feed)."""

    response_complete = True
    upstream: UpstreamConnection | None = None

    def response_interim(self, status: int, reason: bytes, headers: Headers) -> None:
        pass

    def response_head(self, status: int, reason: bytes, headers: Headers, keep: bool) -> int:
        return -1

    def response_body(self, body: bytes) -> None:
        pass

    def response_passed(self, body: bytes) -> None:
        pass

    def response_end(self) -> None:
        pass

    def response_malformed(self, why: str) -> None:
        pass

    def response_upgrade(self, tail: bytes) -> None:
        pass

    def internal_error(self, exc: BaseException) -> None:
        pass

    def flush(self) -> None:
        pass


DETACHED: Events = _Detached()


class AfterResponse(Exception):
    """Raised in llhttp's callback to stop it at a message after the complete response."""


class ResponseCallbacks:
    """The state of the response being read on one connection, and llhttp's callbacks."""

    __slots__ = (
        "_body_left",
        "_body_seen",
        "_chunk_edge",
        "_closing",
        "_cut",
        "_ended",
        "_extra",
        "_first",
        "_head_bytes",
        "_headers",
        "_in_body",
        "_in_head",
        "_interims",
        "_key",
        "_last",
        "_moved",
        "_owner",
        "_reason",
        "_release",
        "_seen",
        "_sliced",
        "_stalled",
        "_whole",
        "at_chunk",
        "dense",
        "feeding",
        "interim",
        "parser",
        "pieces",
    )

    def __init__(self, owner: Events) -> None:
        self.parser: httptools.HttpResponseParser | None = None  # made by bind
        # Set and cleared within one feed() (see _remembered and _remember).
        self._key: bytes | None = None  # this read's head, to remember if llhttp agrees
        self._seen: KnownResponse | None = None  # what llhttp reported for it
        # The head this connection's last replayed response began with, and what it is: an
        # upstream repeats its head (until its Date changes), compared then instead of hashed.
        self._last: tuple[bytes, KnownResponse] | None = None
        self.feeding = False  # inside feed(): llhttp is parsing one upstream read
        self.dense = False  # the last read fed was a flood of tiny chunks (feed)
        self._sliced = False  # a read of this connection was: its large reads are sliced
        self._whole = b""  # the read being fed in slices (_slices), else empty
        self._cut = 0  # and where the slice being fed ends in it
        self.bind(owner)

    @property
    def began(self) -> bool:
        """Some of a response came for the bound exchange (llhttp began its head)."""
        return self._head_bytes > 0

    def bind(self, owner: Events) -> None:
        """The next exchange on this connection reads its response with this reader.

        The parser carries over when llhttp read the whole previous response: the connection
        is only reused after a complete one (keep-alive, not answering HEAD, nothing after
        it), so llhttp waits for the start of the next message. After a body passed through
        without llhttp (_pass_body) it gets a fresh parser. Everything else starts afresh.
        """
        self._owner = owner
        if self.parser is None:
            self.parser = httptools.HttpResponseParser(self)
            # An interim response with "Connection: close" (RFC 9110 §15.2 lets any 1xx carry
            # fields) would make llhttp refuse the final response that must follow it. With
            # this, llhttp reads on after any closing message; relay itself never reuses a
            # connection after one, and drops what follows a final response with it (_extra).
            # A bare LF ends a line (RFC 9112 §2.2: a recipient MAY recognise one), as nginx
            # and Go's client (E2B's proxy) read it; it was a 502 (found by review). Only
            # here: a request with one is refused (smuggling), and relay writes every head
            # itself, CRLF-framed. The flag is the parser's: llhttp also takes a bare LF after
            # chunk data and in trailers (never after a chunk size), where §7.1 has only CRLF
            # (nginx, lenient there too, turned strict in late 2025: nginx PR #1016). Kept, as
            # turning it off for each body cost two calls per response: relay re-frames every
            # body, so such a chunk misframes nothing but this guest's own connection. A bare
            # CR stays an error (§2.2); a head with a bare LF is never remembered (relay.heads).
            self.parser.set_dangerous_leniencies(
                lenient_keep_alive=True, lenient_optional_cr_before_lf=True
            )
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # the current response head's size, then its trailers'
        self._in_head = False  # fields now are head fields, not trailers
        self._in_body = False  # llhttp reads the final response's body (feed slices floods)
        self.pieces = 0  # body pieces llhttp delivered in the current slice
        self._moved = False  # llhttp delivered a head, body bytes or an end in this feed
        self._stalled = 0  # bytes fed since it last did
        self._reason = b""
        self.interim = False  # a 1xx is being read; its end is not the response's end
        self._interims = 0  # how many 1xx heads this response had (MAX_INTERIM)
        self._closing = False  # an interim response said "Connection: close"
        self._extra = False  # the upstream sent bytes after its complete response
        # A connection whose response ended inside the current read: released to its pool
        # only once the whole read is parsed, so that bytes after the response (which make it
        # unusable) are seen before a pipelined exchange could take it (release_after_feed).
        self._release: tuple[UpstreamConnection, Pool] | None = None
        # Body bytes of a Content-Length response still to come. Once llhttp has framed the
        # head, the rest of such a body is copied straight to the client (_pass_body), not
        # through llhttp's on_body, which would copy every chunk once more.
        self._body_left = -1
        # The next read is the first of this response: llhttp waits at a message start, so a
        # remembered head may stand in for it (_remembered).
        self._first = True
        self._body_seen = 0  # body bytes llhttp delivered in this read
        self._ended = False  # and the response ended in this read
        # llhttp's last event was the end of a chunk of the final response (on_chunk_complete;
        # any later event clears it) ...
        self._chunk_edge = False
        # ... and nothing came after it in the read it parsed: llhttp waits at the start of a
        # chunk-size line, so the exchange may pass a whole chunk on without it
        # (Respond._whole_chunk). Set only after a read llhttp parsed without an error.
        self.at_chunk = False

    def unbind(self) -> None:
        """The exchange is over: it is no longer reported to (and no longer kept alive by this
        reader, which stays with a pooled connection)."""
        self._owner = DETACHED
        # Nothing of the last response stays with an idle connection but _last (one head of at
        # most KNOWN_HEAD_BYTES and KNOWN_FIELDS fields, kept for the next exchange).
        self._headers = []

    # -- llhttp callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._chunk_edge = False
        if self._owner.response_complete:
            self._extra = True
            # llhttp stops here (_feed): what follows the response is dropped with the
            # connection, and parsing it served no one (a read of tiny messages after a
            # response cost ~13 ms per 256 KiB, found by review).
            raise AfterResponse
        self._headers = []
        self._head_bytes = 15  # "HTTP/1.1 200 " and CRLF (on_status adds the reason)
        self._in_head = True
        self._reason = b""  # llhttp does not call on_status for an empty reason phrase

    def on_status(self, reason: bytes) -> None:
        # llhttp reports a reason cut by the end of a feed in pieces, one call each (found by
        # review: a slice or an upstream write ending inside it lost its start). The status
        # line's other 15 bytes are counted in on_message_begin.
        self._reason += reason
        self._head_bytes += len(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4  # trailers are counted too
        if self._in_head:
            self._headers.append((name, value))
        else:
            # A trailer field: one callback, as a chunk is (found by review: a read of
            # 12,000 tiny trailers took 4 ms, never counted, never yielding).
            self.pieces += 1

    def on_headers_complete(self) -> None:
        parser = self.parser
        self._moved = True
        self._in_head = False
        owner = self._owner
        if owner.response_complete or parser is None:
            return  # a head after the complete response: never written to the client
        if self._head_bytes > RESPONSE_HEAD_LIMIT:
            owner.response_malformed("upstream: response head too large")
            return
        status = parser.get_status_code()
        if not 100 <= status <= 599:
            # RFC 9110 §15: a status is 100-599; llhttp takes any three digits. Status 0 would
            # also read as "no response started" in the exchange.
            owner.response_malformed(f"upstream: invalid status {status}")
            return
        headers = tuple(self._headers)
        reason = self._reason
        if reason and _BAD_REASON.search(reason) is not None:
            # RFC 9112 §4: reason-phrase = 1*( HTAB / SP / VCHAR / obs-text ), and llhttp takes
            # any byte but CR and LF. relay writes the status line itself, so a guest's NUL or
            # terminal escape went on to the client (found by review), where the same byte in
            # a field is a 502. A reason is only a hint that a client should ignore and an
            # intermediary may overwrite (RFC 9112 §4): the status's own phrase stands in.
            reason = reason_phrase(status)
        if 100 <= status < 200 and status != 101:
            # An interim response (RFC 9110 §15.2): the final one follows on the same parser.
            self.interim = True
            self.pieces += 1  # a flood of them is a flood too (found by review)
            self._interims += 1
            if self._interims > MAX_INTERIM:
                owner.response_malformed("upstream: too many interim (1xx) responses")
                return
            # RFC 9112 §9.6: the close option ends the connection after the final response.
            self._closing = self._closing or not parser.should_keep_alive()
            owner.response_interim(status, reason, headers)
            return
        self.interim = False
        self._in_body = True
        keep = parser.should_keep_alive() and not self._closing
        if self._key is not None and keep:  # else llhttp ends closed, not at a message start
            self._seen = KnownResponse(status, reason, headers, keep, 0)
        self._body_left = owner.response_head(status, reason, headers, keep)

    def on_body(self, body: bytes) -> None:
        self.pieces += 1
        self._moved = True
        if self.interim:
            return
        self._body_seen += len(body)
        if self._body_left > 0:
            self._body_left -= len(body)
        self._owner.response_body(body)

    def on_chunk_header(self) -> None:
        self._chunk_edge = False

    def on_chunk_complete(self) -> None:
        self._chunk_edge = True  # of the final response: a 1xx has no body (RFC 9110 §15.2)
        # Progress, as a body is (_stalled counts bytes without any): so a read that ends at a
        # chunk's end leaves no count behind, whether the next chunk then goes through llhttp
        # or is passed on whole (found by review: a read of only a chunk's CRLF left 2).
        self._moved = True

    def on_message_complete(self) -> None:
        # After a chunked body llhttp's last event was its last chunk's end (on_chunk_complete
        # follows the trailers too); a Content-Length body, an interim one and none leave this
        # False. Read here, not kept: one load where a store was, for every response.
        chunked, self._chunk_edge = self._chunk_edge, False
        self._in_body = False
        self._moved = True
        if self.interim:
            self.interim = False
            return
        if self._head_bytes > RESPONSE_HEAD_LIMIT:
            # Trailers past the limit, ended in this feed: refused as a sliced read refuses
            # them before their end (found by review: fed whole, they passed).
            self._owner.response_malformed("upstream: response head or trailers too large")
            return
        self._ended = True
        owner = self._owner
        if chunked and self.parser is not None and self.parser.get_http_version() == "1.0":
            # RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding "MUST [be treated] as
            # if the framing is faulty ... and close the connection after processing the
            # message": an HTTP/1.0 hop on the way may not have known the coding. llhttp
            # decodes it and keeps the connection on "Connection: keep-alive" (found by
            # review). The body as decoded is relayed, re-framed (SPEC §5a); the connection is
            # closed before the exchange would release it (the pool takes no closed one). The
            # version is asked only after a chunked body: one call per chunked response (~0.3
            # µs), none for others. Without a body (a 204, 304, or the answer to HEAD) there
            # is nothing to misframe: RFC 9112 §6.3 ends those at their head whatever they say.
            conn = owner.upstream
            if conn is not None:
                conn.close()
        owner.response_end()

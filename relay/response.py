"""Reading an upstream's response: llhttp's callbacks turned into a few events.

A :class:`ResponseReader` is the llhttp protocol for the responses on one upstream
connection, bound to one exchange at a time (a keep-alive connection's responses are one
stream of messages for llhttp, so the parser is kept rather than made per request). It owns
what *parsing* a response needs: the head being read (its fields, reason and size), interim
1xx responses, the count-down of a Content-Length body, the bytes an upstream sends after its
response, and relay's limit on a head or trailer section that never ends. What the upstream
sent is reported to the exchange (:class:`Events`), which decides what the client gets
(``relay.core.responses`` plans the head) and when the exchange ends.

Why an object of its own rather than more methods on the exchange: the exchange then reads as
request in, response out, finish; the rules of reading an HTTP/1.1 response (RFC 9112 §6) and
the quirks of llhttp live here. The price is one call per event (head, body, end) on the
request path; ``bench/micro.py`` measures it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol, cast

import httptools

from relay.core import headers as header_rules
from relay.core.answers import reason_phrase
from relay.flow import FLOOD_PIECES, FLOOD_SLICE, FLOOD_SLICE_MAX, flood_ahead, slice_bounds
from relay.heads import KNOWN_HEAD_BYTES, RESPONSES, KnownResponse, remember

if TYPE_CHECKING:
    from relay.core.model import Headers
    from relay.upstreams import Pool, UpstreamConnection

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


def _out_of_turn(after: bytes) -> bool:
    """Bytes after a complete response make its connection unusable, but for line ends, which
    llhttp skips between messages (a read fed whole keeps the connection after them)."""
    return bool(after.strip(b"\r\n"))


class _AfterResponse(Exception):
    """Raised in llhttp's callback to stop it at a message after the complete response."""


class ResponseReader:
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
            self.parser.set_dangerous_leniencies(lenient_keep_alive=True)
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

    def release_after_feed(self, conn: UpstreamConnection, pool: Pool) -> None:
        self._release = (conn, pool)

    def feed(self, data: bytes) -> bytes:
        """One upstream read; returns what is left of it for the next turn of the loop (the
        rest of a flood of tiny chunks, relay.flow.FLOOD_SLICE), else b"". ``dense`` tells
        whether this read was a flood: the exchange then gives the others a turn."""
        self.feeding = True
        self.dense = False
        try:
            if (
                len(data) > FLOOD_SLICE
                and self._body_left <= 0
                # A read that holds a response head (or part of one) is always sliced: what
                # follows the head is unknown until llhttp has read it, and a guest answering
                # each request with a head and 256 KiB of 1-byte chunks held the loop ~50 ms
                # per response (found by review). It costs one copy of the read (one client
                # write still, _slices) and nothing for a Content-Length body, passed on after
                # the first slice.
                # Inside a body, a connection that sent a flood before is sliced from then on.
                # Else the read's first KiB and two windows further on tell a flood from
                # ordinary chunks or CRLF-dense text before any copy (relay.flow.flood_ahead:
                # a CSV download was sliced read after read, found by review); an ordinary
                # read stays one feed and one client write (found by review: slicing every
                # large body read cost a copy and a second writev).
                and (not self._in_body or self._sliced or flood_ahead(data, False))
            ):
                return self._slices(data)
            self.pieces = 0
            self._feed(data)
            if self.pieces > FLOOD_PIECES:
                # A flood flood_ahead's windows missed, or in a read of at most 8 KiB: fed
                # whole this once, and this connection's later reads are sliced.
                self._sliced = self.dense = True
            return b""
        finally:
            self.feeding = False
            self._key = self._seen = None  # only the read that set them may remember
            release, self._release = self._release, None
            if release is not None:
                conn, pool = release
                if self._extra:
                    conn.close()
                else:
                    pool.release(conn)

    def _slices(self, data: bytes) -> bytes:
        """Feed a read a slice at a time, each twice the last up to FLOOD_SLICE_MAX, until a
        slice holds more than FLOOD_PIECES pieces; return the rest after it, or b"" once the
        response ends, its body leaves llhttp, or a 101 took the rest as its tail."""
        if self._first:
            # A response seen before, whole in this read: replayed without llhttp, so without
            # slices (as _feed would; found by review: mid-size responses lost their memo).
            self._first = False
            self.at_chunk = False
            if self._remembered(data, self._owner):
                return b""
        size = len(data)
        self._whole = data
        owner = self._owner
        try:
            return self._slice(data, size)
        finally:
            self._whole = b""
            # One client write for the read, not one per slice (_feed holds them; found by
            # review: a chunked response in one read went out in ten writes).
            owner.flush()

    def _slice(self, data: bytes, size: int) -> bytes:
        # Slices are views: llhttp reads them in place (httptools takes any buffer), where a
        # bytes slice copied each (~20 µs per 256 KiB read of large chunks, in-process). A
        # view stands in for bytes in _feed, which gives one only to llhttp, len, a compare
        # and bytes() (a 101's tail); its body pass-through and memo never see a slice (this
        # loop stops first: a Content-Length rest goes on as bytes).
        view = memoryview(data)
        for start, end in slice_bounds(size, FLOOD_SLICE, FLOOD_SLICE_MAX):
            self.pieces = 0
            self._cut = end  # where the rest of the read starts, for a 101's tail (_feed)
            self._feed(cast("bytes", view[start:end]))
            # Only a read's first slice starts where its first head does: _remember compares
            # the slice's size with that head and the body llhttp saw (found by review: a
            # later slice of a 1xx head's size plus the body so far stored the 1xx head).
            key, seen, self._key = self._key, self._seen, None
            if end >= size:
                break
            if self.parser is None:
                break  # upgraded, the rest of the read went with the 101 (_feed); or closed
            if self._ended or self._extra:
                # The response is complete: what follows can only be dropped, and the
                # connection not reused, which llhttp would tell only after calling relay
                # three times per chunk of it (found by review).
                if _out_of_turn(data[end:]):
                    self._extra = True
                    conn = self._owner.upstream
                    if conn is not None:
                        conn.close()
                break
            if self._body_left > 0:
                rest = data[end:]
                whole = len(rest) == self._body_left  # the read ends where the body does
                self._owner.flush()  # the head first: the rest is written as it is passed
                self._feed(rest)  # the body went on without llhttp: as read
                if (
                    whole  # so the response ended there (_pass_body)
                    and key is not None
                    and seen is not None
                    and size == len(key) + self._body_seen + len(rest)
                ):
                    # The read was one whole Content-Length response, its first slice the
                    # head and body bytes only: remembered as a whole read is (_remember).
                    remember(
                        RESPONSES, key, seen._replace(length=size - len(key)), len(seen.headers)
                    )
                break
            if self.pieces > FLOOD_PIECES:
                self._sliced = self.dense = True
                return data[end:]
        self.dense = self.pieces > FLOOD_PIECES  # the last slice (an earlier one returned)
        return b""

    def _feed(self, data: bytes) -> None:
        self.at_chunk = False
        if self._body_left > 0 and self._moved:
            self._pass_body(data)
            return
        parser = self.parser
        if parser is None:
            return
        owner = self._owner
        if self._first:
            self._first = False
            if self._remembered(data, owner):
                return
        conn = owner.upstream
        self._moved = False
        try:
            parser.feed_data(data)
            # After on_chunk_complete llhttp reads a chunk-size line, which fires on_chunk_header
            # once its LF arrives: a read ending in CRLF with no event after the chunk's end
            # ends exactly there (an empty size line is an error, raised above).
            self.at_chunk = self._chunk_edge and data[-2:] == b"\r\n"  # (a view: no endswith)
            if self._key is not None:
                self._remember(len(data))
            if not self._whole:  # a slice's output goes with the read's (_slices)
                owner.flush()
        except httptools.HttpParserUpgrade as upgrade:
            tail = bytes(data[upgrade.args[0] :])  # (of a slice, a view: _slice)
            if self._whole:  # a slice (_slices): the rest of the read follows the 101 too
                tail += self._whole[self._cut :]
            owner.response_upgrade(tail)
            return
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _AfterResponse):
                owner.internal_error(exc.__context__ or exc)
                return
        except httptools.HttpParserError as exc:
            if owner.response_complete:
                self._extra = True  # garbage after the response
            else:
                owner.response_malformed(f"upstream: {exc}")
                return
        if self._extra:
            # HTTP/1.1 has no unsolicited responses: whatever followed the response (garbage,
            # or a whole second response meant for the next request) is dropped, and the
            # connection, which was released when the response completed, is not reused.
            # The read's flush, which a parse error or _AfterResponse skipped above.
            owner.flush()
            if conn is not None:
                conn.close()
            return
        if self._moved:
            self._stalled = 0
            if self._body_left > 0:
                return  # the body continues in the next reads, passed through by _pass_body
        else:
            # An unfinished head or trailer line is kept by httptools until it ends.
            self._stalled += len(data)
        if self._stalled > RESPONSE_HEAD_LIMIT or self._head_bytes > RESPONSE_HEAD_LIMIT:
            owner.response_malformed("upstream: response head or trailers too large")

    def _remembered(self, data: bytes, owner: Events) -> bool:
        """A whole response whose head was seen before: its events without llhttp.

        Remembered is only what llhttp reported when it parsed, from a message start, a read
        that was exactly that head and a body of the same length, ending the response (see
        _remember): the same bytes from the same state give llhttp the same results, so the
        events here are the ones llhttp would cause, in its order. llhttp itself stays at the
        message start, where it would be after the response.
        """
        if owner.response_complete:
            return False
        last = self._last
        if last is not None and data.startswith(last[0]):
            # The same head (its first empty line is the key's end): the same response if the
            # rest is as long as its body.
            key, known = last
            cut = len(key)
            if len(data) - cut != known.length:
                return False
        else:
            end = data.find(b"\r\n\r\n", 0, KNOWN_HEAD_BYTES)
            if end < 0:
                return False
            cut = end + 4
            key = data[:cut]
            found = RESPONSES.get(key)
            if found is None or len(data) - cut != found.length:
                self._key = key
                return False
            known = found
            self._last = (key, known)
        status, reason, headers, keep, length = known
        self._moved = True
        self._stalled = 0
        self.interim = False
        try:
            # llhttp's on_headers_complete, on_body and on_message_complete, as below; each
            # asks the reader's owner afresh, as an exchange that ends unbinds the reader.
            self._body_left = left = owner.response_head(status, reason, headers, keep)
            if length:
                if left > 0:
                    self._body_left = left - length
                self._owner.response_body(data[cut:])
            self._owner.response_end()
        except Exception as exc:  # what llhttp does with a callback's exception (_feed)
            owner.internal_error(exc)
            return True
        owner.flush()
        return True

    def _remember(self, size: int) -> None:
        """After llhttp parsed the first read of a response: remember its head if that read
        was exactly one whole final response and its body in one piece (no interim response,
        nothing after it; so not chunked, whose framing is not body)."""
        key, seen = self._key, self._seen  # cleared by feed() once the read is parsed
        if (
            key is not None
            and seen is not None
            and self._ended
            and size == len(key) + self._body_seen
        ):
            remember(RESPONSES, key, seen._replace(length=self._body_seen), len(seen.headers))

    def _pass_body(self, data: bytes) -> None:
        """The rest of a Content-Length body: counted down, written as received (SPEC §4)."""
        left = self._body_left
        owner = self._owner
        if len(data) < left:
            self._body_left = left - len(data)
            owner.response_passed(data)
            return
        # (found by review: line ends after the body closed a reusable connection)
        extra = len(data) > left and _out_of_turn(data[left:])
        self._extra = extra
        self._body_left = 0
        # llhttp never saw this body: it still waits for it, so it cannot read a next response
        # on this connection. The next exchange gets a fresh parser (bind).
        self.parser = None
        conn = owner.upstream
        owner.response_body(data[:left] if len(data) > left else data)
        self.on_message_complete()
        if extra and conn is not None:
            conn.close()  # bytes after the response: never written, never reused (see feed)

    def body_until_close(self) -> bool:
        """The final response has no length: its body ends when the upstream closes."""
        idx = header_rules.index(tuple(self._headers))
        return b"content-length" not in idx and b"transfer-encoding" not in idx

    # -- llhttp callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._chunk_edge = False
        if self._owner.response_complete:
            self._extra = True
            # llhttp stops here (_feed): what follows the response is dropped with the
            # connection, and parsing it served no one (a read of tiny messages after a
            # response cost ~13 ms per 256 KiB, found by review).
            raise _AfterResponse
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
        self._chunk_edge = False
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
        self._owner.response_end()

"""Reading an upstream's response: each read fed to llhttp, or passed on without it.

A :class:`ResponseReader` is the llhttp protocol for the responses on one upstream
connection, bound to one exchange at a time (a keep-alive connection's responses are one
stream of messages for llhttp, so the parser is kept rather than made per request). Its base,
:class:`relay.response_events.ResponseCallbacks`, holds what *parsing* a response needs: the
head being read (its fields, reason and size), interim 1xx responses, relay's limit on a head
or trailer section that never ends, and the callbacks that report what the upstream sent to
the exchange (:class:`~relay.response_events.Events`). This module is the stage before llhttp:
how one upstream read is fed to it (in slices when it may be a flood of tiny pieces), a whole
response seen before replayed from ``relay.heads`` without it, the count-down of a
Content-Length body passed on without it, and the bytes an upstream sends after its response.

Why an object of its own rather than more methods on the exchange: the exchange then reads as
request in, response out, finish; the rules of reading an HTTP/1.1 response (RFC 9112 §6) and
the quirks of llhttp live here. The price is one call per event (head, body, end) on the
request path; ``bench/micro.py`` measures it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import httptools

from relay.core import headers as header_rules
from relay.flow import FLOOD_PIECES, FLOOD_SLICE, FLOOD_SLICE_MAX, flood_ahead, slice_bounds
from relay.heads import KNOWN_HEAD_BYTES, RESPONSES, remember
from relay.response_events import RESPONSE_HEAD_LIMIT, AfterResponse, ResponseCallbacks

if TYPE_CHECKING:
    from relay.response_events import Events
    from relay.upstream_conn import UpstreamConnection
    from relay.upstreams import Pool


# RFC 9112 §2.3: the protocol of every HTTP/1.x message (_not_http).
HTTP = b"HTTP/"


def _out_of_turn(after: bytes) -> bool:
    """Bytes after a complete response make its connection unusable, but for line ends, which
    llhttp skips between messages (a read fed whole keeps the connection after them)."""
    return bool(after.strip(b"\r\n"))


class ResponseReader(ResponseCallbacks):
    __slots__ = ()

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
            owner = self._owner
            if self._remembered(data, owner) or (
                not data.startswith(HTTP) and self._not_http(data, owner)
            ):
                return b""
            if self._first:
                # Only line ends (_not_http): fed whole (llhttp skips them without a callback;
                # sliced, the next slice would be taken for the first read).
                self._feed(data)
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
            if self._remembered(data, owner) or (
                not data.startswith(HTTP) and self._not_http(data, owner)
            ):
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
            if not isinstance(exc.__context__, AfterResponse):
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
            # The read's flush, which a parse error or AfterResponse skipped above.
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

    def _not_http(self, data: bytes, owner: Events) -> bool:
        """The first read of a response, not starting with "HTTP/": True when it is refused.

        llhttp reads a status line of "RTSP/" or "ICE/" too (its on_protocol callback is not
        one httptools sets, nor is the name kept anywhere httptools reads), and relay wrote
        it on as HTTP/1.1. It is no HTTP response (RFC 9112 §2.3: HTTP-name is "HTTP"), and
        Go's client, E2B's proxy, refuses one ("malformed HTTP version"): a 502. Read here,
        where the read's first bytes are the head's, before llhttp: one test per response
        llhttp parses (a remembered head was tested when first seen). Garbage, which llhttp
        refused as well, is refused here first. Not the final head after a 1xx (RFC 9110
        §15.2): httptools reports no offset of a message start inside a read, so where that
        head begins is unknown; it stays relayed as HTTP/1.1, which misframes nothing (relay
        frames the body itself, SPEC §5a).
        """
        if owner.response_complete:
            return False  # not this response's bytes: llhttp stops at them (on_message_begin)
        head = data.lstrip(b"\r\n")  # llhttp skips line ends before a message
        if not head:
            self._first = True  # only line ends: the head starts in a later read
            return False
        if HTTP.startswith(head[:5]):
            return False  # "HTTP/" cut by the read's end: llhttp refuses any other rest
        self.parser = None  # it never saw this read: nothing more is parsed on it
        owner.response_malformed("upstream: not an HTTP response")
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

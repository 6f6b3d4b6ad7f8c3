"""Request bodies on a client connection: from llhttp, or passed on as read.

llhttp hands each piece of a request body to ``on_body`` as a copy of the read it came in. A
Content-Length body needs no parsing once its head is framed (RFC 9112 §6.2: the next N bytes
are the body, whatever they are), so when a read ends inside one, the client connection
counts the rest down itself and hands each read on as it is (:meth:`RequestBodies._pass_body`),
as ``relay.response`` does for response bodies. A 64 MiB upload then costs relay one copy of
each read less: ``bench.rounds upload --compare``, eight interleaved rounds on a ninth host,
proxy CPU per transfer 51.7 → 45.0 ms, where the bare forwarder ``bench/floor.py`` took 43.3
(bench/README.md, "A ninth host").

Only for a request that keeps the connection: after one that closes it, llhttp refuses what
follows, which a fresh parser would read as a request. Chunked bodies and trailers always go
through llhttp, whose framing of them relay relies on (SPEC §5a).

The pieces llhttp hands over while it parses one read are gathered and passed on together
(:meth:`RequestBodies._deliver`, when the read is parsed or the request ends in it): a chunked
body of 1-byte chunks is ~43,000 pieces per 256 KiB read, and a write upstream for each of
them held the loop for seconds while every other client waited (the upstream got as many
1-byte chunks). Chunk boundaries carry no meaning (RFC 9112 §7.1: a proxy may re-chunk), and
the read is passed on as soon as it is parsed, so nothing waits for more bytes.

Why a base class: as :class:`relay.departures.Departures` (its own base, above
:class:`relay.refusals.Refusals` and :class:`relay.closing.Closing`), these methods read and
write the fields of the one connection. ``ClientConnection`` sets them in ``__init__``; the
slots of the fields only this half uses are declared here.
"""

from __future__ import annotations

import httptools

from relay.departures import Departures

# A read's body pieces beyond this many are joined before they go upstream: one copy of many
# small pieces costs less than a write each. Fewer (large chunks, an ordinary upload's reads)
# go as they are, without a copy.
JOIN_PIECES = 8


class RequestBodies(Departures):
    """The request-body half of a client connection (see the module docstring)."""

    __slots__ = (
        "_body_left",
        "_body_seen",
        "_headers",
        "_moved",
        "_pieces",
        "_read_pieces",
        "_stalled",
        "_unlengthed",
    )

    _headers: list[tuple[bytes, bytes]]
    _body_left: int  # the rest of a Content-Length body, passed without llhttp
    _body_seen: int  # body bytes of the current request so far
    _unlengthed: bool  # the current request's fields were searched: no Content-Length
    _moved: bool
    _stalled: int
    _pieces: list[bytes]  # body pieces llhttp handed over in the read it parses (_deliver)
    _read_pieces: int  # how many were delivered from that read (relay.flow.YIELD_EVENTS)

    def data_received(self, data: bytes) -> None:
        raise NotImplementedError  # ClientConnection's

    def on_message_complete(self) -> None:
        raise NotImplementedError  # RequestHeads' (relay.request_heads)

    def on_body(self, body: bytes) -> None:
        """llhttp's callback: body bytes for the current request, passed on by _deliver."""
        self._moved = True
        self._body_seen += len(body)
        self._pieces.append(body)

    def _deliver(self) -> None:
        """Pass on the body pieces gathered from llhttp: called once the read is parsed and
        when the request ends within it (before its end is passed on). Up to JOIN_PIECES
        pieces go as they are, more are joined into one."""
        pieces = self._pieces
        if not pieces:
            return
        count = len(pieces)
        self._read_pieces += count
        self._pieces = []
        receiving = self.receiving
        if receiving is None or self.closing:
            return
        try:
            if count > JOIN_PIECES:
                receiving.request_body(b"".join(pieces))
            else:
                for piece in pieces:
                    receiving.request_body(piece)
        except Exception as exc:  # what data_received does with a callback's exception
            self.internal_error(exc)

    def _passed(self, body: bytes) -> None:
        """Body bytes passed on without llhttp (_pass_body)."""
        self._moved = True
        self._body_seen += len(body)
        if self.receiving is not None and not self.closing:
            self.receiving.request_body(body)

    def _content_left(self) -> int:
        """Bytes still to come of a Content-Length body that a read ended inside of, else 0
        (a chunked body, trailers: llhttp frames those). llhttp admitted the head, so a
        Content-Length is one value of digits and comes without Transfer-Encoding (RFC 9112
        §6.3)."""
        if self._unlengthed:
            return 0  # searched already: a chunked body's every read would walk the fields
        for name, value in self._headers:
            if len(name) == 14 and name.lower() == b"content-length":
                # llhttp bounds the value to 64 bits but not its leading zeros, and int()
                # refuses more than sys.get_int_max_str_digits() digits (found by review).
                return max(0, int(value.strip().lstrip(b"0") or b"0") - self._body_seen)
        self._unlengthed = True
        return 0

    def _pass_body(self, data: bytes) -> None:
        """A read of a Content-Length body that llhttp began (SPEC §4: forwarded as read).

        llhttp never sees the rest of the body, so it still waits for it when the body ends:
        the next request gets a fresh parser, as llhttp would start it (at a message start,
        the connection kept). What follows the body in the same read is that next request.
        """
        left = self._body_left
        self._stalled = 0
        try:
            if len(data) < left:
                self._body_left = left - len(data)
                self._passed(data)
                return
            self._body_left = 0
            rest = data[left:] if len(data) > left else b""
            self._passed(data[:left] if rest else data)
            if self.closing:
                return  # the body went past what an answered exchange discards
            self.parser = httptools.HttpRequestParser(self)
            self.on_message_complete()
        except Exception as exc:  # what data_received does with a callback's exception
            self.internal_error(exc)
            return
        if rest:
            self.data_received(rest)

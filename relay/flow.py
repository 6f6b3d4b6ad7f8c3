"""The contract between a client connection and what runs on it (exchanges, splices).

``relay.server`` implements :class:`Client`; ``relay.forward`` and ``relay.websocket`` only
see this interface, which keeps the import graph a tree and makes each side testable alone.

Flow control is by reasons: a client connection stops reading while any reason to pause is
set and resumes when the last one is cleared, so independent parts (a dialling exchange, a
full upstream buffer, queued pipelined requests) never resume each other's pause by mistake.
Plain ``int`` bits rather than ``enum.IntFlag``: they are set and cleared per request.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Iterator

    from relay.runtime import Relay
    from relay.websocket import Splice

PAUSE_UPSTREAM_FULL = 1  # the upstream's write buffer is full (request body backpressure)
PAUSE_DIAL = 2  # the active exchange waits for its upstream connection
PAUSE_QUEUE = 4  # pipelined requests wait behind the active exchange
PAUSE_UPGRADE = 8  # a WebSocket handshake is in flight
PAUSE_CLIENT_FULL = 16  # the client does not read what relay answers it (see pause_writing)
PAUSE_YIELD = 32  # a read held many requests or body pieces: the others' turn first

# A client read from which llhttp delivered more than YIELD_EVENTS request heads and body
# pieces (a chunked body of tiny chunks, pipelined requests relay answers itself) pauses that
# client until the event loop's next turn. libuv reads a socket that fills its buffer up to
# 32 times in a row before it polls the others: a chunked upload of 1-byte chunks held the loop
# for 0.6-7 s at a time, every other client waiting (measured; README "Decisions"). An ordinary
# upload, whose reads are a few pieces each, still reads on.
YIELD_EVENTS = 128
# In a read or slice of FLOOD_SLICE bytes or more, a request head counts as REQUEST_EVENTS
# of them; and any head one more per FIELDS_PER_EVENT fields: relay's work per pipelined
# request (a decision, an exchange) is ~16 µs for a small head, ~80 body pieces' worth, and
# ~150 µs for a head of 2 KiB in 56 fields. Fields, not bytes: a 12 KiB cookie is one field
# (weighed by its bytes, it made an upload's ordinary chunks dense, found by review), and
# heads of 4-byte fields cost the most per byte. A 32 KiB slice held ~109 requests of 300 bytes
# or 16 of 2 KiB, never dense, so a read of them was fed slice after slice in one callback
# (found by two reviews). Smaller reads count a request as one (its fields still weigh):
# they cannot hold the loop long, and 17 pipelined GETs in 1.2 KiB made the connection sliced
# for ever (found by review). 12 GETs of 40 fields in 4.8 KiB (~0.75 ms) are dense.
REQUEST_EVENTS = 8
FIELDS_PER_EVENT = 4

# A response read of more than FLOOD_SLICE bytes is fed to llhttp in slices (slice_bounds)
# when it holds a head, or lies inside a body that llhttp parses and a flood lies ahead in it
# (flood_ahead) or an earlier read of the connection was a flood; after a slice of more than
# FLOOD_PIECES body pieces (chunks of under 64 bytes on average), the rest of the read waits
# for the next turn of the event loop, the upstream unread meanwhile (relay.response). A read
# fed whole that held more than FLOOD_PIECES pieces (or 1xx heads) gives the others a turn
# all the same. llhttp calls Python once per chunk, and a response of 1-byte chunks cost
# ~50 ms per 256 KiB read, during which relay served no one else (found by review for
# WebSocket frames; the same held for chunks). Legitimate chunks are far larger. A client's
# reads are sliced the same way once one of them was dense (relay.slices, YIELD_EVENTS).
FLOOD_SLICE = 8 * 1024
FLOOD_PIECES = 128
# A slice that was not dense is followed by one twice its size, up to FLOOD_SLICE_MAX: an
# ordinary 256 KiB read of a sliced connection is 10 feeds (and writes), not 32 (found by
# review: slicing every later read at 8 KiB tripled an ordinary upload's CPU). A dense slice
# of FLOOD_SLICE_MAX bytes is ~5,500 1-byte chunks, measured by review at ~0.75 ms of a
# request body and ~2.5 ms of a response (whose pieces are framed for the client); 64 KiB
# measured twice that. Not bounded this way: a flood that flood_ahead's windows miss is fed
# whole, once per connection (README, "Decisions").
FLOOD_SLICE_MAX = 32 * 1024


# A read over FLOOD_SLICE bytes is sliced from its start, before a dense read made its
# connection sliced, when its first DENSE_SAMPLE bytes hold more than DENSE_LINES CRLFs: lines
# or chunks of under 64 bytes on average, the density of FLOOD_PIECES pieces in FLOOD_SLICE
# bytes. The count is a scan in C at ~1 ns per byte here: over 8 KiB it cost ~9 µs per
# 256 KiB read of a chunked download, a quarter of relaying it (measured in-process); over
# 1 KiB, ~1 µs. A flood behind an ordinary first KiB is looked for in two windows further on
# (flood_ahead).
DENSE_SAMPLE = 1024
DENSE_LINES = 32


def dense_start(data: bytes) -> bool:
    """The read begins dense with line ends, as a flood of tiny pieces does (DENSE_SAMPLE)."""
    return data.count(b"\r\n", 0, DENSE_SAMPLE) > DENSE_LINES


# The size line of a chunk of under 64 bytes after a line end (RFC 9112 §7.1: hex digits,
# then extensions or CRLF; llhttp takes leading zeros, so any number of them).
_SIZE_LINE = re.compile(rb"\n0*([0-3]?[0-9A-Fa-f])[;\r]")  # (llhttp refuses a blank after)
_FIELD_NAME = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+:"  # a token, then a colon (RFC 9110 §5.1)
# A field line after a line end: of a trailer section, within a body. A leading "\n" lets
# the engine scan for it in C (an alternative with "^" made the match 7x slower on text).
_FIELD_LINE = re.compile(rb"\n" + _FIELD_NAME)
# What may follow a chunk: the next chunk's size line, the end of a trailer section, or a
# trailer field (RFC 9112 §7.1).
_NEXT_LINE = re.compile(rb"0*[0-9A-Fa-f]{1,16}[;\r]|\r\n|" + _FIELD_NAME)


def _more_than(pattern: re.Pattern[bytes], count: int, data: bytes, start: int, end: int) -> bool:
    """``pattern`` matches more than ``count`` times in ``data[start:end]`` (it stops there)."""
    matches = pattern.finditer(data, start, end)
    return sum(1 for _ in itertools.islice(matches, count + 1)) > count


def dense_framing(data: bytes, start: int = 0, end: int = DENSE_SAMPLE) -> bool:
    """Within a chunked body: ``data[start:end]`` (the read's first KiB, or a window,
    flood_ahead) holds more than DENSE_LINES // 2 chunks of under 64 bytes per KiB, each a
    size line whose data ends in CRLF where the size says, or as many trailer fields (each
    one callback, as a chunk is). Line ends of the payload are not counted (a CSV download
    or upload was sliced read after read, found by review), nor rows of short numbers or hex
    words (found by the next review). Such rows
    stop the count early: a chunk of under 64 bytes holds at most 21 of them, so more than
    20 per chunk counted so far is text (without the stop, 0.4-0.65 ms per read of them,
    found by review; a flood behind such a start is looked for further on, flood_ahead).
    ~8 µs per KiB of text, ~20 µs of short numbers, ~15-25 µs of a flood; called only for a
    span that is dense with line ends."""
    need = DENSE_LINES // 2 * (end - start) // DENSE_SAMPLE
    lines = misses = 0
    for match in _SIZE_LINE.finditer(data, start, end):
        lf = data.find(b"\n", match.end() - 1)
        if lf < 0:
            break
        stop = lf + 1 + int(match.group(1), 16)  # (not ``end``: the span's, found by review)
        if stop + 2 < len(data) and (
            data[stop : stop + 2] != b"\r\n" or not _NEXT_LINE.match(data, stop + 2)
        ):
            # Not a chunk: a row that begins with a short hex number, or one whose data ends
            # in CRLF where the size says but is not followed by a size line or a trailer
            # field (rows like "5 x y" were, found by review).
            misses += 1
            if misses > 20 * (lines + 1):
                return False
            continue
        lines += 1
        if lines > need:
            return True
    return _more_than(_FIELD_LINE, need, data, start, end)


# A flood behind an ordinary first KiB was fed whole, once per connection: 8-9 ms of a
# client's 256 KiB read of 1-byte chunks, ~27 ms of a guest's response (in-process), each
# time on a new connection. So two windows of DENSE_WINDOW bytes after the first KiB are
# tested too, each at a random place: fixed places are known, and an attacker would keep them
# ordinary. A flood over a share f of the rest of the read, however laid out, goes unseen
# with a chance of (1 - f)^2, so the most a read can be expected to cost fed whole is 4/27
# of a whole flood's (f = 1/3), not all of it (two windows half the read apart would leave a
# quarter to two runs half the read apart). The longest a callback held the loop was then
# ~1 ms for either. A window costs a random draw and a count over 256 bytes (~0.7-1.5 µs here),
# and dense_framing (~2 µs) when it is dense with line ends (CSV text, a flood).
DENSE_WINDOW = 256
# The end of a request line (RFC 9112 §3): llhttp also takes "RTSP/1.1" or "ICE/1.0" for
# the protocol (found by review; relay refuses such a head, request_heads._http_line, but
# only once llhttp has read it), and text such as an access log's '"GET / HTTP/1.1" 200' has
# no line end after it (found by review: an upload of one was sliced read after read).
_REQUEST_END = re.compile(rb"/1\.[01]\r\n")
# Seeded from os.urandom. Not a secret: a peer sees no draw (os.urandom per read would be a
# system call per large read).
_places = random.Random()  # noqa: S311


def flood_ahead(data: bytes, at_message_start: bool, *, requests: bool = False) -> bool:
    """The read is a flood of tiny pieces, or holds one: it begins dense with line ends (and
    within a body, not ``at_message_start``, where pipelined heads are the flood, with
    chunk-size lines or trailer fields too), or one of two windows further on is dense with
    chunk-size lines or trailer fields. The one test both sides apply to a large read of a
    connection not yet sliced (relay.server, relay.response).

    ``requests`` (a client's read): pipelined request heads are a flood too, each far
    costlier than a body piece (~16 µs, found by review): two request lines in the first KiB,
    or one in the KiB that ends with a window (so requests of up to 1 KiB, whole-fed at most
    ~4 ms of them per read behind that, are seen). Requests of 52 bytes or more were too
    sparse in field lines for a window's count (found by review: 256 KiB of 68-byte
    requests held the loop 62 ms)."""
    if dense_start(data) and (at_message_start or dense_framing(data)):
        return True
    if requests and _more_than(_REQUEST_END, 1, data, 0, DENSE_SAMPLE):
        return True
    span = len(data) - DENSE_SAMPLE - DENSE_WINDOW
    if span <= 0:
        return False
    for _ in range(2):
        start = DENSE_SAMPLE + int(_places.random() * span)
        end = start + DENSE_WINDOW
        if requests and _REQUEST_END.search(data, max(DENSE_SAMPLE, end - DENSE_SAMPLE), end):
            return True
        if data.count(b"\r\n", start, end) > DENSE_LINES * DENSE_WINDOW // DENSE_SAMPLE and (
            dense_framing(data, start, end)
        ):
            return True
    return False


def slice_bounds(size: int, first: int, most: int) -> Iterator[tuple[int, int]]:
    """Where the slices of a read of ``size`` bytes start and end: ``first`` bytes, then each
    twice the last up to ``most`` (the callers pass FLOOD_SLICE and FLOOD_SLICE_MAX as their
    own modules see them, which tests and the fuzz harness set smaller)."""
    end, step = 0, first
    while end < size:
        start, end = end, end + step
        step = min(2 * step, most)
        yield start, end


class Client(Protocol):
    """What exchanges and splices need from the client connection they run on."""

    relay: Relay
    peer: str
    write_paused: bool  # the client's socket buffer is full: stop reading the upstream
    client_eof: bool  # the client sent its FIN (relay.departures, eof_received)

    def write(self, data: bytes) -> None: ...
    def writelines(self, parts: list[bytes]) -> None: ...
    def pause(self, reason: int) -> None: ...
    def resume(self, reason: int) -> None: ...
    def resume_all(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...
    def start_splice(self, splice: Splice) -> None: ...
    def exchange_finished(self, exchange: object, *, keep_alive: bool) -> None: ...
    def exchange_cut(self, exchange: object) -> None: ...
    def drop_after_fin(self) -> None: ...
    def discarding(self) -> None: ...

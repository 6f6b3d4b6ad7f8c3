"""Dense client reads (relay.slices, relay.bodies): the pieces llhttp hands over from one read
go upstream as one chunk; a read of more than YIELD_EVENTS heads and pieces pauses the client
for a turn of the loop, and the connection's later large reads are fed in slices of
FLOOD_SLICE bytes, the rest of a read waiting for the next turn after a dense slice.

Measured before these (tests note it, bench/README.md has the numbers): a chunked upload of
1-byte chunks held relay's loop for seconds, a GET beside it waiting 6.9 s.

The property test feeds random request streams (tiny and larger chunks, Content-Length
bodies, a WebSocket handshake with bytes after it, a malformed request, reads that come
within one turn as the TLS hand-over feeds them, a FIN) with and without slicing, and
compares what the upstream and the client get.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import drain, flow, server
from relay.answer import DISCARD_LIMIT
from relay.upstream_conn import UpstreamConnection
from relay.upstreams import PoolKey
from tests.support.wired import DOMAIN, RESPONSE, Recorder, Wired, make_wired

HOST = f"3000-sbx.{DOMAIN}"
HEAD = f"POST /up HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
HANDSHAKE = (
    f"GET /ws HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
).encode()
SWITCHED = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
TAIL = b"\x81\x85\0\0\0\0hello" * 2000  # WebSocket frames sent right after the handshake
MALFORMED = b"GET /bad HTTP/1.1\r\nHost: " + HOST.encode() + b"\r\nX-A: a\r\n b\r\n\r\n"


def chunks(size: int, count: int, fill: bytes = b"x") -> bytes:
    return (b"%x\r\n" % size + fill * size + b"\r\n") * count


def reading(wired: Wired) -> bool:
    return wired.client_transport.reading  # a call: mypy would narrow an attribute


def unparsed(wired: Wired) -> bool:
    return wired.client.unparsed  # a call, as reading()


def upstream_got(wired: Wired) -> bytes:
    return wired.upstream_transport.data


def pooled(wired: Wired, count: int) -> None:
    """``count`` more idle upstream connections in the pool, recording into the first one's
    events: an exchange that starts while the one before it still holds its connection (the
    response ended within llhttp's feed) takes one of these, and what each is sent shows in
    the order it was sent."""
    for _ in range(count):
        conn = UpstreamConnection(wired.relay.pool, PoolKey("sbx", 0, "127.0.0.1", 3000))
        transport = Recorder(("127.0.0.1", 3000))
        transport.events = wired.upstream_transport.events
        conn.connection_made(transport)  # type: ignore[arg-type]
        wired.relay.pool.release(conn)


def answer(wired: Wired) -> bool:
    """Answer the active exchange from its upstream connection; whether there was one."""
    active = wired.client.active
    if active is None or active.upstream is None:
        return False
    active.upstream.data_received(SWITCHED if active.head.upgrade else RESPONSE)
    wired.turns.end()
    return True


def run_turns(wired: Wired, limit: int = 1000) -> int:
    """Run the loop's pending callbacks one at a time; how many ran."""
    turns = 0
    while wired.turns.pending and turns < limit:
        wired.turns.pending.pop(0)()
        turns += 1
    return turns


def meaning(stream: bytes) -> list[bytes]:
    """Request heads, their bodies' payloads and what follows an upgrade: what a stream sent
    upstream means, whatever its chunk boundaries (which depend on where reads end)."""
    out: list[bytes] = []
    pos = 0
    while pos < len(stream):
        end = stream.index(b"\r\n\r\n", pos) + 4
        head = stream[pos:end]
        out.append(head)
        pos = end
        fields = head.lower()
        if b"upgrade: websocket" in fields:
            out.append(stream[pos:])  # the WebSocket's bytes, raw
            break
        if b"transfer-encoding: chunked" in fields:
            body = b""
            while True:
                line_end = stream.index(b"\r\n", pos)
                size = int(stream[pos:line_end], 16)
                pos = line_end + 2
                body += stream[pos : pos + size]
                pos += size + 2
                if not size:
                    break
            out.append(body)
        elif b"content-length: " in fields:
            length = int(fields.split(b"content-length: ")[1].split(b"\r\n")[0])
            out.append(stream[pos : pos + length])
            pos += length
    return out


# -- one read: its pieces as one chunk, and a turn for the others ----------------------------
def test_the_pieces_of_one_read_go_upstream_as_one_chunk(tmp_path: Path) -> None:
    """Before: one upstream write per piece, 43,000 per 256 KiB read of 1-byte chunks."""
    wired = make_wired(tmp_path, busy=1 << 30)  # writes not held: seen as they are made
    wired.client.data_received(HEAD)
    wired.turns.end()
    writes = len(wired.upstream_transport.events)
    wired.client.data_received(chunks(1, 100) + chunks(5, 3, b"y"))
    assert wired.upstream_transport.events[writes:] == [
        ("write", b"73\r\n" + b"x" * 100 + b"y" * 15 + b"\r\n")
    ]
    writes = len(wired.upstream_transport.events)
    wired.client.data_received(chunks(3, 2, b"z"))  # a few pieces go as they are, uncopied
    assert wired.upstream_transport.events[writes:] == [("write", b"3\r\nzzz\r\n")] * 2


def test_a_dense_read_gives_the_others_a_turn(tmp_path: Path) -> None:
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(HEAD)
    wired.turns.end()
    wired.client.data_received(chunks(1, flow.YIELD_EVENTS + 1))
    assert not reading(wired)  # until the loop's next turn
    wired.turns.end()
    assert reading(wired)


def test_an_ordinary_read_reads_on(tmp_path: Path) -> None:
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(HEAD)
    wired.turns.end()
    body = chunks(4096, 60)  # 240 KiB in 60 pieces
    wired.client.data_received(body)
    assert reading(wired)
    assert not wired.client._sliced
    assert meaning(upstream_got(wired) + b"0\r\n\r\n")[1] == b"x" * 4096 * 60


def test_a_first_read_that_begins_dense_is_sliced_from_its_start(tmp_path: Path) -> None:
    """A connection's first dense read was fed whole (~8 ms per 256 KiB of 1-byte chunks, every
    other client waiting): one whose first KiB is dense with CRLFs is sliced at once."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(HEAD + chunks(1, 40_000))
    assert not reading(wired)
    assert 0 < upstream_got(wired).count(b"x") <= flow.FLOOD_SLICE // 6 + 1
    assert run_turns(wired) >= 40_000 * 6 // flow.FLOOD_SLICE_MAX
    assert reading(wired)
    assert meaning(upstream_got(wired) + b"0\r\n\r\n")[1] == b"x" * 40_000


def test_a_first_read_of_long_lines_is_fed_whole(tmp_path: Path) -> None:
    """Only a dense start slices a first read: chunks of 100 bytes (2 CRLFs in 106) are not."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(HEAD)
    wired.turns.end()
    writes = len(wired.upstream_transport.events)
    wired.client.data_received(chunks(100, 100))  # over FLOOD_SLICE
    assert not wired.client._sliced
    assert len(wired.upstream_transport.events) == writes + 1  # one feed, one joined chunk


ACCESS_LOG = b"".join(
    b'10.0.0.%d - - [01/Dec/2026:17:00:00 +0000] "GET /api/items/%d HTTP/1.1" 200 512 "-"\n'
    % (n % 250, n)
    for n in range(400)
)


@pytest.mark.parametrize("text", ["csv", "access log"])
def test_a_chunked_upload_of_text_is_one_feed_and_one_write_per_read(
    tmp_path: Path, text: str
) -> None:
    """Found by review: within a body, CRLFs may be the payload's (RFC 4180 rows end in CRLF),
    and the dense start of such reads sliced each one, 25 upstream writes per read. So did
    an access log's '"GET / HTTP/1.1" 200', taken for pipelined request lines (found by the
    next review)."""
    row = b"2026-12-01,13:50,42.0\r\n"
    chunk = row * (16384 // len(row)) if text == "csv" else ACCESS_LOG[:16384]
    body = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 16  # one 256 KiB read
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(HEAD)
    wired.turns.end()
    before = len(wired.upstream_transport.events)
    for _ in range(4):
        wired.client.data_received(body)
        wired.turns.end()
    assert not wired.client._sliced
    assert len(wired.upstream_transport.events) - before == 4
    assert meaning(upstream_got(wired) + b"0\r\n\r\n")[1] == chunk * 16 * 4


@pytest.mark.parametrize("size_line", [b"1", b"0" * 20 + b"1", b"1;e=v"])
def test_a_flood_in_the_first_read_after_the_head_yields(tmp_path: Path, size_line: bytes) -> None:
    """Found by review: with the dense start tested only where a message may begin, a client
    sending its head, then 1-byte chunks, had that read fed whole on every new connection
    (17.5 ms per 256 KiB). Within a body, chunk-size lines are counted: leading zeros or an
    extension do not hide them."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(HEAD)
    wired.turns.end()
    wired.client.data_received((size_line + b"\r\nx\r\n") * 20_000)
    assert not reading(wired)
    assert 0 < upstream_got(wired)[len(HEAD) :].count(b"x") <= flow.FLOOD_SLICE // 6 + 1
    run_turns(wired)
    assert meaning(upstream_got(wired) + b"0\r\n\r\n")[1] == b"x" * 20_000


def test_a_read_of_requests_with_tiny_trailers_yields(tmp_path: Path) -> None:
    """Found by review: trailer fields are callbacks, as body pieces are, but were not
    counted: 16 pipelined requests with 4,000 tiny trailers each took 12.9 ms of one read."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received((HEAD + b"0\r\n" + b"a:\r\n" * 4000 + b"\r\n") * 16)
    assert unparsed(wired)  # the rest of the read waits for a later turn


def test_a_read_of_trailers_alone_yields(tmp_path: Path) -> None:
    """Found by review: a read of tiny trailer fields after the last chunk, in a read of its
    own, was fed whole (~9 ms per 256 KiB), on every new connection: within a body, field
    lines count as chunk-size lines do (relay.flow.dense_framing)."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(HEAD + b"1\r\nx\r\n0\r\n")
    wired.turns.end()
    wired.client.data_received(b"a:\r\n" * 4000)  # under max_header_bytes
    assert unparsed(wired)


PIPELINED = f"GET /p HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()


@pytest.mark.parametrize("places", [(0.0, 0.5), (0.4, 0.0), (0.999, 0.999)])
@pytest.mark.parametrize("flood", ["tiny chunks", "pipelined requests"])
def test_a_flood_behind_an_ordinary_first_kib_yields(
    tmp_path: Path, places: tuple[float, float], flood: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new connection's first read, an ordinary start of 2 KiB, then a flood: fed whole
    before, ~8 ms of 1-byte chunks or ~30 ms of pipelined requests per 256 KiB, on every new
    connection. Two windows at random places see it (relay.flow.flood_ahead)."""
    monkeypatch.setattr(flow._places, "random", itertools.cycle(places).__next__)
    wired = make_wired(tmp_path, busy=1 << 30)
    if flood == "tiny chunks":
        read = HEAD + chunks(2048, 1, b"o") + chunks(1, 4000)
    else:
        post = f"POST /o HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 2048\r\n\r\n"
        read = post.encode() + b"o" * 2048 + PIPELINED * 800
    assert not flow.dense_start(read)
    wired.client.data_received(read)
    assert unparsed(wired)  # the rest of the read waits for a later turn


def test_ordinary_reads_are_not_floods_wherever_the_windows_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The windows must not slice what the first KiB's test lets through: a chunked download
    or upload of CSV rows, of 4 KiB chunks, or of binary data, whole or cut anywhere."""
    rows = b"".join(b"%d,%d,name-%d\r\n" % (n, n * 7, n) for n in range(12_000))
    csv = b"%x\r\n" % len(rows) + rows + b"\r\n"
    binary = bytes(range(256)) * 1024
    reads = [csv, chunks(4096, 60), b"%x\r\n" % len(binary) + binary + b"\r\n"]
    for place in [n / 40 for n in range(40)]:
        monkeypatch.setattr(flow._places, "random", lambda place=place: place)
        for read in reads:
            for cut in (0, 1, 4099, 70_000):
                assert not flow.flood_ahead(read[cut:], False), (place, cut, read[:20])


@pytest.mark.parametrize("places", [(0.0, 0.5), (0.4, 0.0), (0.999, 0.999)])
@pytest.mark.parametrize("size", [68, 300, 600])
def test_pipelined_requests_behind_an_ordinary_start_yield(
    tmp_path: Path, places: tuple[float, float], size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: pipelined requests of 52 bytes or more (one field line each) were too
    sparse for a window's field-line count, and each costs ~16 µs: 256 KiB of 68-byte ones
    held the loop ~62 ms in one callback. A request line in a window, or two in the first
    KiB, slice the read; and a request weighs REQUEST_EVENTS pieces, so that a slice of
    larger ones yields too (a 32 KiB slice held ~109 of 300 bytes, never dense)."""
    monkeypatch.setattr(flow._places, "random", itertools.cycle(places).__next__)
    wired = make_wired(tmp_path, busy=1 << 30)
    post = f"POST /o HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 2048\r\n\r\n".encode()
    fields = f" HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()  # one field line each
    request = b"GET /" + b"p" * (size - 5 - len(fields)) + fields
    count = 200_000 // size
    wired.client.data_received(post + b"o" * 2048 + request * count)
    assert unparsed(wired)  # the rest waits for a later turn
    assert wired.client.requests < count // 4  # and only a small part was taken in


def test_trailer_fields_after_the_last_chunk_are_counted_in_the_first_kib() -> None:
    """Found by review: dense_framing's chunk loop reused the name of the span's end, so
    fields after a size line were counted only up to that chunk's data."""
    assert flow.dense_framing(b"5\r\nhello\r\n0\r\n" + b"a:\r\n" * 3500 + b"\r\n")


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_rows_of_small_numbers_are_not_chunks(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: rows like "5 x y" have their CRLF where a size of 5 says, and the
    256-byte windows counted more of them than the first KiB did: an upload of such rows
    was sliced read after read, 25 upstream writes each. A chunk must also be followed by a
    size line, a trailer field or the section's end (and llhttp refuses a blank after a
    size)."""
    rng = random.Random(seed)
    rows = b"".join(
        b"%d %d %d\r\n" % (rng.randrange(10), rng.randrange(10), rng.randrange(10))
        for _ in range(3000)
    )[:16384]
    read = (b"%x\r\n" % len(rows) + rows + b"\r\n") * 16
    for place in [n / 20 for n in range(20)]:
        monkeypatch.setattr(flow._places, "random", lambda place=place: place)
        assert not flow.flood_ahead(read, False, requests=True), place


def test_the_framing_count_stops_early_on_rows_of_short_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: each row like "17" is a size line whose data does not end where the
    size says, checked in Python: 0.4-0.65 ms per read of them. A chunk of under 64 bytes
    holds at most 21, so the count stops at 21 without a chunk."""
    seen: list[int] = []
    pattern = flow._SIZE_LINE

    class Counting:
        def finditer(self, data: bytes, start: int, end: int) -> Any:  # as re.Pattern's
            for match in pattern.finditer(data, start, end):
                seen.append(1)
                yield match

    monkeypatch.setattr(flow, "_SIZE_LINE", Counting())
    rows = b"17\r\n" * 60_000
    assert flow.dense_start(rows)
    assert not flow.dense_framing(rows)
    assert len(seen) == 21
    seen.clear()
    assert flow.dense_framing(b"1\r\n0\r\n" * 2000)  # 1-byte chunks of "0": a flood still


# -- a sliced connection ----------------------------------------------------------------------
def sliced(tmp_path: Path) -> Wired:
    """A connection whose upload began with a dense read: its large reads are sliced."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(HEAD + chunks(1, flow.YIELD_EVENTS + 1))
    wired.turns.end()
    assert wired.client._sliced
    assert reading(wired)
    return wired


def test_a_sliced_connections_dense_read_is_fed_over_several_turns(tmp_path: Path) -> None:
    wired = sliced(tmp_path)
    before = len(upstream_got(wired))
    flood = chunks(1, 10_000)  # 60,000 bytes: 8 slices of at most 8 KiB
    wired.client.data_received(flood)
    assert not reading(wired)  # the rest waits, the client unread
    assert 0 < upstream_got(wired)[before:].count(b"x") <= flow.FLOOD_SLICE // 6 + 1
    assert unparsed(wired)
    turns = run_turns(wired)
    assert turns >= len(flood) // flow.FLOOD_SLICE
    assert reading(wired)
    assert meaning(HEAD + upstream_got(wired)[len(HEAD) :] + b"0\r\n\r\n")[1] == b"x" * 10_129


def test_a_flood_behind_an_ordinary_first_slice_is_sliced_too(tmp_path: Path) -> None:
    """Found by review of the first attempt: one ordinary 8 KiB slice let the rest of the read
    be fed whole, however dense."""
    wired = sliced(tmp_path)
    before = len(upstream_got(wired))
    wired.client.data_received(chunks(16 * 1024, 1, b"o") + chunks(1, 10_000))
    assert not reading(wired)
    assert upstream_got(wired)[before:].count(b"x") < 2 * flow.FLOOD_SLICE // 6
    assert run_turns(wired) >= 5
    assert upstream_got(wired)[before:].count(b"x") == 10_000


def test_an_upgrade_in_a_later_slice_takes_the_rest_of_the_read(tmp_path: Path) -> None:
    """Found by review of the first attempt: the bytes after a handshake past its slice were
    lost."""
    wired = sliced(tmp_path)
    pooled(wired, 1)
    wired.client.data_received(chunks(1, 2000) + b"0\r\n\r\n" + HANDSHAKE + TAIL)
    run_turns(wired)
    assert answer(wired)  # the upload's
    assert answer(wired)  # the handshake's: 101
    got = upstream_got(wired)
    assert got.endswith(b"\r\n\r\n" + TAIL)  # the handshake (as relay writes it), then the tail
    assert got.rindex(b"GET /ws ") > got.rindex(b"0\r\n\r\n")


def test_a_refusal_in_a_slice_lingers_reading(tmp_path: Path) -> None:
    """Found by review of the first attempt: a lingering close left the client unread."""
    wired = sliced(tmp_path)
    wired.client.data_received(b"zz\r\n" + chunks(1, 5000))  # a bad chunk size: 400
    run_turns(wired)
    assert wired.client_transport.data.startswith(b"HTTP/1.1 400 ")
    assert wired.client._lingering
    assert reading(wired)  # reads on and drops what the client still sends
    assert not unparsed(wired)


def test_reads_within_one_turn_and_a_fin_keep_their_order(tmp_path: Path) -> None:
    """The TLS hand-over feeds its early reads in a row, then the FIN (relay.handshake). Found
    by review of the first attempt: the second read went before the rest of the first."""
    wired = sliced(tmp_path)
    wired.client.data_received(chunks(1, 5000))
    assert unparsed(wired)
    wired.client.data_received(chunks(1, 3, b"y") + b"0\r\n\r\n")
    wired.client.eof_received()
    assert not unparsed(wired)
    wired.turns.end()
    body = meaning(upstream_got(wired))[1]
    assert body == b"x" * (flow.YIELD_EVENTS + 1 + 5000) + b"yyy"
    assert wired.client.receiving is None  # the request ended before the FIN


def test_a_lost_client_drops_the_rest(tmp_path: Path) -> None:
    wired = sliced(tmp_path)
    wired.client.data_received(chunks(1, 5000))
    wired.client.connection_lost(None)
    assert not unparsed(wired)
    wired.turns.end()  # the continuation finds nothing to feed


# -- slicing is invisible ---------------------------------------------------------------------
Recipe = tuple[tuple[tuple[str, tuple[tuple[int, int], ...]], ...], str, tuple[int, ...], bytes]

CHUNK_RUNS = [(1, 3000), (1, 500), (2, 1500), (3, 10), (50, 300), (3000, 5)]
ENDINGS = {"none": b"", "upgrade": HANDSHAKE + TAIL, "malformed": MALFORMED + chunks(1, 2000)}


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    """Requests (each a kind and its chunk runs or body size), how the stream ends, where it
    is cut into reads, and a bit per read: whether a turn of the loop follows it (bit 0 of
    the last byte: whether the client sends a FIN). Small to print: see stream()."""
    requests = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["chunked", "chunked", "length", "get"]))
        if kind == "chunked":
            runs = tuple(draw(st.lists(st.sampled_from(CHUNK_RUNS), max_size=5)))
        else:
            runs = ((draw(st.sampled_from([0, 10, 9000, 40_000])), 0),)
        requests.append((kind, runs))
    ending = draw(st.sampled_from(sorted(ENDINGS)))
    cuts = tuple(draw(st.lists(st.integers(0, 200_000), max_size=5)))
    return tuple(requests), ending, cuts, draw(st.binary(min_size=1, max_size=2))


def stream(recipe: Recipe) -> tuple[list[tuple[bytes, bool]], bool]:
    """The reads a recipe stands for, each with whether a turn follows it; whether a FIN
    follows them."""
    requests, ending, cuts, bits = recipe
    data = b""
    for kind, runs in requests:
        if kind == "chunked":
            body = b"".join(chunks(size, count, b"y") for size, count in runs)
            data += HEAD + body + b"0\r\n\r\n"
        elif kind == "length":
            size = runs[0][0]
            data += b"POST /cl HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n" % (
                HOST.encode(),
                size,
            )
            data += b"c" * size
        else:
            data += f"GET /g HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    data += ENDINGS[ending]
    bounds = [0, *sorted({cut % (len(data) + 1) for cut in cuts}), len(data)]
    turns = int.from_bytes(bits, "big")
    reads = [
        (data[a:b], bool(turns >> number & 2))
        for number, (a, b) in enumerate(itertools.pairwise(bounds))
        if b > a
    ]
    return reads, bool(turns & 1)


def serve(tmp_path: Path, reads: list[tuple[bytes, bool]], fin: bool) -> list[Any]:
    tmp_path.mkdir()
    wired = make_wired(tmp_path)
    pooled(wired, 4)
    for data, turn in reads:
        wired.client.data_received(data)
        if turn:
            wired.turns.end()
    if fin:
        wired.client.eof_received()
    wired.turns.end()
    for _ in range(5):  # answer each request in turn
        if not answer(wired):
            break
    others = [event for event in wired.upstream_transport.events if event[0] != "write"]
    client = [event for event in wired.client_transport.events if event[0] != "write"]
    return [
        meaning(upstream_got(wired)),
        others,
        wired.client_transport.data,
        client,
        wired.client.requests,
        reading(wired),
    ]


@settings(max_examples=300, deadline=None)
@given(recipe=recipes())
def test_slicing_is_invisible(tmp_path_factory: pytest.TempPathFactory, recipe: Recipe) -> None:
    reads, fin = stream(recipe)
    base = tmp_path_factory.mktemp("slices")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flow, "YIELD_EVENTS", 0)  # every connection sliced from its first read
        patch.setattr(server, "YIELD_EVENTS", 0)
        got = serve(base / "sliced", reads, fin)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server, "FLOOD_SLICE", 1 << 40)
        whole = serve(base / "whole", reads, fin)
    assert got == whole


def test_a_rest_waiting_keeps_the_connection_busy_in_a_drain(tmp_path: Path) -> None:
    """A drain closes idle connections: a rest not parsed yet may hold requests."""
    wired = sliced(tmp_path)
    wired.client.data_received(b"0\r\n\r\n")  # the upload ends: no exchange runs
    wired.upstream.data_received(RESPONSE)
    wired.turns.end()
    assert not drain.busy(wired.client)
    # Requests relay answers itself (no such sandbox): none is left running.
    unknown = f"GET /g HTTP/1.1\r\nHost: 3000-nosuch.{DOMAIN}\r\n\r\n".encode()
    wired.client.data_received(unknown * 400)
    assert wired.client.active is None
    assert unparsed(wired)
    assert drain.busy(wired.client)


# -- found by review ----------------------------------------------------------------------------
def test_a_body_past_the_discard_limit_in_its_last_read_lingers(tmp_path: Path) -> None:
    """The last pieces went on after the request was marked complete, so the close for a
    body past DISCARD_LIMIT was a plain one (a reset for a client still sending)."""
    wired = make_wired(tmp_path)
    head = f"POST /n HTTP/1.1\r\nHost: 3000-nosuch.{DOMAIN}\r\nTransfer-Encoding: chunked\r\n\r\n"
    wired.client.data_received(head.encode())  # answered at once: no such sandbox
    wired.turns.end()
    body = chunks(4096, DISCARD_LIMIT // 4096 + 2, b"z") + b"0\r\n\r\n"
    wired.client.data_received(body + f"GET /g HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    wired.turns.end()
    assert [kind for kind, _ in wired.client_transport.events] == ["write", "eof"]
    assert wired.client._lingering


def test_a_large_dense_read_on_an_unbound_outbox_does_not_nest(tmp_path: Path) -> None:
    """An unbound outbox (a stopping relay, tests) runs a continuation at once: each dense
    slice nested deeper, and 2.4 MB of 1-byte chunks reached the recursion limit."""
    wired = sliced(tmp_path)
    wired.relay.outbox.unbind()
    wired.client.data_received(chunks(1, 400_000))
    wired.client.data_received(b"0\r\n\r\n")
    assert wired.client.receiving is None
    assert meaning(upstream_got(wired))[1] == b"x" * (flow.YIELD_EVENTS + 1 + 400_000)
    assert reading(wired)


def test_a_bug_while_a_rest_is_fed_ends_the_connection_not_its_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception out of the continuation left the client paused for good (found by
    review). Now it is relay's internal error, as a callback's: logged, answered, closed."""
    wired = sliced(tmp_path)
    wired.client.data_received(chunks(1, 5000))  # a rest waits for the next turn

    def bug(self: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(type(wired.client), "_dense_read", bug)
    wired.turns.end()
    assert "internal error" in caplog.text
    assert wired.client_transport.data.startswith(b"HTTP/1.1 500 ")
    assert wired.client.closing
    assert reading(wired)  # a lingering close reads on
    assert not wired.turns.pending


def test_a_sliced_connections_ordinary_read_is_a_few_feeds(tmp_path: Path) -> None:
    """Slices double after each ordinary one (found by review: 256 KiB of 64 KiB chunks was
    36 upstream writes at 8 KiB a slice)."""
    wired = sliced(tmp_path)
    writes = len(wired.upstream_transport.events)
    wired.client.data_received(chunks(0x10000, 4, b"b"))
    assert reading(wired)
    assert len(wired.upstream_transport.events) - writes <= 16  # 10 slices, 4 chunks
    assert meaning(upstream_got(wired) + b"0\r\n\r\n")[1].count(b"b") == 0x40000


def test_a_dense_slice_ending_in_a_length_body_still_yields(tmp_path: Path) -> None:
    """Found by review: the Content-Length case went before the dense one, so slices that
    each ended inside a short body were all fed in one read callback, never pausing."""
    unknown = f"3000-nosuch.{DOMAIN}"  # relay answers and drops the bodies, keeping alive
    flood = (
        f"POST /a HTTP/1.1\r\nHost: {unknown}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + chunks(1, 1300)
        + b"0\r\n\r\n"
    )
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(flood)  # dense: sliced from now on
    wired.turns.end()
    assert reading(wired)
    head = f"POST /b HTTP/1.1\r\nHost: {unknown}\r\nContent-Length: %d\r\n\r\n"
    length = flow.FLOOD_SLICE + 10 - len(flood) - len(head.encode() % 1000)
    block = flood + head.encode() % length + b"c" * length  # the body ends past the slice
    wired.client.data_received(block * 20)
    assert not reading(wired)
    assert unparsed(wired)
    assert run_turns(wired) >= 20


def test_reads_while_lingering_are_dropped_not_kept(tmp_path: Path) -> None:
    """Found by review: with a rest waiting, reads during a lingering close were added to it
    (copied, to be dropped later) instead of restarting the linger wait."""
    wired = sliced(tmp_path)
    wired.client.data_received(chunks(1, 5000))
    assert unparsed(wired)
    wired.client.close()  # mid-request: lingers, reading on
    wired.client.data_received(b"z" * 100_000)
    assert len(wired.client._rest) < 40_000


def trailers(size: int) -> bytes:
    """A trailer section of about ``size`` bytes of ordinary fields (not dense: lines of
    ~70 bytes), after a 5-byte body."""
    lines = b"".join(b"x-trailer-%05d: %s\r\n" % (n, b"t" * 48) for n in range(size // 70))
    return b"5\r\nhello\r\n0\r\n" + lines + b"\r\n"


@pytest.mark.parametrize("fed", ["whole", "sliced"])
@pytest.mark.parametrize(("size", "refused"), [(24_000, True), (12_000, False)])
def test_trailers_past_the_head_limit_are_refused_fed_whole_or_sliced(
    tmp_path: Path, fed: str, size: int, refused: bool
) -> None:
    """Found by review: a trailer section past listen.max_header_bytes (16 KiB) that ended in
    the read with the last chunk was passed when the read was fed whole, and refused (431)
    when it was sliced, where a slice of trailers alone makes no progress."""
    wired = make_wired(tmp_path, busy=1 << 30) if fed == "whole" else sliced(tmp_path)
    read = (HEAD if fed == "whole" else b"") + trailers(size)
    assert not flow.flood_ahead(read, True)  # ordinary: fed whole unless sliced before
    wired.client.data_received(read)
    run_turns(wired)
    if refused:
        assert wired.client_transport.data.startswith(b"HTTP/1.1 431 ")
        assert b"Request trailers too large" in wired.client_transport.data
        assert wired.client.closing  # (a lingering close: the transport closes later)
    else:
        assert wired.client_transport.data == b""  # the upstream answers
        assert answer(wired)
        assert wired.client_transport.data.startswith(b"HTTP/1.1 200 ")
        assert not wired.client_transport.closing


def test_heads_after_a_waiting_refusal_are_not_trailers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: after a refusal that waits for an earlier answer, llhttp reads on
    through the read's later requests, which never begin (the parser is gone), so their
    fields added up in the trailer count and rewrote the waiting 431's message."""
    monkeypatch.setattr(flow._places, "random", lambda: 0.0)  # windows in X-Big: fed whole
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(f"GET /g HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    run_turns(wired)
    huge = f"GET /huge HTTP/1.1\r\nHost: {HOST}\r\nX-Big: {'a' * 17_000}\r\n\r\n".encode()
    fields = "".join(f"X-H{n}: {'v' * 60}\r\n" for n in range(40))
    later = f"GET /later HTTP/1.1\r\nHost: {HOST}\r\n{fields}\r\n".encode()
    assert not flow.flood_ahead(huge + later * 10, True, requests=True)
    wired.client.data_received(huge + later * 10)
    run_turns(wired)
    assert answer(wired)  # the first GET's, then the refusal
    run_turns(wired)
    assert b" 431 " in wired.client_transport.data
    assert b"Request trailers too large" not in wired.client_transport.data


def test_a_few_pipelined_requests_in_a_small_read_leave_the_connection_whole(
    tmp_path: Path,
) -> None:
    """Found by review: with requests weighed 8 pieces in any read, 17 pipelined GETs in
    1.2 KiB made the connection sliced for ever."""
    wired = make_wired(tmp_path, busy=1 << 30)
    pooled(wired, 40)
    get = f"GET /p HTTP/1.1\r\nHost: {HOST}\r\nAccept: */*\r\n\r\n".encode()
    wired.client.data_received(get * 17)
    assert not wired.client._sliced


@pytest.mark.parametrize("places", [(0.1, 0.6), (0.37, 0.81)])
def test_pipelined_requests_of_another_protocol_name_are_seen(
    tmp_path: Path, places: tuple[float, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: llhttp parses "GET /x RTSP/1.1" as an HTTP/1.1 GET, which relay
    forwards; 256 KiB of them were taken in one callback (58-112 ms)."""
    monkeypatch.setattr(flow._places, "random", itertools.cycle(places).__next__)
    wired = make_wired(tmp_path, busy=1 << 30)
    post = f"POST /o HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 2048\r\n\r\n".encode()
    tail = f" RTSP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    request = b"GET /" + b"p" * (68 - 5 - len(tail)) + tail
    wired.client.data_received(post + b"o" * 2048 + request * 3000)
    assert wired.client.requests < 750


def test_pipelined_heads_of_many_fields_yield(tmp_path: Path) -> None:
    """Found by review: heads of 2 KiB in 56 fields (~150 µs each) were never dense, 16 to a
    32 KiB slice, and a read of them was taken in one callback, read after read. A head
    weighs one more piece per 4 fields (flow.FIELDS_PER_EVENT)."""
    field = b"X-Field-%03d: abcdefghijklmnopqrstu\r\n"
    start = f"GET /p HTTP/1.1\r\nHost: 3000-nosuch.{DOMAIN}\r\n".encode()
    request = start + b"".join(field % n for n in range(56)) + b"\r\n"
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(request * 126)  # relay answers each itself (502)
    run_turns(wired)
    # Sliced, or fed whole when both windows missed a request line (a 2 KiB head is 2 KiB
    # of fields): then dense, and sliced from then on.
    assert wired.client._sliced
    before = wired.client.requests
    wired.client.data_received(request * 126)
    assert wired.client.unparsed
    assert wired.client.requests - before < 126 // 2


@pytest.mark.parametrize("cookie", [0, 12_000, 16_000])
def test_a_big_cookie_does_not_make_an_uploads_chunks_dense(tmp_path: Path, cookie: int) -> None:
    """Found by review: heads weighed by their bytes made a 12 KiB cookie (one field, one
    callback) count as 47 body pieces, so 74 ordinary chunks in the head's read made the
    connection sliced for ever (100 upstream writes for four later reads, not 4)."""
    head = f"POST /up HTTP/1.1\r\nHost: {HOST}\r\nCookie: {'c' * cookie}\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n"
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(head.encode() + chunks(64, 100))
    assert not wired.client._sliced


@pytest.mark.parametrize("reads", [1, 10])
def test_empty_lines_past_the_head_limit_are_a_head_too_large_not_trailers(
    tmp_path: Path, reads: int
) -> None:
    """Found by review: empty lines before a request line (RFC 9112 §2.2 lets a server ignore
    a few) past listen.max_header_bytes were refused 431 "Request trailers too large", though
    no request had begun: they count as the head they precede."""
    wired = make_wired(tmp_path, busy=1 << 30)
    lines = b"\r\n" * 15_000
    size = len(lines) // reads
    for i in range(reads):
        wired.client.data_received(lines[i * size : (i + 1) * size])
    run_turns(wired)
    assert wired.client_transport.data.startswith(b"HTTP/1.1 431 ")
    assert b"trailers" not in wired.client_transport.data
    assert wired.client.closing

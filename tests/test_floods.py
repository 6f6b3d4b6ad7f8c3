"""Responses of tiny chunks (relay.flow.FLOOD_SLICE): a read that llhttp parses inside a
response body is fed in a first slice, and when that held more than FLOOD_PIECES pieces the
rest waits for the next turn of the loop, the upstream unread meanwhile (a response of 1-byte
chunks cost ~50 ms of one read callback per 256 KiB, every other client waiting).

The property test serves random chunked responses, tiny chunks and large reads among them,
as relay does and with slicing off, and compares what the client gets.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import flow, response, response_events
from tests.support.wired import DOMAIN, Wired, make_wired


def tiny_chunks(count: int) -> bytes:
    return b"1\r\nx\r\n" * count


def undialling(tmp_path: Path) -> Wired:
    """A wired relay whose exchanges find no second upstream connection (no event loop)."""
    tmp_path.mkdir()
    wired = make_wired(tmp_path)

    def no_dial(coro: Any) -> Any:
        coro.close()
        raise RuntimeError("no event loop here")

    wired.relay.spawn = no_dial  # type: ignore[method-assign]
    return wired


# -- responses ------------------------------------------------------------------------------
GET = f"GET /s HTTP/1.1\r\nHost: 3000-sbx.{DOMAIN}\r\n\r\n".encode()
CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"


def upstream_reading(wired: Wired) -> bool:
    return wired.upstream_transport.reading


def client_got(wired: Wired) -> bytes:
    return b"".join(data for kind, data in wired.client_transport.events if kind == "write")


def decoded(stream: bytes) -> list[bytes]:
    """Response heads and their chunked bodies' payloads (see unchunked)."""
    out: list[bytes] = []
    pos = 0
    while pos < len(stream):
        if stream.startswith(b"HTTP/1.1 ", pos):
            end = stream.index(b"\r\n\r\n", pos) + 4
            out += [stream[pos:end], b""]
            pos = end
            continue
        line_end = stream.index(b"\r\n", pos)
        size = int(stream[pos:line_end], 16)
        pos = line_end + 2
        out[-1] += stream[pos : pos + size]
        pos += size + 2
    return out


def streaming(tmp_path: Path) -> Wired:
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(GET)
    wired.turns.end()
    wired.upstream.data_received(CHUNKED)
    wired.turns.end()
    return wired


def test_a_response_read_of_tiny_chunks_is_fed_over_several_turns(tmp_path: Path) -> None:
    wired = streaming(tmp_path)
    flood = tiny_chunks(10_000)
    wired.upstream.data_received(flood)
    assert not upstream_reading(wired)  # the rest waits, the upstream unread
    turns = 0
    while wired.turns.pending and turns < 100:
        wired.turns.pending.pop(0)()
        turns += 1
    assert upstream_reading(wired)
    assert turns >= len(flood) // flow.FLOOD_SLICE
    assert decoded(client_got(wired))[1] == b"x" * 10_000
    wired.upstream.data_received(b"0\r\n\r\n")
    wired.turns.end()
    assert wired.client.active is None  # the response ended: the connection is reusable


@st.composite
def responses(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """Two chunked responses on one upstream connection (tiny and larger chunks), cut into
    reads; and after which reads the client pauses and resumes writing."""
    stream = b""
    for _ in range(2):
        body = b""
        for _ in range(draw(st.integers(0, 4))):
            size, count = draw(
                st.sampled_from([(1, 3000), (2, 1500), (3, 10), (50, 300), (3000, 5)])
            )
            body += (b"%x\r\n" % size + b"z" * size + b"\r\n") * count
        stream += CHUNKED + body + b"0\r\n\r\n"
    cuts = draw(st.lists(st.integers(0, len(stream)), max_size=4))
    bounds = [0, *sorted(set(cuts)), len(stream)]
    reads = [stream[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    pauses = draw(st.lists(st.integers(0, len(reads)), max_size=2))
    return reads, pauses


def relay_responses(tmp_path: Path, reads: list[bytes], pauses: list[int]) -> list[Any]:
    wired = undialling(tmp_path)
    wired.client.data_received(GET + GET)
    wired.turns.end()
    for number, data in enumerate(reads):
        if number in pauses:
            wired.client.pause_writing()
        wired.upstream.data_received(data)
        wired.turns.end()
        wired.client.resume_writing()
        wired.turns.end()
    return [decoded(client_got(wired)), wired.client.requests, wired.client.active is None]


@settings(max_examples=100, deadline=None)
@given(case=responses())
def test_response_slicing_is_invisible(tmp_path_factory: pytest.TempPathFactory, case: Any) -> None:
    reads, pauses = case
    base = tmp_path_factory.mktemp("flood")
    sliced = relay_responses(base / "sliced", reads, pauses)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(response, "FLOOD_SLICE", 1 << 40)
        whole = relay_responses(base / "whole", reads, pauses)
    assert sliced == whole


def test_an_ordinary_large_read_stays_one_feed_and_one_write(tmp_path: Path) -> None:
    """Found by review: slicing every read over 8 KiB cost a copy and a second client
    write; only a read whose first slice is dense with chunk lines is sliced."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(GET)
    wired.turns.end()
    wired.upstream.data_received(CHUNKED)
    wired.turns.end()
    before = len(wired.client_transport.events)
    wired.upstream.data_received((b"4000\r\n" + b"x" * 0x4000 + b"\r\n") * 4)
    wired.turns.end()
    writes = [event for event in wired.client_transport.events[before:] if event[0] == "write"]
    assert len(writes) == 1


def test_a_flood_with_an_unbound_outbox_keeps_every_byte_in_order(tmp_path: Path) -> None:
    """Found by review: the rest was stored after scheduling its continuation, which an
    unbound outbox runs at once, so it was never fed."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(GET)
    wired.turns.end()
    wired.upstream.data_received(CHUNKED)
    wired.turns.end()
    wired.relay.outbox.unbind()
    wired.upstream.data_received(tiny_chunks(3000))
    wired.upstream.data_received(b"2\r\nyy\r\n")
    assert decoded(client_got(wired))[1] == b"x" * 3000 + b"yy"


@pytest.mark.parametrize("places", [(0.0, 0.9), (0.7, 0.1), (0.999, 0.0), (0.6, 0.6)])
def test_a_flood_behind_an_ordinary_first_kib_is_seen(
    tmp_path: Path, places: tuple[float, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read whose first 16 KiB is one ordinary chunk, then 1-byte chunks: fed whole before,
    once per connection. Two windows at random places (relay.flow.flood_ahead): either one
    in the flood sees it."""
    monkeypatch.setattr(flow._places, "random", itertools.cycle(places).__next__)
    wired = streaming(tmp_path)
    ordinary = b"4000\r\n" + b"o" * 0x4000 + b"\r\n"
    wired.upstream.data_received(ordinary + tiny_chunks(3500))
    assert not upstream_reading(wired)
    assert decoded(client_got(wired))[1].count(b"x") < 3500  # the rest waits a turn
    while wired.turns.pending:
        wired.turns.pending.pop(0)()
    assert decoded(client_got(wired))[1] == b"o" * 0x4000 + b"x" * 3500


def test_a_flood_unseen_behind_an_ordinary_start_yields_then_is_sliced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood both windows miss is fed whole: the upstream waits a turn (libuv would read it
    up to 32 times in a row), and its later large reads are sliced whatever they hold."""
    monkeypatch.setattr(flow._places, "random", lambda: 0.3)  # both windows in the 32 KiB
    wired = streaming(tmp_path)
    ordinary = b"8000\r\n" + b"o" * 0x8000 + b"\r\n"
    wired.upstream.data_received(ordinary + tiny_chunks(3000))
    assert not upstream_reading(wired)  # fed whole, then a turn for the others
    assert decoded(client_got(wired))[1] == b"o" * 0x8000 + b"x" * 3000
    wired.turns.end()
    assert upstream_reading(wired)
    wired.upstream.data_received(ordinary + tiny_chunks(10_000))
    assert not upstream_reading(wired)
    # Slices of 8, 16 and 32 KiB: the third the first with tiny chunks (24 KiB of them).
    assert decoded(client_got(wired))[1].count(b"x") < 3000 + flow.FLOOD_SLICE_MAX // 6
    turns = 0
    while wired.turns.pending and turns < 100:
        wired.turns.pending.pop(0)()
        turns += 1
    assert turns >= 10_000 * 6 // flow.FLOOD_SLICE_MAX
    assert decoded(client_got(wired))[1].count(b"x") == 13_000
    assert upstream_reading(wired)


def test_a_small_read_of_tiny_chunks_yields(tmp_path: Path) -> None:
    wired = streaming(tmp_path)
    wired.upstream.data_received(tiny_chunks(flow.FLOOD_PIECES + 1))  # under 8 KiB
    assert not upstream_reading(wired)
    wired.turns.end()
    assert upstream_reading(wired)
    wired.upstream.data_received(tiny_chunks(flow.FLOOD_PIECES))
    assert upstream_reading(wired)  # not dense: reads on


def test_a_sliced_connections_next_response_yields_after_its_head_read(tmp_path: Path) -> None:
    """The next response on the pooled connection: its first read, with the head, of under
    8 KiB is fed whole, then the upstream waits a turn and the body's later reads are
    sliced."""
    wired = streaming(tmp_path)
    wired.upstream.data_received(tiny_chunks(flow.FLOOD_PIECES + 1) + b"0\r\n\r\n")
    wired.turns.end()
    wired.client.data_received(GET)  # on the same pooled connection
    wired.turns.end()
    wired.upstream.data_received(CHUNKED + tiny_chunks(1000))
    assert not upstream_reading(wired)
    wired.turns.end()
    assert upstream_reading(wired)
    wired.upstream.data_received(tiny_chunks(40_000))
    assert not upstream_reading(wired)
    assert decoded(client_got(wired))[3].count(b"x") <= 1000 + flow.FLOOD_SLICE // 6 + 1
    turns = 0
    while wired.turns.pending and turns < 100:
        wired.turns.pending.pop(0)()
        turns += 1
    assert decoded(client_got(wired))[3].count(b"x") == 41_000


def test_a_rest_put_aside_survives_the_upstreams_loss(tmp_path: Path) -> None:
    """Found by review: the rest of a read was dropped when the upstream connection was lost
    before its turn (a failed write is reported by call_soon), cutting a response that read
    completed."""
    wired = streaming(tmp_path)
    wired.upstream.data_received(tiny_chunks(flow.FLOOD_PIECES + 1))  # the reader is sliced
    wired.turns.end()
    wired.upstream.data_received(tiny_chunks(5000) + b"0\r\n\r\n")
    assert not upstream_reading(wired)
    wired.upstream.connection_lost(ConnectionResetError())
    wired.turns.end()
    assert decoded(client_got(wired))[1] == b"x" * (flow.FLOOD_PIECES + 1 + 5000)
    assert client_got(wired).endswith(b"0\r\n\r\n")


def test_a_read_of_interim_responses_short_of_the_limit_yields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: 1xx heads were not counted, so a read of many of them (each built
    and written to the client) was never dense."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(GET)
    wired.turns.end()
    monkeypatch.setattr(response_events, "MAX_INTERIM", 1000)
    wired.upstream.data_received(b"HTTP/1.1 100 Continue\r\n\r\n" * 1000)
    assert not upstream_reading(wired)
    wired.turns.end()
    assert upstream_reading(wired)


def test_an_endless_run_of_interim_responses_is_a_502(tmp_path: Path) -> None:
    """Found by review: interim heads are parsed whole, read after read, without end (~13 ms
    per 256 KiB read, every turn). Past MAX_INTERIM the response is malformed."""
    wired = make_wired(tmp_path, busy=1 << 30)
    wired.client.data_received(GET)
    wired.turns.end()
    wired.upstream.data_received(b"HTTP/1.1 103 Early Hints\r\n\r\n" * 10_000)
    wired.turns.end()
    got = client_got(wired)
    assert got.count(b" 103 Early Hints") == response_events.MAX_INTERIM
    assert got[got.rindex(b"HTTP/1.1 ") :].startswith(b"HTTP/1.1 502 ")
    assert wired.upstream_transport.closing


@pytest.mark.parametrize(
    "row", [b"2026-12-01,13:50,42.0\r\n", b"1733061000\t42\t7\r\n", b"17\r\n", b"DEADBEEF\r\n"]
)
def test_a_chunked_download_of_short_rows_is_one_feed_per_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: bytes
) -> None:
    """Found by review: a body read whose first KiB is dense with the payload's line ends
    (RFC 4180 rows end in CRLF) was sliced, 10 feeds per read instead of 1; chunk-size lines
    are what a flood is dense with, and rows of short numbers or hex words are not chunks
    (found by the next review: their data does not end where the size says)."""
    chunk = row * (16384 // len(row))
    body = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 16
    feeds: list[int] = []
    feed = response.ResponseReader._feed

    def counted(reader: response.ResponseReader, data: bytes) -> None:
        feeds.append(len(data))
        feed(reader, data)

    monkeypatch.setattr(response.ResponseReader, "_feed", counted)
    wired = streaming(tmp_path)
    feeds.clear()
    for _ in range(4):
        wired.upstream.data_received(body)
        wired.turns.end()
    assert len(feeds) == 4
    assert decoded(client_got(wired))[1] == chunk * 16 * 4

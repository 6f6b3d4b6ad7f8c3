"""A stream event passed on as read, without llhttp (``Respond._whole_chunk``): the same
bytes, events and ends as when llhttp frames every read.

The property test cuts a chunked response (Connect envelopes whole, split across chunks or
several to a chunk; chunks of every size, in relay's framing or not) into random reads, ends
it cleanly or cuts it (a revocation) after a random read, and serves it twice on a wired relay
(tests/support/wired.py): once as relay does, once with the fast path turned off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.core.model import Reason
from relay.respond import Respond
from relay.response import ResponseReader
from tests.support.wired import DOMAIN, make_wired

REQUEST = (
    f"POST /process.Process/Start HTTP/1.1\r\nHost: 3000-sbx.{DOMAIN}\r\n"
    "Content-Type: application/connect+json\r\nContent-Length: 2\r\n\r\n{}"
).encode()
CONNECT_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
PLAIN_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"


def envelope(i: int, flags: int = 0, pad: int = 0) -> bytes:
    payload = json.dumps({"event": {"data": {"stdout": str(i) + "x" * pad}}}).encode()
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload


def chunk(data: bytes, line: bytes | None = None) -> bytes:
    return (line if line is not None else b"%x\r\n" % len(data)) + data + b"\r\n"


def serve(
    tmp_path: Path, reads: list[bytes], *, cut_after: int | None = None, fast: bool = True
) -> list[Any]:
    """The stream on a fresh wired relay; what the client saw, what closed, and the byte
    count of the exchange."""
    tmp_path.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        if not fast:
            patch.setattr(Respond, "_whole_chunk", lambda self, data: False)
        wired = make_wired(tmp_path)
        wired.client.data_received(REQUEST)
        wired.turns.end()
        exchange = wired.client.active
        assert exchange is not None
        for number, data in enumerate(reads):
            wired.upstream.data_received(data)
            wired.turns.end()
            if number == cut_after and wired.client.active is exchange:
                exchange.revoke(Reason.ROUTE_CHANGED)
                wired.turns.end()
                break
    return [
        wired.client_transport.events,
        wired.upstream_transport.events[1:],  # after the request
        exchange.bytes_out,
        exchange.state,
        wired.client.active is None,
    ]


def counting_feeds(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    fed: list[bytes] = []
    original = ResponseReader.feed

    def feed(self: ResponseReader, data: bytes) -> None:
        fed.append(data)
        original(self, data)

    monkeypatch.setattr(ResponseReader, "feed", feed)
    return fed


def test_events_after_the_first_skip_llhttp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The point of it: once llhttp waits at a chunk-size line, an event read in relay's own
    framing is written as read (the end-of-stream envelope too); the head, the first event
    and the last chunk go through llhttp."""
    fed = counting_feeds(monkeypatch)
    events = [chunk(envelope(i)) for i in range(5)] + [chunk(envelope(5, flags=2))]
    reads = [CONNECT_HEAD, *events, b"0\r\n\r\n"]
    got = serve(tmp_path, reads)
    assert fed == [CONNECT_HEAD, events[0], b"0\r\n\r\n"]
    writes = [data for kind, data in got[0] if kind == "write"]
    assert writes[2:7] == events[1:]
    assert got[2] == sum(len(envelope(i)) for i in range(5)) + len(envelope(5, flags=2))
    assert got[4]  # the exchange ended; the connection waits for the next request


def test_a_stream_cut_after_its_own_end_envelope_gets_no_second_one(tmp_path: Path) -> None:
    """The upstream's end-of-stream envelope went out as read; a cut before the last chunk
    then only adds the chunked terminator (``EnvelopeTracker.ended``)."""
    last = chunk(envelope(1, flags=2))
    reads = [CONNECT_HEAD, chunk(envelope(0)), last]
    got = serve(tmp_path, reads, cut_after=2)
    writes = [data for kind, data in got[0] if kind == "write"]
    assert writes[-2:] == [last, b"0\r\n\r\n"]
    assert got == serve(tmp_path / "parsed", reads, cut_after=2, fast=False)


def test_a_read_ending_inside_a_chunk_size_line_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a read that ends in the middle of a size line (``1`` of ``1a``), the next read
    ("a\\r\\n" and 26 bytes) looks like a whole 10-byte chunk to anyone who has not seen the
    ``1``; llhttp reads it as the 26-byte chunk it is."""
    fed = counting_feeds(monkeypatch)
    ten, rest = b"abcdefghij", b"klmnopqrstuvwx"  # with the CRLF between them: 26 bytes
    reads = [PLAIN_HEAD + chunk(b"hello") + b"1", b"a\r\n" + ten + b"\r\n", rest + b"\r\n"]
    reads += [b"0\r\n\r\n"]
    got = serve(tmp_path, reads)
    assert fed == reads
    data = b"".join(d for kind, d in got[0] if kind == "write")
    tail = b"5\r\nhello\r\nc\r\n" + ten + b"\r\n\r\ne\r\n" + rest + b"\r\n0\r\n\r\n"
    assert data.endswith(tail)
    assert got[2] == 5 + 26


def test_a_size_line_at_the_end_of_a_read_is_not_an_edge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that ends with a whole size line ("6\\r\\n") leaves llhttp inside a chunk: the
    next read, six bytes that look like a whole 1-byte chunk, is that chunk's data."""
    fed = counting_feeds(monkeypatch)
    reads = [PLAIN_HEAD + chunk(b"hello") + b"6\r\n", b"1\r\nx\r\n", b"\r\n0\r\n\r\n"]
    got = serve(tmp_path, reads)
    assert fed == reads
    data = b"".join(d for kind, d in got[0] if kind == "write")
    assert data.endswith(b"5\r\nhello\r\n6\r\n1\r\nx\r\n\r\n0\r\n\r\n")


def test_an_envelope_held_in_part_is_not_passed_around(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An envelope's first five bytes in one chunk, its payload in the next: the payload may
    itself look like a whole envelope, but it is the rest of the held one and goes out with
    it, so that a cut still finds the client at an envelope boundary."""
    inner = envelope(7)
    outer = b"\x00" + len(inner).to_bytes(4, "big") + inner
    reads = [CONNECT_HEAD, chunk(envelope(0)), chunk(outer[:5]), chunk(outer[5:])]
    got = serve(tmp_path, reads, cut_after=3)
    writes = [data for kind, data in got[0] if kind == "write"]
    assert chunk(outer) in writes
    assert got == serve(tmp_path / "parsed", reads, cut_after=3, fast=False)


def test_a_chunk_passed_on_whole_leaves_the_stall_count_as_llhttp_would(tmp_path: Path) -> None:
    """A read of only a chunk's CRLF, a chunk passed on whole, then a size line of 65,535 bytes
    (llhttp reports nothing until it ends): just under relay's 64 KiB limit on bytes without
    progress either way (found by review: the CRLF's 2 bytes stayed counted)."""
    long_line = b"1;a=" + b"b" * (65_535 - 4)
    reads = [PLAIN_HEAD + b"5\r\nhello", b"\r\n", chunk(b"abc"), long_line, b"\r\nx\r\n0\r\n\r\n"]
    got = serve(tmp_path, reads)
    assert got == serve(tmp_path / "parsed", reads, fast=False)
    data = b"".join(d for kind, d in got[0] if kind == "write")
    assert data.endswith(b"3\r\nabc\r\n1\r\nx\r\n0\r\n\r\n")


def test_a_chunk_in_other_framing_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upper-case hex, a leading zero or an extension: valid, but not the bytes relay would
    write, so llhttp frames them and relay writes its own size line."""
    fed = counting_feeds(monkeypatch)
    event = envelope(1, pad=20)
    odd = [
        chunk(event, b"%X\r\n" % len(event)),
        chunk(event, b"0%x\r\n" % len(event)),
        chunk(event, b"%x;a=b\r\n" % len(event)),
    ]
    got = serve(tmp_path, [CONNECT_HEAD, chunk(envelope(0)), *odd, b"0\r\n\r\n"])
    assert fed[2:5] == odd
    writes = [data for kind, data in got[0] if kind == "write"]
    assert writes[2:5] == [chunk(event)] * 3


STREAM_HEADS = st.sampled_from([CONNECT_HEAD, PLAIN_HEAD])


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], int | None]:
    """A chunked response cut into reads, and after which read it is revoked (None: never)."""
    head = draw(STREAM_HEADS)
    envelopes = b"".join(
        envelope(i, flags=draw(st.sampled_from([0, 0, 0, 1])), pad=draw(st.integers(0, 1100)))
        for i in range(draw(st.integers(0, 6)))
    )
    if draw(st.booleans()):
        envelopes += envelope(99, flags=2)
    pieces = []
    pos = 0
    while pos < len(envelopes):
        # Mostly one envelope to a chunk, as envd writes them; else any cut.
        whole = 5 + int.from_bytes(envelopes[pos + 1 : pos + 5], "big")
        size = draw(st.sampled_from([whole, whole, whole]) | st.integers(1, 1500))
        pieces.append(envelopes[pos : pos + size])
        pos += size
    stream = head
    for piece in pieces:
        line = draw(
            st.sampled_from(
                [
                    b"%x\r\n" % len(piece),
                    b"%x\r\n" % len(piece),
                    b"%X\r\n" % len(piece),
                    b"0%x\r\n" % len(piece),
                    b"%x;e=1\r\n" % len(piece),
                ]
            )
        )
        stream += chunk(piece, line)
    if draw(st.booleans()):
        stream += draw(st.sampled_from([b"0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n"]))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=12)))
    # Reads along chunk edges too (a stream event per read is the case the fast path takes).
    edges = [len(head)]
    for piece in pieces:
        edges.append(edges[-1] + len(b"%x\r\n" % len(piece)) + len(piece) + 2)
    cuts = sorted(set(cuts) | set(draw(st.sets(st.sampled_from(edges), max_size=8))))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    reads = [r for r in reads if r]
    cut_after = draw(st.none() | st.integers(0, max(0, len(reads) - 1)))
    return reads, cut_after


@settings(max_examples=400, deadline=None)
@given(streams())
def test_the_fast_path_is_invisible(tmp_path_factory: Any, stream: Any) -> None:
    reads, cut_after = stream
    base = tmp_path_factory.mktemp("stream")
    fast = serve(base / "fast", reads, cut_after=cut_after)
    parsed = serve(base / "parsed", reads, cut_after=cut_after, fast=False)
    assert fast == parsed

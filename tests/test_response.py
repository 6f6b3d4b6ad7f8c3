"""relay/response.py: upstream bytes in, response events out, with no socket or exchange."""

from __future__ import annotations

from typing import Any

import pytest

from relay.core.model import Headers
from relay.response import ResponseReader
from relay.response_events import RESPONSE_HEAD_LIMIT

Event = tuple[Any, ...]


class Conn:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Recorder:
    """The reader's owner: records the events; ends the response as the exchange would."""

    def __init__(self, length: int = -1) -> None:
        self.events: list[Event] = []
        self.response_complete = False
        self.upstream: Any = Conn()
        self.length = length  # what response_head returns: a body the reader may pass on

    def response_interim(self, status: int, reason: bytes, headers: Headers) -> None:
        self.events.append(("interim", status, reason, headers))

    def response_head(self, status: int, reason: bytes, headers: Headers, keep: bool) -> int:
        self.events.append(("head", status, reason, headers, keep))
        return self.length

    def response_body(self, body: bytes) -> None:
        self.events.append(("body", body))

    def response_passed(self, body: bytes) -> None:
        self.events.append(("passed", body))

    def response_end(self) -> None:
        self.events.append(("end",))
        self.response_complete = True

    def response_malformed(self, why: str) -> None:
        self.events.append(("malformed", why))
        self.response_complete = True  # the exchange answers or cuts

    def response_upgrade(self, tail: bytes) -> None:
        self.events.append(("upgrade", tail))

    def internal_error(self, exc: BaseException) -> None:
        self.events.append(("internal", type(exc)))

    def flush(self) -> None:
        self.events.append(("flush",))


def read(*chunks: bytes, length: int = -1) -> tuple[Recorder, ResponseReader]:
    owner = Recorder(length)
    reader = ResponseReader(owner)
    for chunk in chunks:
        reader.feed(chunk)
    return owner, reader


def test_interim_then_final_in_one_read() -> None:
    owner, _ = read(
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n"
    )
    assert owner.events == [
        ("interim", 103, b"Early Hints", ((b"Link", b"</a>"),)),
        (
            "head",
            200,
            b"OK",
            ((b"Content-Type", b"text/plain"), (b"Transfer-Encoding", b"chunked")),
            True,
        ),
        ("body", b"ok"),
        ("end",),
        ("flush",),
    ]


def test_trailers_are_not_head_fields() -> None:
    owner, reader = read(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n", b"0\r\nX-T: 1\r\n\r\n"
    )
    assert owner.events[0][3] == ((b"Transfer-Encoding", b"chunked"),)
    assert owner.events[-2:] == [("end",), ("flush",)]
    assert not reader.body_until_close()


def test_a_content_length_body_passes_on_without_llhttp() -> None:
    owner, _ = read(
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        b"defg",
        b"hij" + b"HTTP/1.1 200 OK\r\n\r\n",  # the end, then bytes out of turn
        length=10,
    )
    assert owner.events[1:] == [
        ("body", b"abc"),
        ("flush",),
        ("passed", b"defg"),
        ("body", b"hij"),
        ("end",),
    ]
    assert owner.upstream.closed  # never reused after bytes out of turn


def test_bytes_after_the_response_close_the_connection() -> None:
    owner, _ = read(b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\n\r\n")
    assert [e[0] for e in owner.events] == ["head", "end", "flush"]
    assert owner.upstream.closed


def test_llhttp_stops_at_a_message_after_the_response() -> None:
    """Found by review: llhttp parsed whatever followed a complete response in its read, to be
    dropped with the connection: ~13 ms per 256 KiB read of tiny messages."""
    begun: list[int] = []

    class Counting(ResponseReader):
        def on_message_begin(self) -> None:
            begun.append(1)
            super().on_message_begin()

    owner = Recorder()
    nothing = b"HTTP/1.1 204 No Content\r\n\r\n"
    Counting(owner).feed(nothing * 200)  # under FLOOD_SLICE: parsed whole
    assert [e[0] for e in owner.events] == ["head", "end", "flush"]
    assert owner.upstream.closed
    assert len(begun) == 2  # the response, and the first message after it


def test_close_delimited_body() -> None:
    owner, reader = read(b"HTTP/1.1 200 OK\r\n\r\nuntil close")
    assert owner.events[-2:] == [("body", b"until close"), ("flush",)]
    assert reader.body_until_close()


@pytest.mark.parametrize(
    ("chunks", "why"),
    [
        pytest.param(
            (b"HTTP/1.1 200 OK\r\nX: " + b"a" * RESPONSE_HEAD_LIMIT + b"\r\n\r\n",),
            "upstream: response head too large",
            id="head-too-large",
        ),
        pytest.param(
            (b"HTTP/1.1 200 OK\r\nX: ", *[b"a" * 16384] * 5),
            "upstream: response head or trailers too large",
            id="head-line-never-ends",
        ),
        pytest.param((b"HTTP/1.1 000 Zero\r\n\r\n",), "upstream: invalid status 0", id="status"),
    ],
)
def test_malformed(chunks: tuple[bytes, ...], why: str) -> None:
    owner, _ = read(*chunks)
    assert ("malformed", why) in owner.events


def test_parse_error_is_malformed() -> None:
    owner, _ = read(b"garbage\r\n\r\n")
    assert owner.events[0][0] == "malformed"
    assert owner.events[0][1].startswith("upstream: ")


def test_upgrade_hands_over_the_bytes_after_the_head() -> None:
    owner, _ = read(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
        b"\x81\x02hi"
    )
    assert owner.events[0][:2] == ("head", 101)
    assert owner.events[-1] == ("upgrade", b"\x81\x02hi")


def test_a_callback_that_raises_is_an_internal_error() -> None:
    owner = Recorder()

    def boom(body: bytes) -> None:
        raise RuntimeError("bug")

    owner.response_body = boom  # type: ignore[method-assign]
    ResponseReader(owner).feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert owner.events[-1] == ("internal", RuntimeError)


def test_an_interim_close_closes_after_the_final_response() -> None:
    """RFC 9112 §9.6: "Connection: close" on a 1xx ends the connection after the final
    response, which llhttp now reads (it refused it before)."""
    owner, _ = read(
        b"HTTP/1.1 100 Continue\r\nConnection: close\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    )
    assert owner.events[2:] == [
        ("head", 200, b"OK", ((b"Content-Length", b"2"),), False),  # not kept alive
        ("body", b"ok"),
        ("end",),
        ("flush",),
    ]


def test_bytes_after_a_closing_response_still_close_the_connection() -> None:
    owner, _ = read(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nokmore")
    assert owner.events[-3:] == [("body", b"ok"), ("end",), ("flush",)]
    assert owner.upstream.closed


@pytest.mark.parametrize(
    "chunks",
    [
        (b"RTSP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",),
        (b"ICE/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",),
        (b"RT", b"SP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"),
        (b"\r\n\r\nRTSP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",),
        (b"\r\n", b"RTSP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"),
        (b"\r\n" * 6000, b"RTSP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"),  # sliced (flow)
    ],
)
def test_a_status_line_of_another_protocol_is_malformed(chunks: tuple[bytes, ...]) -> None:
    """llhttp reads "RTSP/" and "ICE/" status lines too; relay wrote them on as HTTP/1.1
    (found by review). Go's client, E2B's proxy, refuses them: so does relay."""
    owner, _ = read(*chunks)
    events = [event for event in owner.events if event != ("flush",)]
    assert events == [("malformed", "upstream: not an HTTP response")]


@pytest.mark.parametrize(
    "chunks",
    [
        (b"HT", b"TP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
        (b"\r\n" * 6000, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
        (b"\r\n" * 6000 + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",),
    ],
)
def test_an_http_status_line_cut_or_after_line_ends_is_read(chunks: tuple[bytes, ...]) -> None:
    owner, _ = read(*chunks)
    assert [event[:2] for event in owner.events if event[0] != "flush"] == [
        ("head", 200),
        ("body", b"ok"),
        ("end",),
    ]


@pytest.mark.parametrize(("version", "closed"), [(b"1.0", True), (b"1.1", False)])
def test_an_http10_chunked_response_closes_its_connection(version: bytes, closed: bool) -> None:
    """RFC 9112 §6.1: HTTP/1.0 with Transfer-Encoding is faulty framing; the connection is
    closed after the message, whatever its Connection field says."""
    owner, _ = read(
        b"HTTP/%s 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n" % version
    )
    assert owner.events[-2:] == [("end",), ("flush",)]
    assert owner.upstream.closed is closed

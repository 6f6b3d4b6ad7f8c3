"""What relay makes of an upstream's response head (the guest's app may send anything).

relay writes every head it relays itself (``relay.core.responses``), so whatever line ends,
spellings or framing fields an upstream used, the client gets one well-formed HTTP/1.1 head:
each answer below is read raw and framed by a strict llhttp, which refuses a bare LF.
"""

from __future__ import annotations

import asyncio

import httptools
import pytest

from tests.hostile.conftest import Hostile
from tests.hostile.test_broken_upstreams import script_then_next, still_serves
from tests.support.rawhttp import request_bytes


class _Strict:
    """A strict llhttp's reading of what relay wrote: the heads, and whether a final
    response (not 1xx) ended."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.statuses: list[int] = []
        self.headers: list[list[tuple[bytes, bytes]]] = []
        self.body = b""
        self.done = False

    def on_message_begin(self) -> None:
        self.headers.append([])

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[-1].append((name, value))

    def on_headers_complete(self) -> None:
        self.statuses.append(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = self.statuses[-1] >= 200


async def raw_answer(hostile: Hostile, path: str) -> tuple[bytes, _Strict]:
    """GET ``path`` from the shared app upstream: the bytes relay wrote up to the end of the
    final response, and how a strict parser framed them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", hostile.port)
    strict = _Strict()
    raw = b""
    try:
        writer.write(request_bytes("GET", path, hostile.app))
        while not strict.done:
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, raw
            raw += data
            strict.parser.feed_data(data)  # raises on a bare LF or any other framing error
    finally:
        writer.close()
    return raw, strict


@pytest.mark.parametrize(
    ("script", "statuses", "fields"),
    [
        ("bare-lf", [200], []),
        ("bare-lf-status", [200], [(b"X-A", b"a")]),
        ("bare-lf-field", [200], [(b"X-A", b"a")]),
        ("bare-lf-end", [200], [(b"X-A", b"a")]),
        ("bare-lf-chunked", [200], [(b"X-A", b"a")]),
        ("bare-lf-interim", [103, 200], []),
    ],
)
async def test_a_head_with_bare_lf_line_ends_is_relayed_with_crlf(
    hostile: Hostile, script: str, statuses: list[int], fields: list[tuple[bytes, bytes]]
) -> None:
    """RFC 9112 §2.2: "a recipient MAY recognize a single LF as a line terminator and ignore
    any preceding CR". nginx and Go's HTTP client (E2B's proxy) read such a response head;
    relay answered 502 (found by review). Only an upstream's head, never a client's request
    (tests/hostile/test_smuggling.py: a bare LF there is refused). What the client gets is
    relay's own CRLF head: a strict parser reads it."""
    raw, strict = await raw_answer(hostile, f"/raw/{script}")
    assert strict.statuses == statuses, raw
    assert strict.body == b"ok"
    head = raw[: raw.rindex(b"\r\n\r\n")]
    assert head.count(b"\n") == head.count(b"\r\n"), raw
    for name, value in fields:
        assert (name, value) in strict.headers[-1]
    await still_serves(hostile)


@pytest.mark.parametrize(
    ("script", "status_lines", "body", "present", "absent"),
    [
        # RFC 9110 §15.2: a 1xx ends at its head; its Content-Length frames nothing and is
        # not passed on (nor anywhere but relay's own framing, SPEC §5a).
        ("interim-length", [b"HTTP/1.1 103 Early Hints", b"HTTP/1.1 200 OK"], b"ok", [], []),
        # RFC 9110 §8.6: no Content-Length in a 204; the bytes after it are not a body
        # (RFC 9112 §6.3), and the connection that sent them is not reused.
        ("no-content-length", [b"HTTP/1.1 204 No Content"], b"", [], [b"content-length"]),
        # RFC 9110 §7.6.1: the fields Connection names go, whatever they are (nginx passes
        # them; Go's ReverseProxy, E2B's proxy, removes them too).
        (
            "connection-listed",
            [b"HTTP/1.1 200 OK"],
            b"ok",
            [(b"X-Kept", b"k")],
            [b"x-secret", b"set-cookie", b"keep-alive", b"connection"],
        ),
        # No reason phrase (RFC 9112 §4 allows none): the status's own. An HTTP/1.0 status
        # line: relay speaks HTTP/1.1 to the client. A Content-Length spelled "0002\t"
        # (llhttp admits both): relay's own number.
        ("no-reason", [b"HTTP/1.1 200 OK"], b"ok", [], []),
        ("http10-status", [b"HTTP/1.1 200 OK"], b"ok", [], []),
        ("length-spelled", [b"HTTP/1.1 200 OK"], b"ok", [(b"Content-Length", b"2")], []),
    ],
)
async def test_heads_are_relayed_in_relays_own_spelling(
    hostile: Hostile,
    script: str,
    status_lines: list[bytes],
    body: bytes,
    present: list[tuple[bytes, bytes]],
    absent: list[bytes],
) -> None:
    """What was checked against RFC 9110/9112 and nginx and found right (review D2): each
    answer is one well-formed head per message, in relay's spelling."""
    raw, strict = await raw_answer(hostile, f"/raw/{script}")
    lines = [part.split(b"\r\n")[0] for part in raw.split(b"\r\n\r\n")[: len(status_lines)]]
    assert lines == status_lines, raw
    assert strict.body == body
    final = strict.headers[-1]
    for field in present:
        assert field in final, raw
    names = [name.lower() for name, _ in final]
    for name in absent:
        assert name not in names, raw
    for interim in strict.headers[:-1]:
        assert [name for name, _ in interim if name.lower() == b"content-length"] == [], raw
    await still_serves(hostile)


@pytest.mark.parametrize(
    ("script", "reused"),
    [("http10-chunked", False), ("http10-length", True), ("http11-chunked", True)],
)
async def test_an_http10_response_with_transfer_encoding_closes_its_connection(
    hostile: Hostile, script: str, reused: bool
) -> None:
    """RFC 9112 §6.1: a client that receives an HTTP/1.0 message with Transfer-Encoding "MUST
    treat the message as if the framing is faulty ... and close the connection after
    processing the message" (an HTTP/1.0 hop in between may not have known the coding). relay
    decoded it and reused the connection despite "Connection: keep-alive" (found by review).
    The client still gets the body, in relay's own framing (SPEC §5a)."""
    first, after, same = await script_then_next(hostile, script)
    assert (first.status, first.body) == (200, b"ok")
    assert (after.status, after.body) == (200, b"GET /next 0")
    assert same is reused

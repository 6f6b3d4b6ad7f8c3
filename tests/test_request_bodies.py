"""A Content-Length request body passed on as read, without llhttp (relay/bodies.py,
``_pass_body``): the same bytes, events and closes as when llhttp frames every read.

The property test splits a stream of pipelined requests at random points and serves it twice
on a wired relay (tests/support/wired.py): once as relay does, once with the passthrough
turned off, so that llhttp frames the whole body.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import heads
from relay.forward import Exchange
from relay.server import ClientConnection
from relay.upstream_conn import UpstreamConnection
from relay.upstreams import PoolKey
from tests.support.wired import Recorder, make_wired
from tests.test_heads import HOST, REQUEST, serve

# With a Date (relay adds one to an answer without, RFC 9110 §6.6.1), as wired masks it.
ANSWER = b"HTTP/1.1 200 OK\r\nDate: <now>\r\nContent-Length: 2\r\n\r\nok"


@pytest.fixture(autouse=True)
def empty_memos() -> Iterator[None]:
    heads.REQUESTS.clear()
    yield
    heads.REQUESTS.clear()


def post(length: int, *fields: str) -> bytes:
    lines = ["POST /up HTTP/1.1", f"Host: {HOST}", f"Content-Length: {length}", *fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def served_without_passthrough(tmp_path: Path, *reads: bytes, **options: Any) -> list[Any]:
    """``serve`` with every body framed by llhttp: the reference."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ClientConnection, "_content_left", lambda self: 0)
        heads.REQUESTS.clear()
        return serve(tmp_path, *reads, **options)


def test_a_body_read_reaches_the_exchange_uncopied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The point of the passthrough: the read itself goes on (llhttp's on_body would hand
    over a copy of it)."""
    seen: list[bytes] = []
    original = Exchange.request_body

    def request_body(self: Exchange, chunk: bytes) -> None:
        seen.append(chunk)
        original(self, chunk)

    monkeypatch.setattr(Exchange, "request_body", request_body)
    wired = make_wired(tmp_path)
    body = bytes(range(256)) * 1024
    wired.client.data_received(post(len(body) + 10) + b"0123456789")
    middle = body[:]
    wired.client.data_received(middle)
    wired.turns.end()
    assert seen[-1] is middle
    sent = b"".join(data for kind, data in wired.upstream_transport.events if kind == "write")
    assert sent == post(len(body) + 10) + b"0123456789" + body


def test_the_request_after_the_body_in_the_same_read_is_served(tmp_path: Path) -> None:
    """Its head is parsed by the fresh parser that follows a passed body, waits for the
    answer to the upload (RFC 9112 §9.3.2), then goes upstream on a second pooled
    connection (the first returns to the pool only once its read is parsed)."""
    wired = make_wired(tmp_path)
    second = UpstreamConnection(wired.relay.pool, PoolKey("sbx", 0, "127.0.0.1", 3000))
    second_transport = Recorder(("127.0.0.1", 3000))
    second.connection_made(second_transport)  # type: ignore[arg-type]
    wired.relay.pool.release(second)
    for data in (post(10) + b"0123", b"456789" + REQUEST):
        wired.client.data_received(data)
        wired.turns.end()
    assert wired.client.requests == 2
    assert len(wired.client.queue) == 1
    uploads = [t for t in (wired.upstream_transport, second_transport) if t.events]
    assert [t.data for t in uploads] == [post(10) + b"0123456789"]
    owner = next(c for c in (wired.upstream, second) if c.owner is not None)
    owner.data_received(ANSWER)
    wired.turns.end()
    assert wired.client_transport.data == ANSWER
    both = sorted(t.data for t in (wired.upstream_transport, second_transport))
    assert both == sorted([post(10) + b"0123456789", REQUEST])
    assert not wired.client.queue


def test_a_body_past_the_discard_limit_of_an_answered_request_closes(tmp_path: Path) -> None:
    """An unrouted upload is answered at once; its body is read and dropped up to the
    discard limit, then the connection closes (lingering), as when llhttp framed it."""
    head = post(100_000_000)
    chunk = b"x" * 300_000
    reads = (head, *[chunk] * 12)
    passed = serve(tmp_path / "passed", *reads, unrouted=True)
    assert b"The sandbox was not found" in passed[0][0][1]
    assert ("eof", b"") in passed[0]
    parsed = served_without_passthrough(tmp_path / "parsed", *reads, unrouted=True)
    assert parsed == passed


BODY_BYTES = st.binary(max_size=40) | st.sampled_from([REQUEST, REQUEST[:10], b"\r\n\r\n"])


@st.composite
def request_streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """Pipelined requests as one byte stream, and where it is cut into reads."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["length", "length", "close", "chunked", "get", "upgrade"]))
        body = draw(BODY_BYTES)
        if kind == "get":
            parts.append(REQUEST)
        elif kind == "chunked":
            head = post(0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
            parts.append(head + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n" * bool(body))
        elif kind == "close":
            parts.append(post(len(body), "Connection: close") + body)
        elif kind == "upgrade":
            fields = ("Connection: Upgrade", "Upgrade: websocket")
            parts.append(post(len(body), *fields) + body)
        else:
            parts.append(post(len(body) + draw(st.sampled_from([0, 0, 1, 5]))) + body)
    stream = b"".join(parts)
    cuts = draw(st.lists(st.integers(0, len(stream)), max_size=6))
    return stream, sorted(set(cuts))


@settings(max_examples=400)
@given(case=request_streams())
def test_passed_bodies_give_what_llhttp_gives(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[bytes, list[int]]
) -> None:
    stream, cuts = case
    bounds = [0, *cuts, len(stream)]
    reads = [stream[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    tmp_path = tmp_path_factory.mktemp("b")
    reference = served_without_passthrough(tmp_path / "parsed", *reads)
    heads.REQUESTS.clear()
    assert serve(tmp_path / "passed", *reads) == reference


def test_a_zero_padded_length_past_the_int_digit_limit(tmp_path: Path) -> None:
    """Found by review: llhttp admits leading zeros past Python's int() digit limit; the
    length of a queued upload whose read ended inside its body raised out of data_received.
    Now the queued request is decided as before (400 after the running answer)."""
    wired = make_wired(tmp_path)
    length = "0" * 4400 + "5"
    head = post(5).replace(b"Content-Length: 5", f"Content-Length: {length}".encode())
    wired.client.data_received(REQUEST + head + b"ab")
    wired.turns.end()
    assert wired.client.requests == 2
    wired.upstream.data_received(ANSWER)
    wired.turns.end()
    out = wired.client_transport.data
    assert out.startswith(ANSWER)
    assert b" 400 " in out[len(ANSWER) :]


class CountedFields(list[tuple[bytes, bytes]]):
    walks = 0

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        CountedFields.walks += 1
        return super().__iter__()


def test_a_chunked_body_searches_the_fields_once(tmp_path: Path) -> None:
    """Found by review: every read ending inside a chunked body searched all of the head's
    fields for a Content-Length (~3,000 empty fields fit the head limit: 50x the CPU per
    read). The search now runs once per request."""
    wired = make_wired(tmp_path)
    head = post(0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    wired.client.data_received(head)  # the fields are searched at the end of this read
    wired.client._headers = CountedFields(wired.client._headers)
    CountedFields.walks = 0
    wired.client.data_received(b"100\r\n")
    for _ in range(50):
        wired.client.data_received(b"x")
    wired.turns.end()
    assert not wired.client.closing
    assert wired.client.receiving is not None
    assert CountedFields.walks == 0

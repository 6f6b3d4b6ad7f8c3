"""relay/heads.py: a remembered head gives the events llhttp would give, and only where safe.

The property tests feed the same bytes twice, the memo emptied before the first time: the
first read is parsed by llhttp (and may be remembered), the second may be replayed from the
memo. Whatever the bytes, both must produce the same events, written bytes and closes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import heads
from relay.core.model import Headers
from relay.response import ResponseReader
from relay.server import ClientConnection
from tests.support.wired import DOMAIN, make_wired
from tests.support.wired import Recorder as Transport
from tests.test_response import Recorder

HOST = f"3000-sbx.{DOMAIN}"
RESPONSE = b"HTTP/1.1 200 OK\r\nServer: t\r\nContent-Length: 5\r\n\r\nhello"
REQUEST = f"GET /a HTTP/1.1\r\nHost: {HOST}\r\nAccept: */*\r\n\r\n".encode()


@pytest.fixture(autouse=True)
def empty_memos() -> Iterator[None]:
    heads.REQUESTS.clear()
    heads.RESPONSES.clear()
    yield
    heads.REQUESTS.clear()
    heads.RESPONSES.clear()


class Owner(Recorder):
    """An exchange's answer to response_head: a Content-Length body may pass unparsed."""

    def response_head(self, status: int, reason: bytes, headers: Headers, keep: bool) -> int:
        super().response_head(status, reason, headers, keep)
        lengths = [v for n, v in headers if n.lower() == b"content-length" and v.isdigit()]
        return int(lengths[0]) if lengths and status >= 200 else -1


def response_events(*reads: bytes) -> tuple[list[Any], bool]:
    owner = Owner()
    reader = ResponseReader(owner)
    for data in reads:
        reader.feed(data)
    return owner.events, owner.upstream.closed


class Counting:
    """Counts llhttp's header callbacks into ``cls`` (none when a head is replayed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: Any) -> None:
        self.calls = 0
        original = cls.on_header

        def on_header(this: Any, name: bytes, value: bytes) -> None:
            self.calls += 1
            original(this, name, value)

        monkeypatch.setattr(cls, "on_header", on_header)


# -- responses ------------------------------------------------------------------------------


def test_a_whole_response_is_remembered_and_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    first = response_events(RESPONSE)
    assert RESPONSE[: RESPONSE.index(b"hello")] in heads.RESPONSES
    counting = Counting(monkeypatch, ResponseReader)
    assert response_events(RESPONSE) == first
    assert counting.calls == 0  # replayed, not parsed
    assert first[0][-3:] == [("body", b"hello"), ("end",), ("flush",)]


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(RESPONSE[:-1], id="body-not-all-here"),
        pytest.param(RESPONSE + b"HTTP/1.1 200 OK\r\n\r\n", id="bytes-after-it"),
        pytest.param(RESPONSE + b"\r\n", id="crlf-after-it"),
        pytest.param(b"HTTP/1.1 100 Continue\r\n\r\n" + RESPONSE, id="interim-first"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            id="chunked",
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\nuntil close", id="close-delimited"),
        pytest.param(b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello", id="bare-lf"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n"
            + b"X: y\r\n" * heads.KNOWN_FIELDS
            + b"\r\n",
            id="fields",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nX: " + b"y" * heads.KNOWN_HEAD_BYTES + b"\r\n\r\n", id="long"
        ),
    ],
)
def test_what_is_not_remembered(data: bytes) -> None:
    first = response_events(data)
    assert not heads.RESPONSES
    assert response_events(data) == first


def test_a_remembered_response_inside_a_body_is_body() -> None:
    """Only the first read of a response may be replayed: the same bytes later in a body
    (here the whole body of another response) are body bytes."""
    response_events(RESPONSE)
    outer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(RESPONSE)
    events, _ = response_events(outer, RESPONSE)
    assert ("body", RESPONSE) in events  # the last piece of a passed-on body
    assert [e[0] for e in events].count("head") == 1


def test_a_remembered_response_inside_a_parsed_body_is_body() -> None:
    """The same when llhttp reads the body (an exchange that re-frames it)."""
    response_events(RESPONSE)
    owner = Recorder()  # response_head returns -1: every body byte goes through llhttp
    reader = ResponseReader(owner)
    reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(RESPONSE))
    reader.feed(RESPONSE)
    assert [e[0] for e in owner.events] == ["head", "flush", "body", "end", "flush"]


def test_a_response_after_the_exchange_answered_is_not_replayed() -> None:
    """An exchange that answered or ended already (say it timed out) takes no head: the
    bytes are out of turn, and the connection is closed, as when llhttp reads them."""
    response_events(RESPONSE)
    owner = Owner()
    owner.response_complete = True
    ResponseReader(owner).feed(RESPONSE)
    assert "head" not in [event[0] for event in owner.events]
    assert owner.upstream.closed


def test_a_raising_callback_is_an_internal_error_when_replayed() -> None:
    response_events(RESPONSE)
    owner = Owner()

    def boom(body: bytes) -> None:
        raise RuntimeError("bug")

    owner.response_body = boom  # type: ignore[method-assign]
    ResponseReader(owner).feed(RESPONSE)
    assert owner.events[-1] == ("internal", RuntimeError)


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heads, "KNOWN_HEADS", 3)
    for n in range(7):
        response_events(b"HTTP/1.1 200 OK\r\nX: %d\r\nContent-Length: 0\r\n\r\n" % n)
        assert len(heads.RESPONSES) <= 3
    heads.remember(heads.RESPONSES, b"HTTP/1.1 200 OK\n\r\n", heads.RESPONSES.popitem()[1], 1)
    assert b"HTTP/1.1 200 OK\n\r\n" not in heads.RESPONSES  # a bare LF: never remembered


STATUS = st.sampled_from([b"200 OK", b"204 No Content", b"304 NM", b"404 ", b"101 S", b"100 C"])
FIELD = st.sampled_from(
    [
        b"Content-Length: 0",
        b"Content-Length: 3",
        b"Content-Length: 5",
        b"Transfer-Encoding: chunked",
        b"Connection: close",
        b"Connection: keep-alive",
        b"Upgrade: websocket",
        b"X-A: b",
    ]
)
TAIL = st.sampled_from(
    [b"", b"abc", b"hello", b"hello!", b"5\r\nhello\r\n0\r\n\r\n", b"\r\n", b"HTTP/1.1 200 OK\r\n"]
)


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    version = draw(st.sampled_from([b"HTTP/1.1 ", b"HTTP/1.0 "]))
    fields = draw(st.lists(FIELD, max_size=4))
    eol = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n"]))
    head = version + draw(STATUS) + eol + b"".join(f + eol for f in fields) + eol
    return head + draw(TAIL) + draw(TAIL)


@settings(max_examples=400)
@given(data=responses(), cut=st.integers(min_value=0, max_value=200))
def test_a_replayed_response_gives_what_llhttp_gives(data: bytes, cut: int) -> None:
    heads.RESPONSES.clear()
    reads = [data] if cut >= len(data) or cut == 0 else [data[:cut], data[cut:]]
    assert response_events(*reads) == response_events(*reads)
    assert response_events(data) == response_events(data)


@contextmanager
def memo_off() -> Iterator[None]:
    """llhttp alone: no head qualifies to be remembered, so nothing is replayed."""
    saved = heads.KNOWN_FIELDS
    heads.KNOWN_FIELDS = -1
    heads.REQUESTS.clear()
    heads.RESPONSES.clear()
    try:
        yield
    finally:
        heads.KNOWN_FIELDS = saved


def responses_on_one_connection(reads: list[bytes]) -> list[Any]:
    """Each read is one exchange's response; the reader (and its parser) goes on to the next
    exchange when relay would reuse the connection, else a new connection starts."""
    out: list[Any] = []
    reader: ResponseReader | None = None
    for data in reads:
        owner = Owner()
        if reader is None:
            reader = ResponseReader(owner)
        else:
            reader.bind(owner)
        reader.feed(data)
        out.append((owner.events, owner.upstream.closed))
        kept = [event[4] for event in owner.events if event[0] == "head"] == [True]
        malformed = any(event[0] == "malformed" for event in owner.events)
        if not (kept and owner.response_complete) or owner.upstream.closed or malformed:
            reader = None  # relay reuses a connection only after a whole keep-alive response
        else:
            reader.unbind()
    return out


@settings(max_examples=300)
@given(
    reads=st.lists(
        st.sampled_from([RESPONSE, RESPONSE[:-2], RESPONSE.replace(b"t\r", b"u\r")]) | responses(),
        max_size=6,
    )
)
def test_responses_on_one_connection_give_what_llhttp_gives(reads: list[bytes]) -> None:
    """The per-connection shortcut (ResponseReader._last) included: the memo is primed by the
    first pass, the second pass replays what it can."""
    with memo_off():
        reference = responses_on_one_connection(reads)
    heads.RESPONSES.clear()
    assert responses_on_one_connection(reads) == reference
    assert responses_on_one_connection(reads) == reference


# -- requests -------------------------------------------------------------------------------


def serve(
    tmp_path: Path,
    *reads: bytes,
    max_header_bytes: int = 0,
    overloaded: bool = False,
    unrouted: bool = False,
) -> list[Any]:
    """Each read on a fresh wired relay; what the client and the upstream saw, in order, and
    how many requests the connection counted."""
    tmp_path.mkdir(exist_ok=True)
    wired = make_wired(tmp_path)

    def no_dial(coro: Any) -> Any:
        coro.close()  # a second upstream connection would need an event loop
        raise RuntimeError("no event loop here")

    wired.relay.spawn = no_dial  # type: ignore[method-assign]
    if max_header_bytes:
        limits = wired.relay.config.listen
        object.__setattr__(limits, "max_header_bytes", max_header_bytes)
    wired.client.overloaded = overloaded
    if unrouted:
        wired.relay.install_routes({}, "t")
    for data in reads:
        wired.client.data_received(data)
        wired.turns.end()
    if wired.upstream_transport.events:
        wired.upstream.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        wired.turns.end()
    return [
        wired.client_transport.events,
        wired.upstream_transport.events,
        wired.client.requests,
        len(wired.client.queue),
    ]


def test_a_request_head_is_remembered_and_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = serve(tmp_path, REQUEST)
    assert REQUEST in heads.REQUESTS
    counting = Counting(monkeypatch, ClientConnection)
    assert serve(tmp_path, REQUEST) == first
    assert counting.calls == 0
    assert first[1] == [("write", REQUEST)]  # relay adds nothing to this head


def test_a_remembered_head_inside_a_request_body_is_body(tmp_path: Path) -> None:
    """Request smuggling through the memo: a body that is byte for byte a remembered head
    goes upstream as body, and is never a second request."""
    serve(tmp_path, REQUEST)
    post = f"POST /up HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(REQUEST)}\r\n\r\n"
    client, upstream, *_ = serve(tmp_path, post.encode(), REQUEST)
    sent = b"".join(data for kind, data in upstream if kind == "write")
    assert sent.endswith(b"\r\n\r\n" + REQUEST)
    assert sent.count(b"GET /a") == 1
    assert b"".join(data for _, data in client).count(b"HTTP/1.1 ") == 1


def test_a_head_whose_body_follows_is_not_remembered(tmp_path: Path) -> None:
    post = f"POST /up HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 2\r\n\r\n".encode()
    first = serve(tmp_path, post, b"ok")
    assert not heads.REQUESTS
    assert serve(tmp_path, post, b"ok") == first
    assert first[1] == [("write", post), ("write", b"ok")]


INNER = f"GET /admin HTTP/1.1\r\nHost: {HOST}\r\nX-Smuggled: 1\r\n\r\n".encode()


@pytest.mark.parametrize("how", ["431", "overloaded", "unrouted"])
def test_a_refused_head_with_a_body_is_not_remembered(tmp_path: Path, how: str) -> None:
    """Found by review: a head refused before its body was read (a 431 under a lower limit, a
    503 past max_connections, a 404 with a body past the discard limit) closed the connection,
    which ended the message for relay but not for llhttp; the head was remembered as one
    without a body, and a replay elsewhere read the body as a request of its own (INNER here:
    request smuggling)."""
    length = 100_000_000 if how == "unrouted" else len(INNER)
    post = f"POST /up HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {length}\r\n\r\n".encode()
    reference = serve(tmp_path / "reference", post, INNER)
    heads.REQUESTS.clear()
    serve(
        tmp_path / "refused",
        post,
        max_header_bytes=40 if how == "431" else 0,
        overloaded=how == "overloaded",
        unrouted=how == "unrouted",
    )
    assert not heads.REQUESTS
    assert serve(tmp_path / "again", post, INNER) == reference
    assert reference[2] == 1  # one request: INNER went upstream as its body


def test_no_replay_after_a_request_that_closes(tmp_path: Path) -> None:
    """Found by review: after a request with Connection: close llhttp refuses what follows
    (a 400 once it is answered); a replay made a second exchange instead."""
    closing = f"GET /c HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
    reference = serve(tmp_path / "reference", closing, REQUEST)
    serve(tmp_path / "other", REQUEST)
    assert REQUEST in heads.REQUESTS
    assert serve(tmp_path / "again", closing, REQUEST) == reference
    assert reference[2:] == [1, 0]


def test_each_connection_keeps_its_own_peer(tmp_path: Path) -> None:
    """A connection reuses the head it built for a remembered request (relay/request_heads.py,
    ``_last``); the head carries the connection's peer, which X-Forwarded-For is made of when
    the peer is a trusted proxy. Two peers sending the same bytes each get their own."""
    wired = make_wired(tmp_path, listen={"trusted_proxies": ["127.0.0.0/8"]})
    other = ClientConnection(wired.relay, tls=False)
    other_transport = Transport(("127.0.0.2", 40001))
    other.connection_made(other_transport)  # type: ignore[arg-type]
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    sent = []
    for client in (wired.client, other, wired.client, other, other):
        client.data_received(REQUEST)
        wired.turns.end()
        sent.append(wired.upstream_transport.events.pop()[1])
        wired.upstream.data_received(answer)
        wired.turns.end()
    assert REQUEST in heads.REQUESTS
    peers = [line for data in sent for line in data.split(b"\r\n") if b"For:" in line]
    assert peers == [
        b"X-Forwarded-For: 127.0.0.1",
        b"X-Forwarded-For: 127.0.0.2",
        b"X-Forwarded-For: 127.0.0.1",
        b"X-Forwarded-For: 127.0.0.2",
        b"X-Forwarded-For: 127.0.0.2",
    ]


def test_a_replayed_head_meets_the_current_size_limit(tmp_path: Path) -> None:
    serve(tmp_path, REQUEST)
    client, upstream, *_ = serve(tmp_path, REQUEST, max_header_bytes=len(REQUEST) - 20)
    assert client[0][1].startswith(b"HTTP/1.1 431 ")
    assert not upstream


REQUEST_FIELD = st.sampled_from(
    [
        f"Host: {HOST}",
        "Host: 3000-other.sandbox.test",
        "Content-Length: 0",
        "Content-Length: 2",
        "Transfer-Encoding: chunked",
        "Connection: close",
        "Connection: Upgrade",
        "Upgrade: websocket",
        "Expect: 100-continue",
        "X-A: b",
    ]
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    line = draw(
        st.sampled_from(["GET /a HTTP/1.1", "HEAD /b?x=1 HTTP/1.1", "POST /c HTTP/1.0", "GET x"])
    )
    fields = draw(st.lists(REQUEST_FIELD, max_size=4))
    eol = draw(st.sampled_from(["\r\n", "\r\n", "\n"]))
    head = (line + eol + "".join(f + eol for f in fields) + eol).encode()
    return head + draw(st.sampled_from([b"", b"ok", b"2\r\nok\r\n0\r\n\r\n", REQUEST]))


PRIMES: dict[str, dict[str, Any]] = {
    "same": {},
    "431": {"max_header_bytes": 40},
    "overloaded": {"overloaded": True},
    "unrouted": {"unrouted": True},
}


@settings(max_examples=500)
@given(
    data=requests(),
    later=st.sampled_from([b"", b"ok", b"2\r\nok\r\n0\r\n\r\n", REQUEST]),
    limit=st.sampled_from([0, 60]),
    prime=st.sampled_from(sorted(PRIMES)),
)
def test_a_replayed_request_gives_what_llhttp_gives(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, later: bytes, limit: int, prime: str
) -> None:
    """``later``: what the client sends in its next read (a body, or the next request).
    ``prime``: how the memo met ``data`` and REQUEST first (on other connections, maybe
    refused there), before the same reads run again with whatever it remembered."""
    tmp_path = tmp_path_factory.mktemp("r")
    heads.REQUESTS.clear()
    reference = serve(tmp_path / "reference", data, later, max_header_bytes=limit)
    heads.REQUESTS.clear()
    serve(tmp_path / "prime", data, **PRIMES[prime])
    serve(tmp_path / "prime-request", REQUEST, **PRIMES[prime])
    assert serve(tmp_path / "again", data, later, max_header_bytes=limit) == reference


@settings(max_examples=300)
@given(
    reads=st.lists(
        st.sampled_from(
            [REQUEST, REQUEST[:-2], b"\r\n", REQUEST * 2, REQUEST.replace(b"/a", b"/b")]
        )
        | requests(),
        max_size=5,
    )
)
def test_requests_on_one_connection_give_what_llhttp_gives(
    tmp_path_factory: pytest.TempPathFactory, reads: list[bytes]
) -> None:
    """One client connection sending ``reads`` (the per-connection shortcut, ``_last`` in
    relay/request_heads.py, included), against llhttp alone."""
    tmp_path = tmp_path_factory.mktemp("r")
    with memo_off():
        reference = serve(tmp_path / "reference", *reads)
    heads.REQUESTS.clear()
    assert serve(tmp_path / "first", *reads) == reference
    assert serve(tmp_path / "again", *reads) == reference

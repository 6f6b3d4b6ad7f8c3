"""Peers that stop, vanish or answer early, on relay's protocols wired to recording transports.

Each case is one found by review, where a connection (and its socket, buffers and exchange)
could stay open for ever or relay hit a bug: an upstream that answers a POST without reading
its body, one that resets after answering a HEAD that had a body, a 101 or a transfer coding
relay cannot relay, a client that half-closes in the middle of its body, thousands of
pipelined requests relay answers itself. The real-socket side of lingering closes is in
``tests/test_lingering.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from relay import upstreams
from relay.dial import DialError
from relay.flow import PAUSE_UPSTREAM_FULL
from relay.upstream_conn import UpstreamConnection
from relay.upstreams import PoolKey
from tests.support.harness import DOMAIN as RELAY_DOMAIN
from tests.support.harness import route, running_relay
from tests.support.rawhttp import request
from tests.support.wired import DOMAIN, RESPONSE, Recorder, Wired, make_wired

HOST = f"3000-sbx.{DOMAIN}"
HANDSHAKE = (
    f"GET /ws HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
).encode()


@pytest.fixture
def wired(tmp_path: Path) -> Wired:
    return make_wired(tmp_path)


def post(body: bytes, method: str = "POST") -> bytes:
    head = f"{method} /up HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def test_an_upstream_that_answered_without_reading_leaves_the_client_readable(
    wired: Wired,
) -> None:
    """The whole body is read from the client but sits in the upstream's full write buffer
    when the response ends: the client must be read again (its next request would otherwise
    wait for the 630 s idle timeout) and the upstream connection is not pooled with another
    request's bytes stuck in front of it."""
    wired.client.data_received(post(b"x" * 100))
    wired.turns.end()
    wired.upstream_transport.buffered = 100  # the upstream stopped reading...
    wired.upstream.pause_writing()  # ...and the transport crossed its high-water mark
    assert [wired.client_transport.reading] == [False]  # a list: mypy keeps no narrowing
    wired.upstream.data_received(RESPONSE)
    wired.turns.end()
    assert wired.client_transport.data.endswith(b"\r\n\r\nok")
    assert wired.client_transport.reading
    assert not wired.client._paused & PAUSE_UPSTREAM_FULL
    assert wired.relay.pool.idle_count() == 0
    assert wired.upstream_transport.events[-1] == ("eof", b"")  # closed after its buffer


@pytest.mark.parametrize(
    ("buffered", "end", "events"),
    [
        (0, "", ["close"]),
        (1, "", ["eof", "abort"]),
        (1, "lost", ["eof"]),
        (1, "delivered", ["eof", "close"]),
    ],
    ids=["drained", "never-drained", "closed-by-the-upstream", "delivered"],
)
def test_an_upstream_close_that_cannot_drain_is_aborted_after_a_grace_period(
    wired: Wired, monkeypatch: pytest.MonkeyPatch, buffered: int, end: str, events: list[str]
) -> None:
    """transport.close() waits for the write buffer to drain, for ever if the upstream never
    reads: the pool's sweep aborts a connection still draining after CLOSE_GRACE_S. Until
    then its bytes still go out (a WebSocket's Close frame, below), before a half-close, and
    the connection is closed once they are all out (or by the upstream)."""
    conn = UpstreamConnection(wired.relay.pool, PoolKey("sbx", 0, "127.0.0.1", 3000))
    transport = Recorder(("127.0.0.1", 3000))
    conn.connection_made(transport)  # type: ignore[arg-type]
    transport.buffered = buffered
    conn.close()
    wired.relay.pool.sweep()
    assert [kind for kind, _ in transport.events] == events[:1]  # within the grace period
    if end == "lost":
        conn.connection_lost(None)  # the upstream closed and the close completed
    elif end == "delivered":
        transport.buffered = 0  # all of it went out
    monkeypatch.setattr(upstreams, "CLOSE_GRACE_S", 0.0)
    wired.relay.pool.sweep()
    assert [kind for kind, _ in transport.events] == events


def test_a_websockets_last_frames_to_a_slow_upstream_are_not_discarded(wired: Wired) -> None:
    """The client sends a Close frame and goes while the upstream has not read it yet: the
    upstream connection is closed after its buffer, not aborted (SPEC §4: close codes flow
    both ways)."""
    wired.client.data_received(HANDSHAKE)
    wired.turns.end()
    wired.upstream.data_received(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    wired.turns.end()
    close_frame = b"\x88\x82\0\0\0\0\x03\xe8"  # masked Close 1000
    wired.client.data_received(close_frame)
    wired.turns.end()
    wired.upstream_transport.buffered = len(close_frame)  # not taken by the upstream yet
    assert wired.client.eof_received() is False  # uvloop then closes the client transport
    wired.client.connection_lost(None)
    wired.turns.end()
    assert wired.upstream_transport.data.endswith(close_frame)
    assert wired.upstream_transport.events[-1] == ("eof", b"")  # after the frame, not a reset


def test_head_with_a_body_and_an_upstream_reset_ends_cleanly(
    wired: Wired, caplog: pytest.LogCaptureFixture
) -> None:
    """The response to HEAD is complete at its head while the body still arrives; the upstream
    then resets. The rest of the body has nowhere to go: it is dropped, the exchange ends, no
    internal error. The answer was whole and said the connection is kept, so it is kept (the
    upstream's reset after it is no concern of the client's)."""
    head = f"HEAD /h HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 10\r\n\r\n".encode()
    wired.client.data_received(head + b"12345")
    wired.turns.end()
    wired.upstream.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    wired.turns.end()
    with caplog.at_level(logging.ERROR):
        wired.upstream.connection_lost(ConnectionResetError())
        wired.client.data_received(b"67890")
        wired.turns.end()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert wired.client_transport.data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert not wired.relay.live  # the exchange is over
    assert b"Connection: close" not in wired.client_transport.data
    assert not wired.client.closing


def test_a_half_close_in_the_middle_of_a_body_ends_the_exchange(wired: Wired) -> None:
    """RFC 9112 §8: a body cut short by the client's FIN can never complete. relay answers
    400 (no response had started) and closes both connections, instead of leaving the
    upstream waiting for the rest."""
    wired.client.data_received(post(b"x" * 100)[:-95])
    wired.turns.end()
    assert wired.client.eof_received() is False
    wired.turns.end()
    assert wired.client_transport.data.startswith(b"HTTP/1.1 400 ")
    assert b"Incomplete request body" in wired.client_transport.data
    assert wired.client_transport.closing
    wired.client.connection_lost(None)  # what uvloop reports once the close is done
    assert wired.upstream_transport.closing
    assert not wired.relay.live


def test_thousands_of_pipelined_answers_do_not_nest(wired: Wired) -> None:
    """Requests relay answers itself finish inside their own start: queued behind a forwarded
    one, each would start the next from within the last (3,000 deep: RecursionError). All are
    answered, in order, and the connection stays open for more."""
    refused = b"GET /r HTTP/1.1\r\nHost: nowhere.example\r\n\r\n"
    wired.client.data_received(
        f"GET /first HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode() + refused * 3000
    )
    wired.turns.end()
    wired.upstream.data_received(RESPONSE)
    wired.turns.end()
    data = wired.client_transport.data
    assert data.count(b"HTTP/1.1 ") == 3001
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert not wired.client.closing
    assert wired.client_transport.reading
    assert not wired.client.queue


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        (b"", b"502"),
        (b"Upgrade: websocket\r\n", b"502"),
        (b"Connection: upgrade\r\n", b"502"),
        (b"Connection: upgrade\r\nUpgrade: h2c\r\n", b"502"),
        (b"Connection: keep-alive, Upgrade\r\nUpgrade: WebSocket\r\n", b"101"),
    ],
    ids=["bare", "no-connection", "no-upgrade", "other-protocol", "valid"],
)
def test_a_101_must_name_the_websocket_upgrade(wired: Wired, fields: bytes, status: bytes) -> None:
    """RFC 6455 §4.1: a handshake answer without ``Upgrade: websocket`` and ``Connection:
    upgrade`` fails. relay writes those fields in its own spelling, so it must not turn a bare
    101 into one that looks valid: it answers 502."""
    wired.client.data_received(HANDSHAKE)
    wired.turns.end()
    wired.upstream.data_received(b"HTTP/1.1 101 Switching Protocols\r\n" + fields + b"\r\n")
    wired.turns.end()
    assert wired.client_transport.data.startswith(b"HTTP/1.1 " + status + b" ")


def test_a_response_in_a_transfer_coding_relay_cannot_decode_is_a_502(wired: Wired) -> None:
    wired.client.data_received(f"GET /gz HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    wired.turns.end()
    wired.upstream.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b")
    wired.turns.end()
    assert wired.client_transport.data.startswith(b"HTTP/1.1 502 ")
    assert b"\x1f\x8b" not in wired.client_transport.data
    assert wired.upstream_transport.closing


def test_an_oversized_pipelined_head_is_refused_after_the_running_response(wired: Wired) -> None:
    """RFC 9112 §9.3.2: answers go out in request order. A pipelined head past
    listen.max_header_bytes arriving while the first response streams is answered 431 after
    that response, not written into the middle of its body."""
    wired.client.data_received(f"GET /first HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    wired.turns.end()
    wired.upstream.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
    wired.turns.end()
    big = f"GET /second HTTP/1.1\r\nHost: {HOST}\r\nX-Big: ".encode() + b"b" * 20_000
    wired.client.data_received(big + b"\r\n\r\n")
    wired.turns.end()
    wired.upstream.data_received(b"56789")
    wired.turns.end()
    first, sep, rest = wired.client_transport.data.partition(b"0123456789")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert sep
    assert rest.startswith(b"HTTP/1.1 431 ")


def test_pipelined_requests_sent_before_a_half_close_are_all_answered(wired: Wired) -> None:
    """A client may send its last requests and half-close: each is answered, in order, then
    relay closes (before, the queued ones were dropped)."""
    second = UpstreamConnection(wired.relay.pool, PoolKey("sbx", 0, "127.0.0.1", 3000))
    second_transport = Recorder(("127.0.0.1", 3000))
    second.connection_made(second_transport)  # type: ignore[arg-type]
    wired.relay.pool.release(second)  # pooled last: taken first
    one = f"GET /1 HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    two = f"GET /2 HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    wired.client.data_received(one + two)
    assert wired.client.eof_received() is True  # kept open for the answers
    wired.turns.end()
    assert second_transport.data.startswith(b"GET /1 ")
    second.data_received(RESPONSE)
    wired.turns.end()
    assert wired.upstream_transport.data.startswith(b"GET /2 ")
    wired.upstream.data_received(RESPONSE)
    wired.turns.end()
    assert wired.client_transport.data.count(b"HTTP/1.1 200 OK") == 2
    assert wired.client_transport.events[-1] == ("close", b"")


def test_a_full_upstream_still_holds_the_client_back_once_the_splice_starts(wired: Wired) -> None:
    """The upstream's buffer is over its high-water mark when its 101 arrives (the client's
    bytes after the handshake filled it): the splice must keep the client unread, or relay
    buffers whatever the client sends for an upstream that does not read."""
    wired.client.data_received(HANDSHAKE)
    wired.turns.end()
    wired.upstream_transport.buffered = 1 << 20
    wired.upstream.pause_writing()
    wired.upstream.data_received(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    wired.turns.end()
    assert wired.client.splice is not None
    assert [wired.client_transport.reading] == [False]
    wired.upstream_transport.buffered = 0
    wired.upstream.resume_writing()
    assert wired.client_transport.reading


def test_a_connect_stream_that_ends_mid_envelope_still_gets_its_bytes(wired: Wired) -> None:
    """relay holds a partial Connect envelope so that a cut can end cleanly; when the
    upstream ends its stream instead, the held bytes go out before the last chunk (SPEC §4:
    each upstream chunk reaches the client)."""
    wired.client.data_received(f"POST /rpc HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    wired.turns.end()
    wired.upstream.data_received(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )
    wired.turns.end()
    assert wired.client_transport.data.endswith(b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")


UNROUTED = b"GET /x HTTP/1.1\r\nHost: localhost\r\n\r\n"  # relay answers it itself (404)
ROUTED = f"GET /x HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()


def reading(wired: Wired) -> bool:
    """Whether relay reads the client (a call: mypy would narrow an attribute's value)."""
    return wired.client_transport.reading


def test_a_client_that_does_not_read_relays_answers_is_not_read_either(wired: Wired) -> None:
    """Found by review: pipelined requests that relay answers itself, from a client that
    never reads, grew relay's memory without bound (the answers queue in a buffer the
    client does not drain). At the transport's high-water mark relay stops reading, as
    nginx does, and reads again once the client drained it."""
    wired.client.data_received(UNROUTED * 3)
    wired.turns.end()
    assert wired.client_transport.data.count(b"HTTP/1.1 404") == 3
    wired.client.pause_writing()  # what the transport says at its high-water mark
    assert not reading(wired)
    wired.client.resume_writing()
    assert reading(wired)


def test_a_body_on_its_way_keeps_flowing_until_its_exchange_ends(wired: Wired) -> None:
    """While a request body still goes upstream, the client is read (the body is under its
    upstream's own backpressure); once that exchange is over, a client that still does not
    read is not read either."""
    head = f"POST /up HTTP/1.1\r\nHost: 3000-sbx.{DOMAIN}\r\nContent-Length: 4\r\n\r\n"
    wired.client.data_received(head.encode() + b"ab")
    wired.turns.end()
    wired.client.pause_writing()
    assert reading(wired)
    wired.client.data_received(b"cd")
    wired.turns.end()
    wired.upstream.data_received(RESPONSE)
    wired.turns.end()
    assert wired.client.active is None
    assert not reading(wired)
    wired.client.resume_writing()
    assert reading(wired)


def test_a_queued_upload_is_read_once_its_turn_comes(wired: Wired) -> None:
    """Found by review: the first answer filled the client's buffer and finished; the queued
    POST behind it then started with its body on its way, but relay kept not reading the
    client, which may send the whole body before it reads anything."""
    post_b = f"POST /up HTTP/1.1\r\nHost: 3000-sbx.{DOMAIN}\r\nContent-Length: 10\r\n\r\nab"
    second = UpstreamConnection(wired.relay.pool, PoolKey("sbx", 0, "127.0.0.1", 3000))
    second.connection_made(Recorder(("127.0.0.1", 3000)))  # type: ignore[arg-type]
    wired.relay.pool.release(second)
    wired.client.data_received(ROUTED + post_b.encode())
    wired.turns.end()
    wired.client.pause_writing()
    first = wired.client.active
    assert first is not None
    assert first.upstream is not None
    first.upstream.data_received(RESPONSE)
    wired.turns.end()
    upload = wired.client.active
    assert upload is not None
    assert upload.head.method == b"POST"
    assert reading(wired)
    wired.client.data_received(b"cdefghij")  # the body's end: nothing more to read for it
    wired.turns.end()
    assert not reading(wired)


def test_a_head_relay_stopped_reading_gets_no_408(
    wired: Wired, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a pipelined head half read when relay stopped reading the client
    (its answers not drained) got a 408 once header_timeout_s passed; relay was the one not
    reading, so the head's wait restarts, as behind a running response."""
    now = [1000.0]
    monkeypatch.setattr(wired.relay.timers, "_clock", lambda: now[0])
    wired.client.data_received(ROUTED + b"GET /y HTTP/1.1\r\nHo")
    wired.turns.end()
    wired.client.pause_writing()
    wired.upstream.data_received(RESPONSE)
    wired.turns.end()
    assert wired.client.active is None
    assert not reading(wired)
    now[0] += wired.relay.config.listen.header_timeout_s + 1
    wired.relay.timers.sweep()
    wired.turns.end()
    assert b" 408 " not in wired.client_transport.data


def test_bytes_after_a_handshake_in_a_second_read_of_one_turn_reach_the_websocket(
    wired: Wired,
) -> None:
    """The TLS hand-over feeds the reads that came before it in a row, without the pause a
    handshake sets (relay.handshake): a second read after the handshake's was dropped (found
    by the property test of relay.slices)."""
    frame = b"\x81\x85\0\0\0\0hello"
    wired.client.data_received(HANDSHAKE + frame)
    wired.client.data_received(frame * 2)
    wired.turns.end()
    wired.upstream.data_received(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    wired.turns.end()
    assert wired.upstream_transport.data.endswith(b"\r\n\r\n" + frame * 3)


async def test_an_address_getaddrinfo_cannot_take_is_a_dial_error() -> None:
    """getaddrinfo raises UnicodeError (not OSError) for a zone it cannot encode; it escaped
    Pool.connect, and the exchange stayed DIALING for ever (found by review; such routes are
    now refused, relay.core.routes)."""
    pool = upstreams.Pool(connect_timeout_s=1.0)
    with pytest.raises(DialError):
        await pool.connect(PoolKey("zoned", 0, "fd00::1%\ud800", 8080))


async def test_a_dial_that_fails_unexpectedly_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a dial raises, the client gets an answer and the sandbox's in-flight count
    drops (before, anything but a DialError left the exchange DIALING and counted)."""

    async def broken(self: upstreams.Pool, key: PoolKey) -> UpstreamConnection:
        raise RuntimeError("a bug")

    monkeypatch.setattr(upstreams.Pool, "connect", broken)
    caplog.set_level(logging.ERROR)
    async with running_relay(tmp_path, [route("dialbox", insecure=True)]) as relay:
        response = await request(relay.port, "GET", "/", f"8080-dialbox.{RELAY_DOMAIN}")
        assert response.status == 500
        assert relay.relay.inflight.get("dialbox", 0) == 0
    assert "a bug" not in response.body.decode()

"""A client's FIN during a response of unknown length ends the exchange (README, "Half-closed
clients wait"): a stream is not waited out for a client that has most likely gone.

A FIN is a half-close or a close, and TCP does not say which. relay answers every request a
half-closed client sent, but a stream (a Connect server stream, a watch, SSE: chunked, no end
in sight) would hold its upstream until the next event's write found the client gone; envd's
watch sends a keep-alive ping only every 50 s. The E2B JS SDK over plain HTTP ends a stream with
a FIN (undici's ``socket.end()``), and so does a front proxy or load balancer whose client left;
Go's server (E2B's proxy) and nginx take the FIN as an abort too. A response with a length is
still answered to a half-closed client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from relay import timers
from relay.flow import PAUSE_CLIENT_FULL
from tests.support.harness import (
    DOMAIN,
    RelayUnderTest,
    route,
    running_relay,
    scripted_upstream,
    until,
)

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
EVENT = b'\x00\x00\x00\x00\x0b{"event":1}'
CHUNK = b"%x\r\n" % len(EVENT) + EVENT + b"\r\n"


def _request(port: int, version: str = "1.1") -> bytes:
    return (
        f"POST /process.Process/Start HTTP/{version}\r\nHost: {port}-finstream.{DOMAIN}\r\n"
        "Content-Type: application/connect+json\r\nContent-Length: 2\r\n\r\n{}"
    ).encode()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _streaming(
    first: bytes,
    go_on: asyncio.Event,
    upstream_closed: asyncio.Event,
    *,
    head_first: bool,
    request_seen: asyncio.Event | None = None,
) -> Handler:
    """An upstream that takes the POST (``request_seen``), sends ``first`` (the stream's head
    and a first event; after ``go_on`` unless ``head_first``) and then nothing more, as a
    watch with no change does: ``upstream_closed`` is set when relay closes this connection."""

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        if request_seen is not None:
            request_seen.set()
        if not head_first:
            await go_on.wait()
        writer.write(first)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            await reader.read()  # nothing more is sent; EOF when relay closes this connection
        upstream_closed.set()
        writer.close()

    return stream


def _answering_late(answer: bytes) -> Handler:
    """An upstream that takes the POST and sends the whole ``answer`` in one write 0.3 s
    later, once the client's FIN has reached relay."""

    async def whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        await asyncio.sleep(0.3)  # the client's FIN reaches relay first
        writer.write(answer)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            await reader.read()
        writer.close()

    return whole


async def _read_past(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    got = b""
    async with asyncio.timeout(5):
        while marker not in got:
            got += await reader.read(65536)
    return got


async def _pipelined_and_paused(
    writer: asyncio.StreamWriter, relay: RelayUnderTest, port: int
) -> None:
    """The POST and a GET pipelined behind it: relay queues the GET and stops reading the
    client (PAUSE_QUEUE), so the event loop does not read a FIN that follows."""
    queued = f"GET /after HTTP/1.1\r\nHost: {port}-finstream.{DOMAIN}\r\n\r\n"
    writer.write(_request(port) + queued.encode())
    await until(lambda: len(relay.relay.connections) == 1)
    (conn,) = relay.relay.connections
    await until(lambda: bool(conn._paused))


@pytest.mark.parametrize("version", ["1.1", "1.0"])
@pytest.mark.parametrize("head_first", [True, False], ids=["fin-mid-stream", "fin-before-head"])
@pytest.mark.parametrize("how", ["shutdown", "close"])
async def test_a_fin_during_a_stream_ends_it_upstream(
    tmp_path: Path, head_first: bool, how: str, version: str
) -> None:
    """The upstream sends one event and then nothing (as a watch with no change does); the
    client sends its FIN after that event, or before the stream's head came. relay must close
    the upstream connection at once, not when a later event finds the client gone.

    HTTP/1.0: the stream reaches the client unframed, to the close (RFC 9112 §6.3), and is no
    less a stream; a front proxy speaking HTTP/1.0 to relay (nginx's default
    proxy_http_version) closes its connection when its own client leaves (found by review:
    only a stream chunked to the client was ended, this one held its upstream)."""
    upstream_closed = asyncio.Event()
    go_on = asyncio.Event()
    request_seen = asyncio.Event()
    stream = _streaming(
        STREAM_HEAD + CHUNK,
        go_on,
        upstream_closed,
        head_first=head_first,
        request_seen=request_seen,
    )

    async with (
        scripted_upstream(stream) as port,
        running_relay(tmp_path, [route("finstream", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            writer.write(_request(port, version))
            await request_seen.wait()
            if head_first:
                await _read_past(reader, EVENT)
            if how == "shutdown":
                writer.write_eof()
            else:
                writer.close()
            await asyncio.sleep(0.2)
            go_on.set()
            started = time.monotonic()
            await asyncio.wait_for(upstream_closed.wait(), 3)
            assert time.monotonic() - started < 2
            await asyncio.sleep(0.05)
            assert relay.relay.pool.opened == 0
        finally:
            go_on.set()
            writer.close()


@pytest.mark.parametrize("version", ["1.1", "1.0"])
@pytest.mark.parametrize(
    ("upstream_answer", "expected_tail"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"\r\n\r\nhello"),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b"\r\n\r\n"),
    ],
    ids=["length", "204"],
)
async def test_a_half_closed_client_still_gets_an_answer_with_a_length(
    tmp_path: Path, version: str, upstream_answer: bytes, expected_tail: bytes
) -> None:
    """The half-close that relay keeps serving: a request, then shutdown(SHUT_WR), and an
    answer that comes later with a Content-Length, or with no body at all (a 204), from
    HTTP/1.1 and HTTP/1.0 clients alike."""

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        await asyncio.sleep(0.3)
        writer.write(upstream_answer)
        await writer.drain()
        writer.close()

    async with (
        scripted_upstream(slow) as port,
        running_relay(tmp_path, [route("finstream", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(_request(port, version))
        await writer.drain()
        writer.write_eof()
        async with asyncio.timeout(5):
            answer = await reader.read()
        writer.close()
    assert answer.startswith(upstream_answer.split(b"\r\n")[0] + b"\r\n"), answer
    assert answer.endswith(expected_tail), answer


@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_a_whole_chunked_answer_still_reaches_a_half_closed_client(
    tmp_path: Path, version: str
) -> None:
    """A chunked answer whose head, body and end come in one read is no stream: relay holds
    all of it, and the half-closed client gets it, as before 46e2916 (found by review: relay
    closed the client at the head and dropped the rest, while its access log said 200 with
    the body's bytes). A short answer of a Go handler (past 2 KiB), Node's or a streaming
    framework's comes chunked."""

    whole = _answering_late(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    async with (
        scripted_upstream(whole) as port,
        running_relay(tmp_path, [route("finstream", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            writer.write(_request(port, version))
            await writer.drain()
            writer.write_eof()
            async with asyncio.timeout(5):
                answer = await reader.read()
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    if version == "1.1":
        assert answer.endswith(b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n"), answer
    else:
        assert answer.endswith(b"\r\n\r\nhello"), answer


@pytest.mark.parametrize("head_first", [True, False], ids=["fin-mid-stream", "fin-before-head"])
@pytest.mark.parametrize("how", ["shutdown", "close"])
async def test_a_fin_during_a_stream_ends_it_while_relay_does_not_read_the_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, head_first: bool
) -> None:
    """A stream with a pipelined request queued behind it: relay stops reading the client
    (PAUSE_QUEUE), so the event loop never reads its FIN. The periodic peer check
    (check_peer, PEER_CHECK_S) must see it (POLLRDHUP) and end the stream as a FIN read
    would, whether it came during the stream or before its head. A FIN is only a FIN here:
    no reset, no hang-up, as nothing is written to the client while the stream is quiet."""
    monkeypatch.setattr(timers, "PEER_CHECK_S", 0.2)
    upstream_closed = asyncio.Event()
    go_on = asyncio.Event()
    # the queued request is never sent there: the stream is first
    stream = _streaming(STREAM_HEAD + CHUNK, go_on, upstream_closed, head_first=head_first)

    async with (
        scripted_upstream(stream) as port,
        running_relay(tmp_path, [route("finstream", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            await _pipelined_and_paused(writer, relay, port)
            if head_first:
                await _read_past(reader, EVENT)
            if how == "shutdown":
                writer.write_eof()
            else:
                writer.close()
            await asyncio.sleep(1)  # several peer checks before the head
            go_on.set()
            await asyncio.wait_for(upstream_closed.wait(), 5)
            await until(lambda: relay.relay.pool.opened == 0)
            await until(lambda: not relay.relay.connections)
        finally:
            go_on.set()
            writer.close()


async def test_a_paused_half_closed_client_still_gets_every_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The half-close relay keeps serving while it does not read the client: two pipelined
    requests (the second queued, the client paused), the FIN, and answers with a length that
    come after several peer checks. Both are answered, in order, then the connection
    closes."""
    monkeypatch.setattr(timers, "PEER_CHECK_S", 0.2)

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            for _ in range(2):  # bounded: the two requests, on one pooled connection or two
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"POST"):
                    await reader.readexactly(2)
                    await asyncio.sleep(1)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n" + head[:5])
                await writer.drain()
        writer.close()

    async with (
        scripted_upstream(slow) as port,
        running_relay(tmp_path, [route("finstream", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            await _pipelined_and_paused(writer, relay, port)
            writer.write_eof()
            async with asyncio.timeout(5):
                answer = await reader.read()
        finally:
            writer.close()
    assert answer.count(b"HTTP/1.1 200 OK") == 2, answer
    assert answer.endswith(b"\r\n\r\nGET /"), answer


async def test_a_whole_answer_of_tiny_chunks_still_reaches_a_half_closed_client(
    tmp_path: Path,
) -> None:
    """A whole chunked answer in one read that is a flood of tiny chunks (more than
    FLOOD_PIECES in its first slice): relay feeds the rest of that read in the loop's next
    pass (relay.upstream_side, _flood_continue), after the check of a half-closed client's stream,
    which found the answer unfinished and closed the client, though the read held all of it
    (found by review: the rule is that an answer whose end comes in its head's read is
    answered). NDJSON rows written one chunk each, as Node's res.write does."""
    rows = [b'{"row":%04d}\n' % n for n in range(1200)]
    body = b"".join(b"%x\r\n%s\r\n" % (len(row), row) for row in rows) + b"0\r\n\r\n"
    assert len(body) > 2 * 8192

    whole = _answering_late(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)

    async with (
        scripted_upstream(whole) as port,
        running_relay(tmp_path, [route("finstream", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            writer.write(_request(port))
            await writer.drain()
            writer.write_eof()
            async with asyncio.timeout(5):
                answer = await reader.read()
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
    assert _dechunked(answer.partition(b"\r\n\r\n")[2]) == b"".join(rows)


def _dechunked(framed: bytes) -> bytes:
    """A whole chunked body's data (relay frames the chunks its own way: a chunk split
    between two slices of a read goes out as two)."""
    out: list[bytes] = []
    at = 0
    for _ in range(len(framed)):  # bounded: each chunk takes at least one byte
        line_end = framed.find(b"\r\n", at)
        assert line_end >= 0, f"cut after {sum(map(len, out))} bytes of data"
        size = int(framed[at:line_end], 16)
        if size == 0:
            assert framed[line_end:] == b"\r\n\r\n", framed[line_end:]
            return b"".join(out)
        out.append(framed[line_end + 2 : line_end + 2 + size])
        at = line_end + 2 + size + 2
    raise AssertionError("no last chunk")


@pytest.mark.parametrize("head_first", [True, False], ids=["fin-mid-stream", "fin-before-head"])
async def test_a_stream_ended_at_a_fin_is_cut_for_an_http10_client_that_still_reads(
    tmp_path: Path, head_first: bool
) -> None:
    """A half-closed HTTP/1.0 client may still read (TCP does not tell a half-close from a
    close). Its stream is close-delimited (RFC 9112 §6.3), so an orderly close after the part
    relay wrote makes that part the whole answer: RFC 9112 §8 takes it as complete "unless an
    error was indicated by the underlying connection". relay ends a cut HTTP/1.0 response with
    a reset (README "HTTP versions", Respond.cut); the stream ended at the client's FIN is a
    cut too, and must not read as a complete answer."""
    go_on = asyncio.Event()
    upstream_closed = asyncio.Event()
    stream = _streaming(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\nhello",
        go_on,
        upstream_closed,
        head_first=head_first,
    )

    async with (
        scripted_upstream(stream) as port,
        running_relay(tmp_path, [route("finstream", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        got = b""
        ending = "clean"
        try:
            writer.write(_request(port, "1.0"))
            async with asyncio.timeout(5):
                if head_first:
                    while b"hello" not in got:
                        got += await reader.read(65536)
                writer.write_eof()
                await asyncio.sleep(0.2)
                go_on.set()
                try:
                    for _ in range(100):  # bounded: until the end of the answer
                        data = await reader.read(65536)
                        if not data:
                            break
                        got += data
                except ConnectionResetError:
                    ending = "reset"
            await asyncio.wait_for(upstream_closed.wait(), 5)
            await until(lambda: relay.relay.pool.opened == 0)
        finally:
            go_on.set()
            writer.close()
    assert ending == "reset", got  # a clean end would make b"hello" the whole body


async def test_a_fin_ends_a_stream_at_once_for_a_client_that_does_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's client that stopped reading (relay's buffer for it full, PAUSE_CLIENT_FULL)
    and sent its FIN: relay ends the stream (check_peer), and the rule is that the exchange
    ends and its upstream closes at once. A close of the client connection waits for what
    relay still has to write, which a client that does not read never takes: the upstream
    and the sandbox's in-flight slot were held until the close's stall deadline
    (CLOSE_STALL_S, 60 s)."""
    monkeypatch.setattr(timers, "PEER_CHECK_S", 0.2)
    upstream_closed = asyncio.Event()
    piece = b"e" * 65536
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(STREAM_HEAD)
        with contextlib.suppress(ConnectionError):
            for _ in range(512):  # bounded: 32 MiB, far past every buffer on the way
                writer.write(chunk)
                await writer.drain()
        upstream_closed.set()
        writer.close()

    async with (
        scripted_upstream(flood) as port,
        running_relay(tmp_path, [route("finstream", insecure=True)]) as relay,
    ):
        sock = socket.create_connection(("127.0.0.1", relay.port))
        try:
            sock.sendall(_request(port))
            await until(lambda: len(relay.relay.connections) == 1)
            (conn,) = relay.relay.connections
            await until(lambda: bool(conn._paused & PAUSE_CLIENT_FULL), within_s=10)
            sock.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(upstream_closed.wait(), 5)
            await until(lambda: relay.relay.pool.opened == 0)
        finally:
            sock.close()

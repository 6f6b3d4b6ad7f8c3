"""Resource exhaustion: slow heads, slow bodies, big heads, connection limits, slow readers.

The shared relay runs with ``listen.header_timeout_s = 1`` and the default
``listen.max_header_bytes`` (16384). Tests that need their own limits start their own relay
and check, before they end, that it still serves a normal request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from tests.hostile.conftest import (
    HEADER_TIMEOUT_S,
    Hostile,
    body_json,
    connected,
    exchange,
)
from tests.hostile.recorder import Recorder
from tests.support.harness import DOMAIN, relay_process, route, running_relay
from tests.support.rawhttp import Connection, request, request_bytes

MAX_HEADER_BYTES = 16384


async def normal_request(hostile: Hostile, path: str = "/normal") -> float:
    """A plain request through the shared relay; returns how long it took."""
    started = time.monotonic()
    response = await request(hostile.port, "GET", path, hostile.app, timeout=3)
    assert response.status == 200
    assert response.body == f"GET {path} 0".encode()
    return time.monotonic() - started


async def trickle(conn: Connection, data: bytes, interval: float) -> bool:
    """Send one byte at a time; False once relay closed the connection."""
    for i in range(len(data)):
        try:
            conn.writer.write(data[i : i + 1])
            await conn.writer.drain()
        except (ConnectionError, OSError, RuntimeError):  # RuntimeError: transport closed
            return False
        if conn.reader.at_eof():
            return False
        await asyncio.sleep(interval)
    return True


async def read_until_closed(conn: Connection, timeout: float) -> bytes | None:
    """Everything relay sends until it closes the connection; None if it did not close."""
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while chunk := await asyncio.wait_for(conn.reader.read(65536), deadline - time.monotonic()):
            data += chunk
    except (TimeoutError, ValueError):
        return None
    except ConnectionError:  # reset, or the broken pipe of an earlier write
        pass
    return data


# -- slow heads (slowloris) ----------------------------------------------------------------


async def test_a_trickled_head_is_closed_after_the_header_timeout(hostile: Hostile) -> None:
    head = request_bytes("GET", "/slow", hostile.app)  # ~40 bytes: 4 s at 10 bytes/s
    mark = hostile.recorder.mark()
    async with connected(hostile.port) as conn:
        started = time.monotonic()
        sender = asyncio.ensure_future(trickle(conn, head, 0.1))
        response = await conn.read_response(timeout=HEADER_TIMEOUT_S + 2)
        elapsed = time.monotonic() - started
        assert await conn.closed_by_peer(1)
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
    assert response.status == 408
    # The timeout runs from accept; the sweep adds up to half a second.
    assert HEADER_TIMEOUT_S <= elapsed < HEADER_TIMEOUT_S + 1.0, elapsed
    assert await hostile.recorder.nothing_since(mark)


async def test_many_slowloris_connections_do_not_block_a_normal_request(
    hostile: Hostile,
) -> None:
    count = 200
    conns = [await Connection.open(hostile.port) for _ in range(count)]
    try:
        for conn in conns:
            conn.writer.write(b"GET / HTTP/1.1\r\nHo")
        # While all of them hang in the middle of their head, others are served at once.
        for i in range(5):
            assert await normal_request(hostile, f"/while-slow-{i}") < 0.5
        # And every slow one is closed once the header timeout has passed.
        started = time.monotonic()
        answers = await asyncio.gather(
            *(read_until_closed(c, HEADER_TIMEOUT_S + 1.5) for c in conns[:: count // 20])
        )
        assert all(a is not None and a.startswith(b"HTTP/1.1 408 ") for a in answers), answers
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 1.5
    finally:
        for conn in conns:
            await conn.close()


async def test_a_slow_body_is_not_a_slow_head(hostile: Hostile) -> None:
    """No read timeout on an established exchange (SPEC §4): a body trickled over longer than
    the header timeout is forwarded whole, and other clients are served meanwhile."""
    body = b"0123456789" * 2
    mark = hostile.recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(
            request_bytes("POST", "/slow-body", hostile.app, [("Content-Length", str(len(body)))])
        )
        sender = asyncio.ensure_future(trickle(conn, body, 0.08))  # ~1.6 s > the timeout
        await asyncio.sleep(0.3)
        assert await normal_request(hostile, "/meanwhile") < 0.5
        assert await sender
        response = await conn.read_response(timeout=3)
    assert response.status == 200
    assert response.body == b"POST /slow-body 20"
    bodies = [r.body for r in hostile.recorder.requests_since(mark) if r.target == b"/slow-body"]
    assert bodies == [body]


async def test_a_refused_request_cannot_hold_its_connection_with_a_body_it_never_sends(
    hostile: Hostile,
) -> None:
    """A refused request (here 401: no token) whose announced body never comes: relay has
    answered and has nothing to wait for but bytes it will drop. Without a deadline an
    unauthenticated client held the connection (and its listen.max_connections slot) for
    ever, the header timeout's slowloris bound sidestepped by one Content-Length. It gets
    the header timeout to send the rest, then a (lingering) close, as nginx bounds the
    discarding of a body (lingering_timeout)."""
    async with connected(hostile.port) as conn:
        await conn.send(request_bytes("POST", "/files", hostile.envd, [("Content-Length", "1000")]))
        response = await conn.read_response(timeout=3)
        assert response.status == 401
        started = time.monotonic()
        closed = await conn.closed_by_peer(HEADER_TIMEOUT_S + 3)
        assert closed, "relay still holds the refused request's connection"
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 3


async def test_a_refused_requests_body_sent_in_time_keeps_the_connection(
    hostile: Hostile,
) -> None:
    """The deadline above does not cut a client that sends the body it announced in time:
    the body is dropped and the connection serves the next request."""
    async with connected(hostile.port) as conn:
        await conn.send(request_bytes("POST", "/files", hostile.envd, [("Content-Length", "4")]))
        assert (await conn.read_response(timeout=3)).status == 401
        await asyncio.sleep(HEADER_TIMEOUT_S / 2)
        await conn.send(b"body")
        await asyncio.sleep(HEADER_TIMEOUT_S)  # past the deadline the body beat
        await conn.send(request_bytes("GET", "/after", hostile.app))
        after = await conn.read_response(timeout=3)
    assert after.status == 200
    assert after.body == b"GET /after 0"


# -- big heads ---------------------------------------------------------------------------------


async def refused_431(hostile: Hostile, raw: bytes) -> None:
    mark = hostile.recorder.mark()
    response, closed = await exchange(hostile.port, raw)
    assert response.status == 431, response.body
    assert body_json(response)["code"] == 431
    assert closed
    assert await hostile.recorder.nothing_since(mark)


async def test_header_section_over_the_limit_is_431(hostile: Hostile) -> None:
    head = f"GET / HTTP/1.1\r\nHost: {hostile.app}\r\n".encode()
    fields = b"".join(b"X-Field-%d: %s\r\n" % (i, b"v" * 200) for i in range(80))
    await refused_431(hostile, head + fields + b"\r\n")


async def test_a_whole_head_over_the_limit_gets_a_section_5_431(hostile: Hostile) -> None:
    """A head relay read whole before finding it over listen.max_header_bytes is refused with
    what its fields ask of any of relay's errors (SPEC §5): Access-Control-Allow-Origin for
    an Origin (a page's oversized cookies got a CORS failure instead of the 431), and no
    content after the head for a HEAD (RFC 9110 §9.3.2)."""
    fields = b"".join(b"X-Field-%d: %s\r\n" % (i, b"v" * 200) for i in range(80))
    head = f"GET / HTTP/1.1\r\nHost: {hostile.app}\r\nOrigin: https://a.b\r\n".encode()
    response, closed = await exchange(hostile.port, head + fields + b"\r\n")
    assert response.status == 431
    assert response.header("Access-Control-Allow-Origin") == "*"
    assert closed
    async with connected(hostile.port) as conn:
        await conn.send(f"HEAD / HTTP/1.1\r\nHost: {hostile.app}\r\n".encode() + fields + b"\r\n")
        answer = await read_until_closed(conn, 3)
    assert answer is not None
    assert answer.startswith(b"HTTP/1.1 431 "), answer
    assert answer.endswith(b"\r\n\r\n"), answer


async def test_one_huge_line_without_crlf_is_431(hostile: Hostile) -> None:
    for raw in (
        f"GET / HTTP/1.1\r\nHost: {hostile.app}\r\nX-Long: ".encode() + b"v" * 200_000,
        b"GET /" + b"a" * 200_000,
        b"GET / HTTP/1.1\r\nX-" + b"n" * 200_000,
    ):
        await refused_431(hostile, raw)


async def test_thousands_of_tiny_headers(hostile: Hostile) -> None:
    head = f"GET /tiny HTTP/1.1\r\nHost: {hostile.app}\r\n".encode()
    # 5000 fields of 6 bytes: over the limit.
    await refused_431(hostile, head + b"a: b\r\n" * 5000 + b"\r\n")
    # 1500 of them fit in the limit: forwarded, all of them, in order, byte for byte.
    fields = b"".join(b"x%d:\r\n" % i for i in range(1500))
    mark = hostile.recorder.mark()
    response, _ = await exchange(hostile.port, head + fields + b"\r\n", linger=0)
    assert response.status == 200
    assert (
        hostile.recorder.bytes_since(mark)
        == head + b"".join(b"x%d: \r\n" % i for i in range(1500)) + b"\r\n"
    )


async def endless_trailer(port: int, head: bytes) -> tuple[int, bytes]:
    """Send a chunked request whose trailer section never ends; return how many bytes were
    sent before relay answered and half-closed the connection, and what relay answered.

    relay's close lingers (it drops what a client still sends, so that the answer is not lost
    to a reset, RFC 9112 §9.6): the sign that it stopped reading the request is its answer
    followed by the end of its side of the stream."""
    sent = 0
    async with connected(port) as conn:
        answer = asyncio.ensure_future(read_until_closed(conn, 10))
        try:
            conn.writer.write(head + b"5\r\nhello\r\n0\r\nX-Trailer: ")
            block = b"t" * 65536
            while sent < 64 * 1024 * 1024 and not answer.done():
                conn.writer.write(block)
                await asyncio.wait_for(conn.writer.drain(), 5)
                sent += len(block)
        except (ConnectionError, OSError, RuntimeError):  # RuntimeError: transport closed
            pass
        got = await answer
    return sent, got or b""


async def test_an_endless_trailer_section_is_cut(hostile: Hostile) -> None:
    """Trailers are header fields after the body; llhttp has no size limit and httptools keeps
    a field's value in memory until its line ends, so relay must bound them itself."""
    for host in (hostile.app, f"49983-ghost.{DOMAIN}"):  # forwarded, and refused (502)
        head = f"POST /trailers HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n"
        started = time.monotonic()
        attack = asyncio.ensure_future(endless_trailer(hostile.port, head.encode()))
        await asyncio.sleep(0.2)
        assert await normal_request(hostile, "/during-trailers") < 0.5
        sent, answer = await attack
        assert sent < 16 * 1024 * 1024, f"relay read {sent} bytes of trailers"
        expected = b"HTTP/1.1 431 " if host == hostile.app else b"HTTP/1.1 502 "
        assert answer.startswith(expected) or answer == b"", answer[:100]
        assert time.monotonic() - started < 5


# -- connection limits -------------------------------------------------------------------------


async def test_listen_max_connections(tmp_path: Path, recorder: Recorder) -> None:
    host = f"{recorder.ports['app']}-open.{DOMAIN}"
    overrides = {"listen": {"max_connections": 4, "header_timeout_s": 5}}
    async with running_relay(tmp_path, [route("open", insecure=True)], overrides) as relay:
        held = [await Connection.open(relay.port) for _ in range(4)]
        try:
            await held[0].send(request_bytes("GET", "/held", host))
            assert (await held[0].read_response()).status == 200  # kept alive, still counted
            for _ in range(3):
                over = await request(relay.port, "GET", "/over", host)
                assert over.status == 503
                assert over.header("Retry-After") is not None
                assert over.header("Connection") == "close"
                assert body_json(over)["code"] == 503
        finally:
            for conn in held:
                await conn.close()
        for _ in range(200):  # connection_lost runs on relay's next loop iterations
            if not relay.relay.connections:
                break
            await asyncio.sleep(0.01)
        again = await request(relay.port, "GET", "/again", host)
        assert again.status == 200
        assert again.body == b"GET /again 0"


async def test_listen_max_connections_answer_is_a_section_5_error(
    tmp_path: Path, recorder: Recorder
) -> None:
    """The 503 past listen.max_connections is one of relay's errors like any other (SPEC §5):
    with an Origin it carries Access-Control-Allow-Origin, so that a page's script can read
    its status and Retry-After instead of a CORS failure, and a browser page load gets the
    HTML page. relay has read the whole head when it answers, as it does for every refusal."""
    host = f"{recorder.ports['app']}-open.{DOMAIN}"
    overrides = {"listen": {"max_connections": 1, "header_timeout_s": 5}}
    async with running_relay(tmp_path, [route("open", insecure=True)], overrides) as relay:
        held = await Connection.open(relay.port)
        try:
            await held.send(request_bytes("GET", "/held", host))
            assert (await held.read_response()).status == 200
            cors = await request(relay.port, "GET", "/over", host, [("Origin", "https://a.b")])
            assert cors.status == 503
            assert cors.header("Access-Control-Allow-Origin") == "*"
            page = await request(
                relay.port,
                "GET",
                "/over",
                host,
                [("Accept", "text/html"), ("Sec-Fetch-Mode", "navigate")],
            )
            assert page.status == 503
            assert page.header("Content-Type") == "text/html; charset=utf-8"
        finally:
            await held.close()


async def test_per_sandbox_max_connections(hostile: Hostile) -> None:
    host = hostile.host("app", "lim")
    mark = hostile.recorder.mark()
    slow = asyncio.ensure_future(request(hostile.port, "GET", "/stream?n=10&interval=0.05", host))
    await hostile.recorder.wait_for(mark, 1)
    refused = await request(hostile.port, "GET", "/second", host)
    assert refused.status == 429
    assert body_json(refused) == {
        "code": 429,
        "message": "The sandbox has too many concurrent incoming connections (limit: 1)",
        "sandboxId": "lim",
        "connectionLimit": 1,
    }
    assert (await slow).status == 200
    assert (await request(hostile.port, "GET", "/third", host)).status == 200
    assert [r.target for r in hostile.recorder.requests_since(mark)] == [
        b"/stream?n=10&interval=0.05",
        b"/third",
    ]


# -- a client that never reads -----------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_a_client_that_never_reads_gets_backpressure(
    tmp_path: Path, recorder: Recorder
) -> None:
    """relay stops reading the upstream when the client stops reading: the upstream's writes
    block, and relay's memory does not grow with the size of the response."""
    host = f"{recorder.ports['app']}-open.{DOMAIN}"
    with relay_process(tmp_path, [route("open", insecure=True)]) as relay:
        assert relay.proc is not None
        pid = relay.proc.pid
        baseline = rss_kib(pid)
        async with connected(relay.port) as conn:
            await conn.send(request_bytes("GET", "/bulk?mib=1024", host))
            # Wait until the upstream's writes block: no progress for half a second.
            deadline = time.monotonic() + 10
            last, still_since = -1, time.monotonic()
            while time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                now = recorder.bulk_written
                if now != last:
                    last, still_since = now, time.monotonic()
                elif time.monotonic() - still_since > 0.5:
                    break
            stalled_at = recorder.bulk_written
            await asyncio.sleep(0.5)
            assert recorder.bulk_written == stalled_at, "the upstream was never blocked"
            grown_mib = (rss_kib(pid) - baseline) / 1024
        print(f"upstream blocked after {stalled_at >> 20} MiB; relay RSS grew {grown_mib:.1f} MiB")
        assert stalled_at < 128 * 1024 * 1024  # kernel buffers only, of a 1 GiB response
        assert grown_mib < 32
        # relay is unaffected: the next request is served.
        after = await request(relay.port, "GET", "/after", host)
        assert after.status == 200
        assert after.body == b"GET /after 0"

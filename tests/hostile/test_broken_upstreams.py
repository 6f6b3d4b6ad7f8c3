"""Broken and hostile upstreams (SPEC §3, §5; the guest is not trusted either).

Before the first response byte, anything the upstream does wrong becomes a clean 502 JSON
answer on a client connection that stays usable. After it, the response ends cleanly where a
clean end exists (a Connect stream gets its end-of-stream frame) and is visibly truncated
otherwise (no terminator, connection closed). Either way relay is unaffected: the next
request, on a fresh connection, is served.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from relay.core.streams import end_stream_frame
from tests.hostile.conftest import Hostile, body_json, connected, relay_log
from tests.hostile.recorder import EVENTS
from tests.support.harness import DOMAIN
from tests.support.rawhttp import Connection, Response, request, request_bytes


async def still_serves(hostile: Hostile) -> None:
    response = await request(hostile.port, "GET", "/unaffected", hostile.app)
    assert response.status == 200
    assert response.body == b"GET /unaffected 0"


async def script_then_next(hostile: Hostile, script: str) -> tuple[Response, Response, bool]:
    """The canned response ``script`` (recorder.SCRIPTS), then ``GET /next`` on the same
    client connection: both responses, and whether relay sent both on one upstream
    connection (it reused the first's)."""
    mark = hostile.recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(request_bytes("GET", f"/raw/{script}", hostile.app))
        first = await conn.read_response(timeout=5)
        await conn.send(request_bytes("GET", "/next", hostile.app))
        after = await conn.read_response(timeout=5)
    first_conn, next_conn = (r.conn for r in hostile.recorder.requests_since(mark))
    return first, after, first_conn == next_conn


async def get(conn: Connection, host: str, path: str, timeout: float = 5.0) -> object:
    await conn.send(request_bytes("GET", path, host))
    return await conn.read_response(timeout=timeout)


@pytest.mark.parametrize(
    "script",
    [
        "bad-status",
        "status-000",
        "status-099",
        "status-600",
        "garbage",
        "http09",
        "cl-te",
        "te-cl",
        "two-cl",
        "two-cl-equal",
        "rtsp-status",
        "ice-status",
        "obs-fold",
        "bare-cr",
        "cr-in-value",
        "nul-header",
        "big-header",
        "many-headers",
        "close-before-status",
        "close-mid-head",
        "unsolicited-101",
    ],
)
async def test_failure_before_the_response_is_a_clean_502(hostile: Hostile, script: str) -> None:
    async with connected(hostile.port) as conn:
        await conn.send(request_bytes("GET", f"/raw/{script}", hostile.app))
        response = await conn.read_response(timeout=5)
        assert response.status == 502, (script, response.status, response.body[:200])
        body = body_json(response)
        assert body["code"] == 502
        assert body["sandboxId"] == "open"
        # Nothing of the broken response leaked into the answer.
        assert response.header("X-Big") is None
        assert response.header("X-A") is None
        # The same client connection carries on.
        await conn.send(request_bytes("GET", "/next", hostile.app))
        after = await conn.read_response(timeout=5)
        assert (after.status, after.body) == (200, b"GET /next 0")
    await still_serves(hostile)


async def test_an_endless_response_head_is_a_502(hostile: Hostile) -> None:
    """llhttp has no header size limit: relay caps the upstream's response head itself."""
    async with connected(hostile.port) as conn:
        await conn.send(request_bytes("GET", "/endless-head", hostile.app))
        await asyncio.sleep(0.2)
        assert await normal_request_time(hostile) < 0.5  # relay is not busy buffering it
        response = await conn.read_response(timeout=5)
    assert response.status == 502
    assert hostile.recorder.endless_written < 16 * 1024 * 1024
    await still_serves(hostile)


async def normal_request_time(hostile: Hostile) -> float:
    started = time.monotonic()
    await still_serves(hostile)
    return time.monotonic() - started


@pytest.mark.parametrize(
    ("script", "head", "body_prefix"),
    [
        ("close-mid-cl", ("Content-Length", "100"), b"only part"),
        ("close-mid-chunked", ("Transfer-Encoding", "chunked"), b"helloab"),
        ("bad-chunk", ("Transfer-Encoding", "chunked"), b"hello"),
    ],
)
async def test_failure_after_the_response_started_is_a_visible_truncation(
    hostile: Hostile, script: str, head: tuple[str, str], body_prefix: bytes
) -> None:
    async with connected(hostile.port) as conn:
        await conn.send(request_bytes("GET", f"/raw/{script}", hostile.app))
        response = await conn.read_response(timeout=5)
        assert response.status == 200
        assert response.header(head[0]) == head[1]
        assert not response.complete, "a truncated body must not look complete"
        assert body_prefix.startswith(response.body)
        assert conn.eof
    await still_serves(hostile)


async def test_an_endless_trailer_section_from_the_upstream_is_cut(hostile: Hostile) -> None:
    async with connected(hostile.port) as conn:
        await conn.send(request_bytes("GET", "/endless-trailer", hostile.app))
        await asyncio.sleep(0.2)
        assert await normal_request_time(hostile) < 0.5  # relay is not busy buffering it
        response = await conn.read_response(timeout=5)
        assert response.status == 200
        assert response.body == b"ok"
        assert not response.complete
        assert conn.eof
    assert hostile.recorder.endless_written < 16 * 1024 * 1024
    await still_serves(hostile)


@pytest.mark.parametrize("script", ["garbage-after", "second-response"])
async def test_bytes_after_a_complete_response_never_reach_a_client(
    hostile: Hostile, script: str
) -> None:
    """An upstream that sends more than the response (garbage, or a whole second response)
    must not inject it into the client connection nor have its connection reused."""
    first, after, reused = await script_then_next(hostile, script)
    assert (first.status, first.body) == (200, b"ok")
    assert after.header("X-Injected") is None
    assert (after.status, after.body) == (200, b"GET /next 0")
    assert not reused, "the connection of a misbehaving upstream was reused"
    await still_serves(hostile)


@pytest.mark.parametrize(
    ("script", "lines"),
    [
        ("reason-nul", [b"HTTP/1.1 200 OK"]),
        ("reason-esc", [b"HTTP/1.1 200 OK"]),
        ("reason-del", [b"HTTP/1.1 404 Not Found"]),
        ("reason-interim", [b"HTTP/1.1 103 Early Hints", b"HTTP/1.1 200 OK"]),
        ("reason-obs-text", [b"HTTP/1.1 200 Tr\xe8s\tbien"]),
    ],
)
async def test_a_reason_phrase_with_control_characters_is_not_relayed(
    hostile: Hostile, script: str, lines: list[bytes]
) -> None:
    """RFC 9112 §4: reason-phrase = 1*( HTAB / SP / VCHAR / obs-text ). relay writes the
    status line itself: a guest's NUL, ESC (terminal control sequences in whatever logs the
    line) or DEL was written on to the client, where the same byte in a field value is a 502.
    A reason is only a hint (RFC 9112 §4: "a client SHOULD ignore the reason-phrase", and
    intermediaries may overwrite it), so the status's own phrase stands in for it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", hostile.port)
    try:
        writer.write(request_bytes("GET", f"/raw/{script}", hostile.app))
        raw = b""
        while not raw.endswith(b"\r\n\r\nok"):
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, raw
            raw += data
    finally:
        writer.close()
    heads = [part.split(b"\r\n")[0] for part in raw.split(b"\r\n\r\n")[:-1]]
    assert heads == lines, raw
    await still_serves(hostile)


def decode(body: bytes) -> list[tuple[int, dict[str, object]]]:
    out, pos = [], 0
    while pos < len(body):
        length = int.from_bytes(body[pos + 1 : pos + 5], "big")
        out.append((body[pos], json.loads(body[pos + 5 : pos + 5 + length])))
        pos += 5 + length
    assert pos == len(body), "torn envelope"
    return out


UNAVAILABLE = (2, json.loads(end_stream_frame("open")[5:]))


@pytest.mark.parametrize(
    "script",
    [
        "connect-boundary",
        "connect-mid-envelope",
        "connect-mid-chunk",
    ],
)
async def test_a_cut_connect_stream_ends_with_the_unavailable_frame(
    hostile: Hostile, script: str
) -> None:
    """Whole envelopes reach the client; an envelope the upstream did not finish was held back,
    so the client is always at an envelope boundary and gets a well-formed end of stream."""
    async with connected(hostile.port) as conn:
        await conn.send(request_bytes("POST", f"/raw/{script}", hostile.app, body=b"{}"))
        response = await conn.read_response(timeout=5)
        assert response.status == 200
        assert response.complete
        assert decode(response.body) == [*((0, json.loads(e[5:])) for e in EVENTS), UNAVAILABLE]
        assert UNAVAILABLE[1]["error"] == {
            "code": "unavailable",
            "message": "the connection to sandbox open ended before the stream completed",
        }
        # The response ended well-formed, so the client connection is still good.
        await conn.send(request_bytes("GET", "/next", hostile.app))
        assert (await conn.read_response()).body == b"GET /next 0"
    await still_serves(hostile)


async def test_a_connect_stream_cut_inside_a_large_envelope_is_truncated(
    hostile: Hostile,
) -> None:
    """An envelope too large to hold back has been partly sent: no clean end is possible."""
    async with connected(hostile.port) as conn:
        await conn.send(
            request_bytes("POST", "/raw/connect-mid-big-envelope", hostile.app, body=b"{}")
        )
        response = await conn.read_response(timeout=5)
        assert response.status == 200
        assert not response.complete
        assert conn.eof
        assert response.body.startswith(EVENTS[0])
    await still_serves(hostile)


async def test_routes_outside_allowed_cidrs_are_rejected(hostile: Hostile) -> None:
    """The routes file names 127.0.0.2 and ::ffff:127.0.0.1, both outside the shared relay's
    ``upstream.allowed_cidrs`` (127.0.0.1/32, ::1/128): the routes are rejected (logged with
    the sandbox id), so their sandboxes are "not found", though a listener waits there."""
    recorder = hostile.recorder
    for sandbox, role in (("outside", "outside"), ("mapped", "app"), ("mapped", "envd")):
        mark = recorder.mark()
        host = f"{recorder.ports[role]}-{sandbox}.{DOMAIN}"
        response = await request(hostile.port, "GET", "/", host)
        assert response.status == 502
        assert body_json(response) == {
            "code": 502,
            "message": "The sandbox was not found",
            "sandboxId": sandbox,
        }
        assert await recorder.nothing_since(mark)
    log = relay_log(hostile.relay)
    for sandbox in ("outside", "mapped"):
        assert f"sandbox_id={sandbox} reason=address is outside upstream.allowed_cidrs" in log


async def test_a_route_added_at_runtime_outside_allowed_cidrs_is_rejected(
    hostile: Hostile,
) -> None:
    recorder = hostile.recorder
    hostile.set_routes(
        [
            {"sandbox_id": "late", "address": "127.0.0.2", "insecure": True},
            {"sandbox_id": "latelocal", "address": "127.0.0.1", "insecure": True},
        ]
    )
    try:
        good = f"{recorder.ports['app']}-latelocal.{DOMAIN}"
        for _ in range(100):  # the file feed polls every 0.1 s
            if (await request(hostile.port, "GET", "/", good)).status == 200:
                break
            await asyncio.sleep(0.05)
        mark = recorder.mark()
        bad = f"{recorder.ports['outside']}-late.{DOMAIN}"
        response = await request(hostile.port, "GET", "/", bad)
        assert response.status == 502
        assert body_json(response)["message"] == "The sandbox was not found"
        assert await recorder.nothing_since(mark)
    finally:
        hostile.set_routes([])

"""Connect server streams through relay: per-event delivery and clean ends when cut.

The upstream here emits Connect envelopes (``application/connect+json``) the way envd's
``Process.Start`` does; the SDK-level checks against the fake envd live with the SDK tests.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from relay.core.streams import DEFAULT_HOLD_LIMIT, MAX_ENVELOPES_PER_READ, end_stream_frame
from tests.support.harness import DOMAIN, RelayUnderTest, route, running_relay, scripted_upstream
from tests.support.rawhttp import Connection, Response, request_bytes


def envelope(payload: dict[str, object], flags: int = 0) -> bytes:
    data = json.dumps(payload).encode()
    return bytes([flags]) + len(data).to_bytes(4, "big") + data


def decode(body: bytes) -> list[tuple[int, dict[str, object]]]:
    out = []
    pos = 0
    while pos < len(body):
        length = int.from_bytes(body[pos + 1 : pos + 5], "big")
        out.append((body[pos], json.loads(body[pos + 5 : pos + 5 + length])))
        pos += 5 + length
    assert pos == len(body), "torn envelope"
    return out


@pytest.fixture
async def emitter() -> AsyncIterator[TestServer]:
    async def start(request: web.Request) -> web.StreamResponse:
        await request.read()
        count = int(request.query.get("n", "20"))
        interval = float(request.query.get("interval", "0.1"))
        response = web.StreamResponse(headers={"Content-Type": "application/connect+json"})
        await response.prepare(request)
        await response.write(envelope({"event": {"start": {"pid": 42}}}))
        for i in range(count):
            await asyncio.sleep(interval)
            await response.write(
                envelope({"event": {"data": {"stdout": f"{i}", "t": time.monotonic()}}})
            )
            if request.query.get("break_after") == str(i):
                assert request.transport is not None
                if request.query.get("mid_envelope"):
                    # Half of the next envelope (in its own chunk), then the upstream dies.
                    await response.write(envelope({"event": {"data": {"stdout": "cut"}}})[:9])
                    await asyncio.sleep(0.05)
                request.transport.abort()
                return response
        await response.write(envelope({"event": {"end": {"exited": True}}}))
        await response.write(envelope({}, flags=2))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/process.Process/Start", start)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


@pytest.fixture(params=[False, True], ids=["writes", "held"])
async def relay(
    tmp_path: Path, emitter: TestServer, request: pytest.FixtureRequest
) -> AsyncIterator[RelayUnderTest]:
    """Each test with small writes sent at once and with every one held (relay.outbox)."""
    routes = [route("proc", envd_token="tok"), route("bystander", envd_token="tok2")]
    overrides = {"upstream": {"envd_port": emitter.port}}
    async with running_relay(tmp_path, routes, overrides, hold_every_write=request.param) as r:
        yield r


async def open_stream(
    relay: RelayUnderTest, emitter: TestServer, query: str, sandbox: str = "proc"
) -> Connection:
    conn = await Connection.open(relay.port)
    body = envelope({"process": {"cmd": "/bin/bash", "args": ["-c", "seq 20"]}})
    await conn.send(
        request_bytes(
            "POST",
            f"/process.Process/Start?{query}",
            f"{emitter.port}-{sandbox}.{DOMAIN}",
            [
                ("X-Access-Token", "tok" if sandbox == "proc" else "tok2"),
                ("Content-Type", "application/connect+json"),
                ("Connect-Protocol-Version", "1"),
                ("Keepalive-Ping-Interval", "50"),
                ("Transfer-Encoding", "chunked"),
            ],
        )
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )
    return conn


async def read_events(conn: Connection, wanted: int, timeout: float) -> Response:
    deadline = time.monotonic() + timeout
    while len(conn.partial.chunks) < wanted and not conn.partial.complete:
        assert time.monotonic() < deadline
        if not await conn.pump(deadline - time.monotonic()):
            break
    return conn.partial


async def test_events_arrive_while_the_upstream_is_producing(
    relay: RelayUnderTest, emitter: TestServer
) -> None:
    conn = await open_stream(relay, emitter, "n=20&interval=0.1")
    response = await conn.read_response(timeout=10)
    await conn.close()
    events = decode(response.body)
    assert len(events) == 23  # start, 20 data, end, end-of-stream
    # Each data event is stamped by the upstream when sent; compare with its arrival here.
    arrivals = []
    for arrived, chunk in response.chunks:
        for flags, payload in decode(chunk):
            data = payload.get("event", {})
            if flags == 0 and isinstance(data, dict) and "data" in data:
                arrivals.append((arrived, data["data"]["t"]))
    assert len(arrivals) == 20
    lags = [arrived - sent for arrived, sent in arrivals]
    assert max(lags) < 0.05, lags  # no event waited for a later one
    spread = arrivals[-1][0] - arrivals[0][0]
    assert spread > 1.5  # they arrived over the ~2 s the upstream took


async def test_upstream_break_ends_with_an_unavailable_frame(
    relay: RelayUnderTest, emitter: TestServer
) -> None:
    conn = await open_stream(relay, emitter, "n=20&interval=0.02&break_after=3")
    response = await conn.read_response(timeout=5)
    events = decode(response.body)
    assert events[-1] == (
        2,
        {
            "error": {
                "code": "unavailable",
                "message": "the connection to sandbox proc ended before the stream completed",
            }
        },
    )
    assert len(events) == 1 + 4 + 1
    # The client connection stays usable: the response ended well-formed.
    await conn.send(request_bytes("GET", "/health", f"49983-ghost.{DOMAIN}"))
    assert (await conn.read_response()).status == 502
    await conn.close()


async def test_upstream_break_mid_envelope_still_ends_cleanly(
    relay: RelayUnderTest, emitter: TestServer
) -> None:
    conn = await open_stream(relay, emitter, "n=20&interval=0.02&break_after=2&mid_envelope=1")
    response = await conn.read_response(timeout=5)
    await conn.close()
    events = decode(response.body)  # no torn envelope: the half one was never released
    assert len(events) == 1 + 3 + 1
    assert events[-1][0] == 2
    assert events[-1][1]["error"]["code"] == "unavailable"  # type: ignore[index]


async def test_route_removal_ends_the_stream_with_the_frame(
    relay: RelayUnderTest, emitter: TestServer
) -> None:
    revoked = await open_stream(relay, emitter, "n=200&interval=0.05")
    bystander = await open_stream(relay, emitter, "n=30&interval=0.05", sandbox="bystander")
    await read_events(revoked, 3, 5)
    relay.set_routes([route("bystander", envd_token="tok2")])
    removed_at = time.monotonic()
    response = await revoked.read_response(timeout=2)
    assert time.monotonic() - removed_at < 1.0
    assert response.complete
    assert response.body.endswith(end_stream_frame("proc"))
    decode(response.body)
    other = await bystander.read_response(timeout=5)
    assert decode(other.body)[-1] == (2, {})  # the other sandbox's stream ended normally
    await revoked.close()
    await bystander.close()


async def close_delimited_stream(tmp_path: Path, writes: list[bytes]) -> Response:
    """What a client gets of a Connect stream whose app answers with no length (the body runs
    to the close, an HTTP/1.0-style app), writes ``writes`` 50 ms apart, then closes."""

    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
            b"Connection: close\r\n\r\n"
        )
        for data in writes:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.close()

    async with (
        scripted_upstream(app) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay_,
    ):
        conn = await Connection.open(relay_.port)
        await conn.send(
            request_bytes("POST", "/process.Process/Start", f"{port}-sbx.{DOMAIN}", body=b"{}")
        )
        response = await conn.read_response(timeout=5)
        await conn.close()
    return response


@pytest.mark.parametrize("mid_envelope", [True, False], ids=["mid-envelope", "between-envelopes"])
async def test_a_stream_without_a_length_cut_by_a_fin_ends_with_the_frame(
    tmp_path: Path, mid_envelope: bool
) -> None:
    """Found by review: a Connect stream whose body runs to the close (an HTTP/1.0-style app,
    Python's http.server) was taken as complete at the upstream's FIN: its held half-envelope
    went out in a body that looked whole, and no end-of-stream frame (SPEC §3)."""
    first = envelope({"event": {"start": {"pid": 1}}})
    second = envelope({"event": {"data": {"stdout": "aGk="}}})
    response = await close_delimited_stream(
        tmp_path,
        [first, second[:9] if mid_envelope else second],  # then the app dies
    )
    assert response.complete
    events = decode(response.body)  # every envelope whole
    assert events[0] == (0, {"event": {"start": {"pid": 1}}})
    assert len(events) == (2 if mid_envelope else 3)
    assert events[-1][0] == 2
    assert events[-1][1]["error"]["code"] == "unavailable"  # type: ignore[index]


async def test_a_stream_no_longer_followed_ends_at_the_fin(tmp_path: Path) -> None:
    """Found by review of the test above's fix: past MAX_ENVELOPES_PER_READ envelopes in a read
    relay stops following them, so never sees the end envelope; such a stream's FIN is its end,
    taken on trust as before, not a cut."""
    body = b"\0\0\0\0\0" * (MAX_ENVELOPES_PER_READ * 3) + envelope({}, flags=2)
    response = await close_delimited_stream(tmp_path, [body])
    assert response.complete
    assert response.body == body


async def test_a_stream_cut_inside_a_large_end_envelope_is_cut_visibly(tmp_path: Path) -> None:
    """Found by fuzz/fuzz_upstream.py: an end-of-stream envelope larger than the tracker's hold
    limit passes through unheld, and the tracker took its first byte for the stream's end. A
    FIN inside it then ended the close-delimited stream as if complete: the client got a torn
    envelope in a body that looked whole. relay cannot add its own end envelope mid-envelope,
    so the cut must show (no last chunk), as it does for a chunked upstream cut there."""
    first = envelope({"event": {"start": {"pid": 1}}})
    size = DEFAULT_HOLD_LIMIT + 1  # announced; only 100 bytes of it come
    response = await close_delimited_stream(
        tmp_path, [first, bytes([2]) + size.to_bytes(4, "big") + b"{" * 100]
    )
    assert response.body.startswith(first)
    assert not response.complete, "a torn end envelope in a body that looks whole"

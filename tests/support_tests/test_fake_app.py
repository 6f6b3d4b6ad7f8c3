"""The fake in-sandbox application: HTTP echo, timed streaming, WebSocket echo and close codes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp

from tests.support.fake_app import FakeApp, WsEvent


async def test_root_describes_the_request(app: FakeApp, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{app.url}/?a=1", headers={"X-Test": "yes"}) as response:
        assert response.status == 200
        body = await response.json()
    assert body["method"] == "GET"
    assert body["target"] == "/?a=1"
    assert ["X-Test", "yes"] in body["headers"]
    (record,) = app.records
    assert record.header("X-Test") == "yes"


async def test_echo_streams_the_body_back(app: FakeApp, http: aiohttp.ClientSession) -> None:
    async def body() -> AsyncIterator[bytes]:
        for part in (b"one,", b"two,", b"three"):
            yield part

    async with http.post(f"{app.url}/echo", data=body()) as response:
        assert response.headers["Transfer-Encoding"] == "chunked"
        assert await response.read() == b"one,two,three"
    assert app.requests_to("/echo")[0].body_size == 13


async def test_stream_emits_chunks_over_time(app: FakeApp, http: aiohttp.ClientSession) -> None:
    arrivals: list[float] = []
    chunks: list[bytes] = []
    async with http.get(f"{app.url}/stream?n=3&interval=0.2") as response:
        async for chunk in response.content.iter_any():
            arrivals.append(time.monotonic())
            chunks.append(chunk)
    assert b"".join(chunks) == b"chunk 0\nchunk 1\nchunk 2\n"
    assert arrivals[-1] - arrivals[0] > 0.3


async def test_websocket_echo_ping_and_close_codes(
    app: FakeApp, http: aiohttp.ClientSession
) -> None:
    async with http.ws_connect(f"{app.url}/ws", autoping=False) as ws:
        await ws.send_str("hello")
        assert (await ws.receive()).data == "hello"
        await ws.send_bytes(b"\x00\x01")
        assert (await ws.receive()).data == b"\x00\x01"
        await ws.ping(b"p")
        pong = await ws.receive()
        assert (pong.type, pong.data) == (aiohttp.WSMsgType.PONG, b"p")
        await ws.close(code=4000, message=b"bye")
    assert app.ws_close_codes == [4000]
    assert app.ws_events[-1] == WsEvent(kind="close", data="bye", code=4000)
    assert WsEvent(kind="ping", data=b"p") in app.ws_events

    async with http.ws_connect(f"{app.url}/ws") as ws:
        await ws.send_str("close:4001")
        message = await ws.receive()
        assert message.type == aiohttp.WSMsgType.CLOSE
        assert message.data == 4001
    assert ws.close_code == 4001


async def test_break_streams_cuts_a_live_response(
    app: FakeApp, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{app.url}/stream?n=50&interval=0.05") as response:
        first = await response.content.readany()
        assert first.startswith(b"chunk 0")
        assert app.break_streams() == 1
        try:
            rest = await response.read()
        except aiohttp.ClientPayloadError:
            rest = None
    assert rest is None or b"chunk 49" not in rest

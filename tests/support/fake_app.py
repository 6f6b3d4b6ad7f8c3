"""A fake application listening "inside the sandbox" on an app port (anything but envd's 49983).

Endpoints:
- ``GET /`` (any other unknown path too, with 404): JSON describing the request as received
  (method, raw target, HTTP version, headers in order).
- ``POST /echo``: streams the request body back as it arrives (chunked).
- ``GET /stream?n=5&interval=0.1``: ``n`` chunks ``chunk <i>\\n``, one every ``interval`` s.
- ``/ws``: WebSocket echo of text and binary messages. Pings are answered and recorded; the
  text ``close:<code>`` makes the server close with that code; a close frame from the client is
  recorded with its code and reason (``ws_close_codes``), so a test can prove that a code sent
  through a relay arrived.

Every request is recorded as by the fake envd (``records``, ``requests_to``), and
``break_streams()`` aborts in-flight exchanges, WebSockets included.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from aiohttp import WSMsgType, web

from tests.support.fake_server import FakeServer, iter_body
from tests.support.records import RecordHandle


@dataclass(frozen=True, slots=True, kw_only=True)
class WsEvent:
    kind: str  # "text", "binary", "ping", "pong", "close"
    data: str | bytes
    code: int | None = None  # for "close": the code the client sent


class FakeApp(FakeServer):
    def __init__(
        self, *, host: str = "127.0.0.1", port: int = 0, keepalive_timeout_s: float | None = None
    ) -> None:
        # A short keepalive_timeout_s (Node's default is 5 s) makes a pooled connection go stale.
        super().__init__(host=host, port=port, keepalive_timeout_s=keepalive_timeout_s)
        self.ws_events: list[WsEvent] = []

    @property
    def ws_close_codes(self) -> list[int]:
        """Close codes received from WebSocket clients, in arrival order."""
        return [e.code for e in self.ws_events if e.kind == "close" and e.code is not None]

    async def _handle(self, request: web.BaseRequest, record: RecordHandle) -> web.StreamResponse:
        path = request.path
        if path == "/ws" and request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request)
        if path == "/echo" and request.method == "POST":
            return await self._echo(request, record)
        if path == "/stream" and request.method == "GET":
            return await self._stream(request)
        return self._describe(request, 200 if path == "/" else 404)

    def _describe(self, request: web.BaseRequest, status: int) -> web.Response:
        body = {
            "method": request.method,
            "target": request.raw_path,
            "path": request.path,
            "version": f"HTTP/{request.version.major}.{request.version.minor}",
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers],
        }
        return web.Response(
            status=status, body=json.dumps(body).encode(), content_type="application/json"
        )

    async def _echo(self, request: web.BaseRequest, record: RecordHandle) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": request.headers.get("Content-Type", "application/octet-stream")
            },
        )
        response.enable_chunked_encoding()
        await response.prepare(request)
        async for chunk in iter_body(request, record):
            await response.write(chunk)
        await response.write_eof()
        return response

    async def _stream(self, request: web.BaseRequest) -> web.StreamResponse:
        count = int(request.query.get("n", "5"))
        interval = float(request.query.get("interval", "0.1"))
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for index in range(count):
            if index:
                await asyncio.sleep(interval)
            await response.write(f"chunk {index}\n".encode())
        await response.write_eof()
        return response

    async def _websocket(self, request: web.BaseRequest) -> web.WebSocketResponse:
        # autoping off so that pings can be recorded; they are still answered below.
        ws = web.WebSocketResponse(autoping=False)
        await ws.prepare(request)
        while True:
            # receive() rather than `async for`: iteration stops before yielding the CLOSE
            # message, and its code is what a test wants to see.
            message = await ws.receive()
            if message.type in (WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                break
            if message.type == WSMsgType.TEXT:
                self.ws_events.append(WsEvent(kind="text", data=message.data))
                if message.data.startswith("close:"):
                    await ws.close(code=int(message.data.removeprefix("close:")))
                    break
                await ws.send_str(message.data)
            elif message.type == WSMsgType.BINARY:
                self.ws_events.append(WsEvent(kind="binary", data=message.data))
                await ws.send_bytes(message.data)
            elif message.type == WSMsgType.PING:
                self.ws_events.append(WsEvent(kind="ping", data=message.data))
                await ws.pong(message.data)
            elif message.type == WSMsgType.PONG:
                self.ws_events.append(WsEvent(kind="pong", data=message.data))
            elif message.type == WSMsgType.CLOSE:
                # aiohttp has already answered the close frame (autoclose).
                self.ws_events.append(
                    WsEvent(kind="close", data=message.extra or "", code=message.data)
                )
                break
        return ws

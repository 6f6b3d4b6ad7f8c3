"""SIGTERM drain with a real ``relay serve`` (SPEC §7), one assertion per step:

/readyz 503 at once → new connections refused within 1 s → idle kept-alive connections closed →
in-flight streams and WebSockets carry on → at drain_timeout_s WebSockets get 1001 and
remaining exchanges are cut → exit 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer

from relay.drain import drain
from tests.support.harness import DOMAIN, RelayProcess, route, running_relay
from tests.support.ops import NotifySocket, get, port_refuses
from tests.support.rawhttp import Connection, request_bytes

DRAIN_S = 2.5


@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        n = int(request.query.get("n", "1000000"))
        for i in range(n):
            await response.write(f"event {i}\n".encode())
            await asyncio.sleep(0.1)
        await response.write_eof()
        return response

    async def ws(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        async for msg in socket:
            if msg.type is WSMsgType.TEXT:
                await socket.send_str("echo:" + msg.data)
        return socket

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/ws", ws)
    app.router.add_get("/", hello)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def _until(check: Callable[[], Awaitable[bool]], timeout: float) -> float:
    """Seconds until the async ``check()`` is true; raises TimeoutError."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if await check():
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise TimeoutError


async def test_sigterm_drains_then_cuts_then_exits_0(tmp_path: Path, upstream: TestServer) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    env = dict(os.environ, NOTIFY_SOCKET=str(notify.path))
    overrides = {"process": {"drain_timeout_s": DRAIN_S}}
    relay = RelayProcess(tmp_path, [route("sbx1", insecure=True)], overrides, env=env)
    relay.start()
    host = f"{upstream.port}-sbx1.{DOMAIN}"
    try:
        idle = await Connection.open(relay.port)
        await idle.send(request_bytes("GET", "/", host))
        assert (await idle.read_response()).status == 200  # kept alive, now idle
        finite = await Connection.open(relay.port)
        await finite.send(request_bytes("GET", "/stream?n=15", host))  # 1.5 s: fits
        endless = await Connection.open(relay.port)
        await endless.send(request_bytes("GET", "/stream", host))  # outlives the drain
        session = aiohttp.ClientSession()
        ws = await session.ws_connect(f"{relay.url}/ws", headers={"Host": host})
        await ws.send_str("before")
        assert (await ws.receive(2)).data == "echo:before"
        await endless.pump(0.3)
        assert b"event 0" in endless.partial.body

        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGTERM)
        sigterm = time.monotonic()
        finite_done = asyncio.create_task(finite.read_response(DRAIN_S + 2))

        # 1. /readyz is 503 at once.
        async def not_ready() -> bool:
            return (await get(relay.admin_port, "/readyz"))[0] == 503

        assert await _until(not_ready, 0.5) < 0.5
        await notify.wait_for("STOPPING", timeout=1)

        # 2. New connections are refused within a second.
        async def refused() -> bool:
            return await asyncio.to_thread(port_refuses, relay.port)

        await _until(refused, 1.0)
        assert time.monotonic() - sigterm < 1.0
        # 3. The idle kept-alive connection is closed.
        assert await idle.closed_by_peer(1.0)
        # 4. In flight: the WebSocket still talks, the finite stream completes.
        await ws.send_str("during")
        assert (await ws.receive(2)).data == "echo:during"
        streamed = await finite_done
        assert streamed.complete
        assert streamed.body.count(b"event ") == 15
        assert time.monotonic() - sigterm < DRAIN_S
        # 5. At drain_timeout_s: 1001 for the WebSocket, the endless stream is cut.
        msg = await ws.receive(DRAIN_S + 2)
        closed_after = time.monotonic() - sigterm
        assert msg.type is WSMsgType.CLOSE
        assert msg.data == 1001
        assert DRAIN_S - 0.3 < closed_after < DRAIN_S + 1.0
        while await endless.pump(2.0):
            pass
        assert not endless.partial.complete  # no terminating chunk: visibly truncated
        assert endless.partial.body.count(b"event ") >= 15
        # 6. The process exits 0.
        code = await asyncio.to_thread(relay.proc.wait, 5)
        assert code == 0
        assert time.monotonic() - sigterm < DRAIN_S + 3
        await ws.close()
        await session.close()
        for conn in (idle, finite, endless):
            await conn.close()
    finally:
        relay.stop()
        notify.close()
    log = relay.output()
    assert "drain timeout: ended 2 exchange(s) and WebSocket(s)" in log
    assert '"reason":"draining"' in log  # the access log says why they ended


async def test_an_idle_relay_exits_at_once(tmp_path: Path) -> None:
    relay = RelayProcess(tmp_path, [], {"process": {"drain_timeout_s": 30}})
    relay.start()
    try:
        assert relay.proc is not None
        started = time.monotonic()
        relay.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(relay.proc.wait, 10) == 0
        assert time.monotonic() - started < 3  # nothing to drain: no 30 s wait
    finally:
        relay.stop()


async def test_an_exchange_still_waiting_for_its_answer_gets_503(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def slow(_request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="too late")

    app = web.Application()
    app.router.add_get("/", slow)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with running_relay(tmp_path, [route("slowbox", insecure=True)]) as relay:
            conn = await Connection.open(relay.port)
            await conn.send(request_bytes("GET", "/", f"{server.port}-slowbox.{DOMAIN}"))
            await asyncio.sleep(0.2)
            ended = await drain(relay.relay, 0.3)
            response = await conn.read_response(2)
            await conn.close()
        release.set()
    finally:
        await server.close()
    assert ended == 1
    assert response.status == 503
    assert response.header("Retry-After") == "1"
    assert b"shutting down" in response.body


async def test_a_second_signal_cuts_the_drain_short(tmp_path: Path, upstream: TestServer) -> None:
    async with running_relay(tmp_path, [route("sbx1", insecure=True)]) as relay:
        conn = await Connection.open(relay.port)
        await conn.send(request_bytes("GET", "/stream", f"{upstream.port}-sbx1.{DOMAIN}"))
        await conn.pump(0.3)
        force = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, force.set)
        started = time.monotonic()
        assert await drain(relay.relay, 30, force=force) == 1
        assert time.monotonic() - started < 2
        assert relay.relay.draining
        while await conn.pump(1.0):
            pass
        assert not conn.partial.complete
        await conn.close()


async def test_a_head_half_sent_when_the_drain_starts_is_answered(tmp_path: Path) -> None:
    """Found by review: a client that had sent part of its request head when the drain began
    had its connection closed with no answer; it is a request in flight (SPEC §7)."""

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with running_relay(tmp_path, [route("sbx1", insecure=True)]) as relay:
            conn = await Connection.open(relay.port)
            whole = request_bytes("GET", "/", f"{server.port}-sbx1.{DOMAIN}")
            await conn.send(whole[:20])  # the request line and part of the Host field
            await asyncio.sleep(0.2)
            draining = asyncio.ensure_future(drain(relay.relay, 3.0))
            await asyncio.sleep(0.3)
            await conn.send(whole[20:])
            response = await conn.read_response(3)
            await conn.close()
            await draining
    finally:
        await server.close()
    assert response.status == 503
    body = response.json()
    assert isinstance(body, dict)
    assert body["code"] == 503

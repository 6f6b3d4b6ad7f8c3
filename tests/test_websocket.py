"""WebSocket pass-through on app ports: frames and close codes both ways, revocation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer

from tests.support.harness import DOMAIN, RelayUnderTest, route, running_relay, scripted_upstream


@dataclass
class WsApp:
    server: TestServer
    close_codes: list[int | None] = field(default_factory=list)
    sockets: list[web.WebSocketResponse] = field(default_factory=list)

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port


@pytest.fixture
async def ws_app() -> AsyncIterator[WsApp]:
    holder: list[WsApp] = []

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        holder[0].sockets.append(ws)
        async for msg in ws:
            if msg.type is WSMsgType.TEXT and msg.data.startswith("close:"):
                await ws.close(code=int(msg.data[6:]), message=b"bye")
            elif msg.type is WSMsgType.TEXT:
                await ws.send_str("echo:" + msg.data)
            elif msg.type is WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
        holder[0].close_codes.append(ws.close_code)
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    holder.append(WsApp(server))
    yield holder[0]
    await server.close()


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[RelayUnderTest]:
    routes = [route("wsbox", envd_token="e", traffic_token="tt"), route("other", insecure=True)]
    async with running_relay(tmp_path, routes) as r:
        yield r


def ws_headers(app: WsApp, sandbox: str = "wsbox") -> dict[str, str]:
    return {"Host": f"{app.port}-{sandbox}.{DOMAIN}", "E2b-Traffic-Access-Token": "tt"}


async def test_echo_and_client_close_code(relay: RelayUnderTest, ws_app: WsApp) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{relay.url}/ws", headers=ws_headers(ws_app)) as ws,
    ):
        await ws.send_str("hi")
        assert (await ws.receive(2)).data == "echo:hi"
        payload = bytes(range(256)) * 300
        await ws.send_bytes(payload)
        assert (await ws.receive(2)).data == payload
        await ws.ping(b"p")
        await ws.close(code=4000, message=b"client says bye")
    for _ in range(100):
        if ws_app.close_codes:
            break
        await asyncio.sleep(0.02)
    assert ws_app.close_codes == [4000]


async def test_server_close_code_reaches_the_client(relay: RelayUnderTest, ws_app: WsApp) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{relay.url}/ws", headers=ws_headers(ws_app)) as ws,
    ):
        await ws.send_str("close:4000")
        msg = await ws.receive(2)
        assert msg.type is WSMsgType.CLOSE
        assert msg.data == 4000
        assert msg.extra == "bye"


async def test_websocket_needs_the_traffic_token(relay: RelayUnderTest, ws_app: WsApp) -> None:
    headers = ws_headers(ws_app)
    del headers["E2b-Traffic-Access-Token"]
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await session.ws_connect(f"{relay.url}/ws", headers=headers)
    assert info.value.status == 403
    assert ws_app.sockets == []


async def test_removing_the_route_ends_the_websocket(relay: RelayUnderTest, ws_app: WsApp) -> None:
    async with aiohttp.ClientSession() as session:
        revoked = await session.ws_connect(f"{relay.url}/ws", headers=ws_headers(ws_app))
        other = await session.ws_connect(f"{relay.url}/ws", headers=ws_headers(ws_app, "other"))
        await revoked.send_str("a")
        assert (await revoked.receive(2)).data == "echo:a"
        relay.set_routes([route("other", insecure=True)])
        started = time.monotonic()
        msg = await revoked.receive(2)
        assert time.monotonic() - started < 1.0
        assert msg.type is WSMsgType.CLOSE
        assert msg.data == 1001
        # the other sandbox's WebSocket is untouched
        await other.send_str("still here")
        assert (await other.receive(2)).data == "echo:still here"
        await other.close()
        await revoked.close()


async def test_a_spliced_connection_keeps_no_http_parser(
    relay: RelayUnderTest, ws_app: WsApp
) -> None:
    # After the 101 the upstream connection carries frames only: the llhttp reader that came
    # with it (it lives with a pooled connection) is dropped, not held for the WebSocket's
    # life (bench: RSS per idle WebSocket).
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{relay.url}/ws", headers=ws_headers(ws_app)) as ws,
    ):
        await ws.send_str("hi")
        assert (await ws.receive(2)).data == "echo:hi"
        splices = [item for items in relay.relay.live.values() for item in items]
        assert len(splices) == 1
        upstream = splices[0].upstream  # type: ignore[attr-defined]
        assert upstream.reader is None


@pytest.mark.parametrize("token", ["tt", "wrong"])
async def test_a_handshake_pipelined_behind_a_request_is_answered_after_it(
    relay: RelayUnderTest, ws_app: WsApp, token: str
) -> None:
    # RFC 9112 §9.3.2: pipelined requests are answered in order, an upgrade among them too.
    # relay closed the connection after the first answer instead (llhttp stops at the
    # upgrade, and a connection with no parser left was taken for one that must close).
    host = f"Host: {ws_app.port}-wsbox.{DOMAIN}\r\nE2b-Traffic-Access-Token: tt\r\n"
    handshake = (
        f"GET /ws HTTP/1.1\r\nHost: {ws_app.port}-wsbox.{DOMAIN}\r\n"
        f"E2b-Traffic-Access-Token: {token}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    try:
        writer.write(f"GET /plain HTTP/1.1\r\n{host}\r\n{handshake}".encode())
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert first.startswith(b"HTTP/1.1 404"), first
        length = next(
            int(line.split(b":")[1])
            for line in first.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await asyncio.wait_for(reader.readexactly(length), 5)
        second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        if token != "tt":  # refused: answered in its turn, then the connection ends
            assert second.startswith(b"HTTP/1.1 403"), second
            await asyncio.wait_for(reader.read(), 5)  # the body, then EOF (no hang)
            assert reader.at_eof()
            return
        assert second.startswith(b"HTTP/1.1 101"), second
        writer.write(b"\x81\x82abcd" + bytes(b ^ b"abcd"[i % 4] for i, b in enumerate(b"hi")))
        echo = await asyncio.wait_for(reader.readexactly(9), 5)
        assert echo == b"\x81\x07echo:hi"
    finally:
        writer.close()


async def test_an_upgrade_llhttp_takes_that_is_no_handshake_is_refused(tmp_path: Path) -> None:
    # llhttp takes ``Proxy-Connection: upgrade`` for ``Connection: upgrade`` and stops parsing
    # at the head, as for any upgrade; relay's own rule (RFC 9110 §7.8: the option is named
    # in Connection) saw no handshake and forwarded the request as a plain one. Its body then
    # stayed in relay as the "WebSocket's" first bytes and never reached the app, which waited
    # for it for ever (SPEC §4 sets no read timeout), holding the sandbox's in-flight slot.
    got: list[bytes] = []

    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            got.append(head)
            got.append(await asyncio.wait_for(reader.readexactly(5), 3))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            writer.close()

    async with (
        scripted_upstream(app) as port,
        running_relay(tmp_path, [route("pc", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            writer.write(
                f"POST /up HTTP/1.1\r\nHost: {port}-pc.{DOMAIN}\r\n"
                "Proxy-Connection: upgrade\r\nUpgrade: websocket\r\nContent-Length: 5\r\n\r\n"
                "hello".encode()
            )
            answer = await asyncio.wait_for(reader.read(), 5)  # the answer, then the close
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"Connection: close" in answer
    assert got == []  # nothing reached the app: no request left waiting for its body


async def test_a_refused_handshake_whose_client_sent_on_is_closed_without_a_reset(
    tmp_path: Path,
) -> None:
    # A client that sends frames before its 101 (RFC 6455 §4.1 says it must wait; some do)
    # while the app refuses the handshake: relay, not reading it since the handshake, closed
    # with those bytes unread, and the kernel reset the connection, which may destroy the
    # refusal before the client reads it (RFC 9112 §9.6). A lingering close, as after any
    # answer relay gives a client still sending (relay.closing), ends it with a FIN.
    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.3)
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 4\r\n\r\nnope")
        await writer.drain()
        await reader.read()
        writer.close()

    async with (
        scripted_upstream(app) as port,
        running_relay(tmp_path, [route("early", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            writer.write(
                f"GET /ws HTTP/1.1\r\nHost: {port}-early.{DOMAIN}\r\nConnection: Upgrade\r\n"
                "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode()
            )
            await asyncio.sleep(0.1)
            writer.write(b"\x82\xfe\xff\xff\0\0\0\0" + b"x" * 0xFFFF)  # a frame, unasked
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 5)  # to the FIN; a reset raises
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 403 "), answer
    assert answer.endswith(b"\r\n\r\nnope")

"""The CONNECT proxy that gives SDK processes the test domain: it tunnels *.<domain>:443 to one
address and nothing else."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.tunnel_proxy import TunnelProxy


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _ask(
    proxy: TunnelProxy, request: bytes
) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return head, reader, writer


async def test_tunnels_the_test_domain_to_its_target() -> None:
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    async with server, TunnelProxy("e2b.test", ("127.0.0.1", port)) as proxy:
        head, reader, writer = await _ask(
            proxy, b"CONNECT 49983-abc.E2B.test.:443 HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert head.startswith(b"HTTP/1.1 200 ")
        writer.write(b"through the tunnel")
        assert await asyncio.wait_for(reader.readexactly(18), 5) == b"through the tunnel"
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the half-close went through
        writer.close()
        assert proxy.url == f"http://127.0.0.1:{proxy.port}"
        assert proxy.tunnels == ["49983-abc.e2b.test.:443"]
        assert proxy.refused == []


@pytest.mark.parametrize(
    ("request_line", "status"),
    [
        (b"CONNECT example.com:443 HTTP/1.1", b"403"),
        (b"CONNECT e2b.test.example.com:443 HTTP/1.1", b"403"),
        (b"CONNECT xe2b.test:443 HTTP/1.1", b"403"),
        (b"CONNECT api.e2b.test:80 HTTP/1.1", b"403"),
        (b"CONNECT 127.0.0.1:443 HTTP/1.1", b"403"),
        (b"GET http://api.e2b.test/ HTTP/1.1", b"405"),
        (b"nonsense", b"400"),
    ],
)
async def test_refuses_everything_else(request_line: bytes, status: bytes) -> None:
    async with TunnelProxy("e2b.test", ("127.0.0.1", 9)) as proxy:
        head, _, writer = await _ask(proxy, request_line + b"\r\nHost: x\r\n\r\n")
        writer.close()
        assert head.split(b" ")[1] == status
        assert proxy.tunnels == []
        assert len(proxy.refused) == 1

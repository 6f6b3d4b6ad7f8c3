"""TLS on the listener: the SDK's Host form is https://49983-<id>.<domain>."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.certs import issue
from tests.support.harness import DOMAIN, route, running_relay


async def test_https_listener_forwards(tmp_path: Path) -> None:
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}", DOMAIN])

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"hello over {request.host}")

    app = web.Application()
    app.router.add_get("/", hello)
    upstream = TestServer(app, host="127.0.0.1")
    await upstream.start_server()
    overrides = {"listen": {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file)}}
    try:
        async with running_relay(tmp_path, [route("tlsbox", insecure=True)], overrides) as relay:
            host = f"{upstream.port}-tlsbox.{DOMAIN}"
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", relay.port, ssl=certs.client_context(), server_hostname=host
            )
            ssl_object = writer.get_extra_info("ssl_object")
            assert ssl_object.selected_alpn_protocol() in (None, "http/1.1")
            writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
    finally:
        await upstream.close()
    assert data.startswith(b"HTTP/1.1 200")
    assert data.endswith(f"hello over {host}".encode())

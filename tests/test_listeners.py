"""What relay's sockets are set up with, and how its start line names them.

TCP keepalive on both sides of relay (``relay.upstream_conn.KEEPALIVE_OPTIONS``).

SPEC §4 sets no read timeout on an established exchange, so a peer that vanished without a FIN
or a reset (a guest gone, a client's laptop asleep, a NAT entry dropped) held its exchange, its
upstream connection and its sandbox's in-flight slot until relay next wrote to it: relay's
sockets had no keepalive (found by review; E2B's proxy, a Go program, probes every 15 s). A
vanished peer cannot be made on loopback, so the options are read back from the sockets relay
holds: the client's (set on the listener, inherited by each accepted connection) and the
pooled upstream's.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from relay.upstream_conn import KEEPALIVE_OPTIONS
from tests.support.harness import DOMAIN, route, running_relay
from tests.support.rawhttp import Connection, request_bytes


@pytest.fixture
async def app() -> AsyncIterator[TestServer]:
    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hi")

    application = web.Application()
    application.router.add_get("/", hello)
    server = TestServer(application, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


def probes(sock: socket.socket) -> list[int]:
    return [sock.getsockopt(level, option) for level, option, _ in KEEPALIVE_OPTIONS]


async def test_client_and_upstream_connections_probe_a_silent_peer(
    tmp_path: Path, app: TestServer
) -> None:
    wanted = [value for _, _, value in KEEPALIVE_OPTIONS]
    assert wanted[0] == 1  # SO_KEEPALIVE on
    async with running_relay(tmp_path, [route("sbx1", insecure=True)]) as relay:
        conn = await Connection.open(relay.port)
        try:
            await conn.send(request_bytes("GET", "/", f"{app.port}-sbx1.{DOMAIN}"))
            assert (await conn.read_response()).status == 200
            (client,) = relay.relay.connections
            assert client.transport is not None
            client_sock = client.transport.get_extra_info("socket")
            assert probes(client_sock) == wanted
            upstreams = [c for idle in relay.relay.pool._idle.values() for c in idle]
            (upstream,) = upstreams
            assert upstream.transport is not None
            assert probes(upstream.transport.get_extra_info("socket")) == wanted
        finally:
            await conn.close()


async def test_the_start_line_names_each_address_as_a_url_writes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The log line that says where relay listens wrote the admin address as a Python tuple,
    ``('127.0.0.1', 9090)``, and an IPv6 listener without brackets (``::1:8080``)."""
    caplog.set_level("INFO", logger="relay")
    overrides = {"listen": {"address": ["127.0.0.1:0", "[::1]:0"]}}
    async with running_relay(tmp_path, [], overrides) as relay:
        (v4, v4_port), (v6, v6_port) = relay.relay.bound
        admin = relay.relay.admin_bound
        assert admin is not None
    assert (v4, v6) == ("127.0.0.1", "::1")
    line = f"relay listening on 127.0.0.1:{v4_port}, [::1]:{v6_port} (admin 127.0.0.1:{admin[1]})"
    assert line in caplog.text

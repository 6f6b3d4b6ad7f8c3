"""No credential anywhere an operator looks (SPEC §2, §7): a real ``relay serve`` at DEBUG level
handles envd tokens, traffic tokens and signed URLs, valid and invalid, and a WebSocket is open
while /metrics and /routes are read; then everything relay printed, /metrics and /routes are
scanned for every token and signature value. The access log has its fields and no query."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer

from relay.__main__ import sign_url
from relay.core.auth import file_signature
from tests.support.harness import DOMAIN, RelayProcess, route
from tests.support.ops import get
from tests.support.rawhttp import request

ACCESS_FIELDS = {
    "time",
    "client",
    "sandbox_id",
    "port",
    "method",
    "path",
    "status",
    "bytes_in",
    "bytes_out",
    "duration_ms",
    "reason",
}


@pytest.fixture
async def servers() -> AsyncIterator[tuple[TestServer, TestServer]]:
    async def ws(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        async for msg in socket:
            if msg.type is WSMsgType.TEXT:
                await socket.send_str(msg.data)
        return socket

    async def ok(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="ok")

    made = []
    for _ in range(2):
        app = web.Application()
        app.router.add_get("/ws", ws)
        app.router.add_route("*", "/{tail:.*}", ok)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        made.append(server)
    yield made[0], made[1]
    for server in made:
        await server.close()


def _query_value(url: str, name: str) -> str:
    return urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)[name][0]


async def test_no_credential_in_logs_metrics_or_routes(
    tmp_path: Path, servers: tuple[TestServer, TestServer]
) -> None:
    envd_server, app_server = servers
    envd_port, app_port = envd_server.port, app_server.port
    assert envd_port is not None
    assert app_port is not None
    sandbox = "secretsbox" + secrets.token_hex(4)
    envd_token = "envd-" + secrets.token_hex(16)
    traffic_token = "traffic-" + secrets.token_hex(16)
    wrong_envd = "wrongenvd-" + secrets.token_hex(16)
    wrong_traffic = "wrongtraffic-" + secrets.token_hex(16)
    now = int(time.time())
    envd_host = f"{envd_port}-{sandbox}.{DOMAIN}"
    base = f"http://{envd_host}"
    valid_url = sign_url(base, "/home/user/a.txt", "read", "user", envd_token, 300, now)
    expired_url = sign_url(base, "/home/user/a.txt", "read", "user", envd_token, -60, now)
    write_url = sign_url(base, "/home/user/b.txt", "write", "", envd_token, None, now)
    forged = "v1_" + secrets.token_hex(20)
    other_sandbox_signature = file_signature("/x", "read", "", "other-" + envd_token, None)
    secret_values = {
        envd_token,
        traffic_token,
        wrong_envd,
        wrong_traffic,
        forged,
        other_sandbox_signature,
        _query_value(valid_url, "signature"),
        _query_value(expired_url, "signature"),
        _query_value(write_url, "signature"),
    }
    routes = [route(sandbox, envd_token=envd_token, traffic_token=traffic_token)]
    overrides = {"upstream": {"envd_port": envd_port}}
    relay = RelayProcess(tmp_path, routes, overrides, args=["--log-level", "DEBUG"])
    relay.start()
    try:
        app_host = f"{app_port}-{sandbox}.{DOMAIN}"

        def target(url: str) -> str:
            parts = urllib.parse.urlsplit(url)
            return f"{parts.path}?{parts.query}"

        cases: list[tuple[str, str, str, list[tuple[str, str]], int]] = [
            ("GET", "/health", envd_host, [("X-Access-Token", envd_token)], 200),
            ("GET", "/health", envd_host, [("X-Access-Token", wrong_envd)], 401),
            ("GET", target(valid_url), envd_host, [], 200),
            ("GET", target(expired_url), envd_host, [], 401),
            ("POST", target(write_url), envd_host, [], 200),
            ("GET", f"/files?path=%2Fx&signature={forged}", envd_host, [], 401),
            ("GET", f"/files?path=%2Fx&signature={other_sandbox_signature}", envd_host, [], 401),
            ("GET", "/app", app_host, [("E2b-Traffic-Access-Token", traffic_token)], 200),
            ("GET", "/app", app_host, [("E2b-Traffic-Access-Token", wrong_traffic)], 403),
            ("GET", "/app", app_host, [], 403),
            (
                "GET",
                "/hdr",
                f"sandbox.{DOMAIN}",
                [
                    ("E2b-Sandbox-Id", sandbox),
                    ("E2b-Sandbox-Port", str(envd_port)),
                    ("X-Access-Token", envd_token),
                ],
                200,
            ),
        ]
        for method, path, host, headers, status in cases:
            response = await request(relay.port, method, path, host, headers)
            assert response.status == status, (method, path, response.body)
            for value in secret_values:
                assert value.encode() not in response.body
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(
                f"{relay.url}/ws", headers={"Host": envd_host, "X-Access-Token": envd_token}
            ) as ws,
        ):
            await ws.send_str("in flight")
            assert (await ws.receive(2)).data == "in flight"
            metrics_status, metrics_body = await get(relay.admin_port, "/metrics")
            routes_status, routes_body = await get(relay.admin_port, "/routes")
        assert metrics_status == 200
        assert routes_status == 200
        await asyncio.sleep(0.1)
    finally:
        assert relay.stop() == 0
    output = relay.output()
    metrics_text = metrics_body.decode()
    routes_text = routes_body.decode()
    assert " INFO relay " in output  # logs were captured (at DEBUG level, the most talkative)
    for where, text in (("output", output), ("metrics", metrics_text), ("routes", routes_text)):
        for value in secret_values:
            assert value not in text, f"a credential leaked into {where}"
    assert sandbox not in metrics_text
    assert sandbox in routes_text  # ids are what /routes is for
    access = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert len(access) == len(cases) + 2  # + the WebSocket's 101 exchange and its session
    for line in access:
        assert set(line) == ACCESS_FIELDS
        assert line["path"] is None or "?" not in line["path"]
    statuses = sorted(line["status"] for line in access)
    assert statuses == sorted([c[4] for c in cases] + [101, 101])
    files = [line for line in access if line["path"] == "/files"]
    assert {line["status"] for line in files} == {200, 401}
    assert all(line["sandbox_id"] == sandbox for line in access)
